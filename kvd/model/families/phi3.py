"""Phi-3 and Phi-4: Llama's decoder whose checkpoints fuse q/k/v into qkv_proj and gate/up into gate_up_proj (cut
back into Llama's names as they load, so tensor parallelism slices them as any other), LongRoPE scaling
(kvd.model.layers.rotary), and a sliding window on every layer where the config sets one."""

from __future__ import annotations

from typing import Any

import torch

from kvd.model.config import Layout, ModelConfig
from kvd.model.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        window = hf_config.get("sliding_window")
        return Layout(sliding_window=None if window is None else int(window))

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        if ".qkv_proj." in name:
            parts = zip(
                ("q_proj", "k_proj", "v_proj"), (config.q_size, config.kv_size, config.kv_size), strict=True
            )
        elif ".gate_up_proj." in name:
            parts = zip(("gate_proj", "up_proj"), (config.intermediate_size,) * 2, strict=True)
        else:
            return [(name, tensor)]
        fused = name.split(".")[-2]
        names, sizes = zip(*parts, strict=True)
        if tensor.shape[0] != sum(sizes):
            return [(name, tensor)]  # load_weights names the shape it expected
        return [(name.replace(fused, n), t) for n, t in zip(names, tensor.split(sizes), strict=True)]

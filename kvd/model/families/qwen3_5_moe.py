"""Qwen3.5-MoE (text): Qwen3.5's hybrid decoder (kvd.model.families.qwen3_5) with a mixture of experts on every
layer: softmax over the experts, the top k rescaled to sum to 1, and a shared expert under a sigmoid gate."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvd.model.config import Layout, ModelConfig
from kvd.model.families.qwen2_moe import shared_expert_gate
from kvd.model.families.qwen3_5 import Qwen3_5ForCausalLM
from kvd.model.families.qwen3_moe import qwen_moe


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        named = Qwen3_5ForCausalLM.checkpoint_tensors(config, name, tensor)
        return [shared_expert_gate(*piece) for name, tensor in named for piece in per_expert(name, tensor)]

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        moe = qwen_moe(
            hf_config,
            # Qwen3.5-MoE's config has no norm_topk_prob (its router always rescales); Qwen3-Next's default is to
            normalize_top_k=bool(hf_config.get("norm_topk_prob", True)),
            shared_expert_size=int(hf_config.get("shared_expert_intermediate_size") or 0),
        )
        return dataclasses.replace(Qwen3_5ForCausalLM.read_layout(hf_config), moe=moe)


def per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's experts stacked in one tensor (transformers' fused layout: gate_up_proj [E, 2 width, hidden],
    down_proj [E, hidden, width]) as each expert's projections; any other tensor as it is."""
    base, dot, kind = name.rpartition(".experts.")
    if not dot or kind not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return [(name, tensor)]
    if kind == "down_proj":
        return [(f"{base}.experts.{e}.down_proj.weight", w) for e, w in enumerate(tensor)]
    width = tensor.shape[1] // 2
    return [
        (f"{base}.experts.{e}.{part}_proj.weight", half)
        for e, w in enumerate(tensor)
        for part, half in zip(("gate", "up"), w.split(width), strict=True)
    ]

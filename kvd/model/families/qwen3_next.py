"""Qwen3-Next: Qwen3.5's hybrid decoder (Gated DeltaNet and gated full attention, kvd.model.families.qwen3_5) with
Qwen2-MoE's mixture of experts (a shared expert under a sigmoid gate) in place of the MLP. Its checkpoints fuse the
DeltaNet's input projections per key head (LinearAttention.qkvz_parts, ba_parts); they are cut into Qwen3.5's
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a as they load (the value heads in the same order). llama.cpp's files
hold q/k/v and z apart already, the betas and decay inputs still fused (ssm_ba)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvd.model.config import Layout, ModelConfig
from kvd.model.decoder import WeightLoadError
from kvd.model.families.qwen2_moe import shared_expert_gate
from kvd.model.families.qwen3_5 import Qwen3_5ForCausalLM
from kvd.model.families.qwen3_5_moe import per_expert
from kvd.model.families.qwen3_moe import qwen_moe


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        shape = config.linear_attention
        for fused, parts, targets in (
            ("in_proj_qkvz", shape.qkvz_parts, ("in_proj_qkv",) * 3 + ("in_proj_z",)),
            ("in_proj_ba", shape.ba_parts, ("in_proj_b", "in_proj_a")),
        ):
            if name.endswith(f".{fused}.weight"):
                if tensor.shape[0] != shape.num_key_heads * sum(parts):
                    raise WeightLoadError(
                        f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {shape.num_key_heads} "
                        f"key heads of {sum(parts)}"
                    )
                base = name.removesuffix(f"{fused}.weight")
                cut: dict[str, list[torch.Tensor]] = {}
                for part, target in enumerate(targets):
                    cut.setdefault(target, []).append(tensor[shape.fused_rows(parts, part)])
                return [(f"{base}{target}.weight", torch.cat(pieces)) for target, pieces in cut.items()]
        named = Qwen3_5ForCausalLM.checkpoint_tensors(config, name, tensor)
        return [shared_expert_gate(*piece) for name, tensor in named for piece in per_expert(name, tensor)]

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        moe = qwen_moe(
            hf_config,
            normalize_top_k=bool(
                hf_config.get("norm_topk_prob", True)
            ),  # transformers' default for Qwen3-Next
            shared_expert_size=int(hf_config.get("shared_expert_intermediate_size") or 0),
        )
        return dataclasses.replace(Qwen3_5ForCausalLM.read_layout(hf_config), moe=moe)

"""Qwen3-Next: Qwen3.5-MoE's decoder (kvd.model.families.qwen3_5_moe: Qwen3.5's Gated DeltaNet and gated full
attention with Qwen2-MoE's mixture of experts), some layers possibly dense (mlp_only_layers, decoder_sparse_step).
Its checkpoints fuse the DeltaNet's input projections per key head (LinearAttention.qkvz_parts, ba_parts); they are
cut into Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a as they load (the value heads in the same
order). llama.cpp's files hold q/k/v and z apart already, the betas and decay inputs still fused (ssm_ba)."""

from __future__ import annotations

import torch

from kvd.model.config import ModelConfig
from kvd.model.decoder import WeightLoadError
from kvd.model.families.qwen3_5_moe import Qwen3_5MoeForCausalLM


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
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
        return Qwen3_5MoeForCausalLM.checkpoint_tensors(config, name, tensor)

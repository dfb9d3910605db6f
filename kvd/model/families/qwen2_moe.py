"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (a bias on q/k/v where qkv_bias says so), and a mixture of experts
in place of the MLP (softmax over every expert, the top k kept, rescaled where norm_topk_prob says so) beside a
shared expert that every token runs, scaled by sigmoid(a learned gate); the layers mlp_only_layers names or that
decoder_sparse_step skips keep a dense MLP."""

from __future__ import annotations

from typing import Any

import torch

from kvd.model.config import Layout, ModelConfig
from kvd.model.decoder import CausalLM
from kvd.model.families.qwen2 import sliding_layers
from kvd.model.families.qwen3_moe import qwen_moe


class Qwen2MoeForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        moe = qwen_moe(
            hf_config, shared_expert_size=int(hf_config.get("shared_expert_intermediate_size") or 0)
        )
        return Layout(
            attention_bias=bool(hf_config.get("qkv_bias", True)), moe=moe, **sliding_layers(hf_config)
        )

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        return [shared_expert_gate(name, tensor)]


def shared_expert_gate(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A checkpoint tensor, the shared expert's gate as [1, hidden] where a GGUF file holds it as [hidden]."""
    if name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
        return name, tensor.reshape(1, -1)
    return name, tensor

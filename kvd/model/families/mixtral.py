"""Mixtral: Mistral's attention and a mixture of experts on every layer (softmax over the experts, the top k
rescaled to sum to 1). Its checkpoints name the block block_sparse_moe and the experts' projections w1 (gate),
w3 (up) and w2 (down): renamed to Llama's as they load, so tensor parallelism slices them as any MLP."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvd.model.config import Layout, ModelConfig, read_moe
from kvd.model.families.mistral import MistralForCausalLM

_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


class MixtralForCausalLM(MistralForCausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        moe = read_moe(
            hf_config,
            "intermediate_size",
            normalize_top_k=True,
            activation=hf_config.get("hidden_act") or "silu",
        )
        return dataclasses.replace(MistralForCausalLM.read_layout(hf_config), moe=moe)

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        for theirs, ours in _NAMES:
            name = name.replace(theirs, ours)
        return [(name, tensor)]

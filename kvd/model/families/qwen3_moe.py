"""Qwen3-MoE: Qwen3's attention, and a mixture of experts in place of the MLP (softmax over every expert, the top
k kept, rescaled to sum to 1 where norm_topk_prob says so), but on the layers mlp_only_layers names or that
decoder_sparse_step skips, which keep a dense MLP."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvd.model.config import Layout, MoE, read_moe
from kvd.model.families.qwen3 import Qwen3ForCausalLM


def qwen_moe(hf_config: dict[str, Any], **variant: Any) -> MoE:
    """Qwen2-MoE's and Qwen3-MoE's experts: moe_intermediate_size wide, the top k rescaled where norm_topk_prob says
    so (or as `variant` says), and a dense MLP on the layers mlp_only_layers names or decoder_sparse_step skips;
    `variant`: the rest."""
    step = int(hf_config.get("decoder_sparse_step") or 1)
    only_mlp = set(hf_config.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(int(hf_config["num_hidden_layers"])) if i in only_mlp or (i + 1) % step)
    variant.setdefault("normalize_top_k", bool(hf_config.get("norm_topk_prob", False)))
    return read_moe(
        hf_config,
        "moe_intermediate_size",
        activation=hf_config.get("hidden_act") or "silu",
        dense_layers=dense,
        **variant,
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        return dataclasses.replace(Qwen3ForCausalLM.read_layout(hf_config), moe=qwen_moe(hf_config))

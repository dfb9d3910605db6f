"""Qwen3: Qwen2's sliding-window rule, an RMSNorm over each head of q and k before RoPE, and (unlike Qwen2)
a bias on q/k/v and o only when attention_bias says so."""

from __future__ import annotations

from typing import Any

from kvd.model.config import Layout
from kvd.model.decoder import CausalLM
from kvd.model.families.qwen2 import sliding_layers


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        bias = bool(hf_config.get("attention_bias", False))
        return Layout(attention_bias=bias, o_proj_bias=bias, qk_norm=True, **sliding_layers(hf_config))

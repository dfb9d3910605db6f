"""Llama: the shared decoder as it is; attention_bias puts a bias on q/k/v and o alike, mlp_bias on the MLP."""

from __future__ import annotations

from typing import Any

from kvd.model.config import Layout
from kvd.model.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        bias = bool(hf_config.get("attention_bias", False))
        # A sliding_window value in a Llama config is not used: every layer attends over the whole context.
        return Layout(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(hf_config.get("mlp_bias", False)))

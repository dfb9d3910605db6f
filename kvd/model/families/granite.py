"""Granite: Llama's decoder with four multipliers (kvd.model.config.Layout): the token embeddings scaled, each
attention and MLP output scaled before the residual add, the attention scores' own scale, the logits divided."""

from __future__ import annotations

from typing import Any

from kvd.model.config import Layout
from kvd.model.decoder import CausalLM


class GraniteForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        bias = bool(hf_config.get("attention_bias", False))
        return Layout(
            attention_bias=bias,
            o_proj_bias=bias,
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            embedding_multiplier=float(hf_config.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf_config.get("residual_multiplier", 1.0)),
            attention_multiplier=float(hf_config.get("attention_multiplier", 1.0)),
            logits_scaling=float(hf_config.get("logits_scaling", 1.0)),
        )

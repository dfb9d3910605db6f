"""OLMo 2: Llama's projections with an RMSNorm after attention and after the MLP (before each residual add) and
none before them, q and k each normed over all their heads at once."""

from __future__ import annotations

from typing import Any

from kvd.model.config import Layout
from kvd.model.decoder import CausalLM


class Olmo2ForCausalLM(CausalLM):
    # OLMo 2 names its output norms by place; ours (kvd.model.decoder.DecoderLayer) by what they norm.
    WEIGHT_RENAMES = (
        (".post_attention_layernorm.", ".attn_output_norm."),
        (".post_feedforward_layernorm.", ".mlp_output_norm."),
    )

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        bias = bool(hf_config.get("attention_bias", False))
        return Layout(
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=True,
            qk_norm_all_heads=True,
            input_norms=False,
            output_norms=True,
        )

"""Gemma 3 (text): scaled token embeddings, (1 + weight) RMSNorms before and after attention and the MLP, q/k
norms, a GELU-gated MLP, sliding-window layers between full ones (five to one) with their own RoPE base, the
attention scale from query_pre_attn_scalar, and the logits optionally soft-capped."""

from __future__ import annotations

import math
from typing import Any

from kvd.model.config import FULL, SLIDING, Layout, UnsupportedModelError
from kvd.model.decoder import CausalLM

_LOCAL_ROPE_THETA = 10000.0  # transformers' default for rope_local_base_freq

# Gemma's turns: "user" and "model" only, system text leading the next user turn, each turn's text trimmed.
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ ns.system + (message['content'] or '') | trim }}{{ '<end_of_turn>\n' }}{% set ns.system = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


class Gemma3ForCausalLM(CausalLM):
    # Gemma names its four layer norms by place; ours (kvd.model.decoder.DecoderLayer) by what they feed.
    WEIGHT_RENAMES = (
        (".post_attention_layernorm.", ".attn_output_norm."),
        (".pre_feedforward_layernorm.", ".post_attention_layernorm."),
        (".post_feedforward_layernorm.", ".mlp_output_norm."),
    )
    CHAT_TEMPLATE = _CHAT_TEMPLATE

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        if hf_config.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention true is not supported; only causal is")
        bias = bool(hf_config.get("attention_bias", False))
        window = hf_config.get("sliding_window")
        types = hf_config.get("layer_types")
        if types is None:  # transformers' rule for configs without them: every sixth layer full
            pattern = int(hf_config.get("sliding_window_pattern", 6))
            layers = int(hf_config["num_hidden_layers"])
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        return Layout(
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=True,
            sliding_window=None if window is None else int(window),
            layer_types=tuple(types),
            sliding_rope_theta=_sliding_rope_theta(hf_config),
            norm_weight_offset=1.0,
            output_norms=True,
            final_logit_softcapping=hf_config.get("final_logit_softcapping"),
            embedding_multiplier=math.sqrt(int(hf_config["hidden_size"])),
            attention_multiplier=float(hf_config.get("query_pre_attn_scalar", 256)) ** -0.5,
        )


def _sliding_rope_theta(hf_config: dict[str, Any]) -> float:
    """The sliding layers' RoPE base: rope_parameters per layer type (transformers 5), else rope_local_base_freq."""
    per_type = (hf_config.get("rope_parameters") or {}).get(SLIDING)
    if per_type is None:
        return float(hf_config.get("rope_local_base_freq", _LOCAL_ROPE_THETA))
    if per_type.get("rope_type", "default") != "default":
        raise UnsupportedModelError(
            f"rope_parameters.{SLIDING}.rope_type {per_type['rope_type']!r} is not supported; only 'default' is"
        )
    return float(per_type.get("rope_theta", _LOCAL_ROPE_THETA))

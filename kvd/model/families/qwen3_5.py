"""Qwen3.5 (text): three of every four layers Gated DeltaNet (linear attention with a recurrent state,
kvd.model.layers.gated_delta), the fourth full attention whose query projection also gates its output; q/k norms;
every RMSNorm but the DeltaNet's output norm scales by (1 + weight); a quarter of each head rotated."""

from __future__ import annotations

from typing import Any

import torch

from kvd.model.config import FULL, LINEAR, Layout, LinearAttention, ModelConfig, UnsupportedModelError
from kvd.model.decoder import CausalLM, text_model_name

# A released Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration) holds its text model beside the vision tower and
# the multi-token-prediction layer, which kvd does not run.
_NOT_TEXT = ("model.visual.", "mtp.")


def linear_attention(hf_config: dict[str, Any]) -> LinearAttention:
    """The Gated DeltaNet layers' shape from config.json (Qwen3.5's and Qwen3-Next's keys)."""
    shape = LinearAttention(
        num_key_heads=int(hf_config.get("linear_num_key_heads", 16)),
        num_value_heads=int(hf_config.get("linear_num_value_heads", 32)),
        key_head_dim=int(hf_config.get("linear_key_head_dim", 128)),
        value_head_dim=int(hf_config.get("linear_value_head_dim", 128)),
        conv_kernel=int(hf_config.get("linear_conv_kernel_dim", 4)),
        # kvd's own key: a GGUF file's value heads in llama.cpp's tiled order (kvd.model.gguf_loader)
        tiled_value_heads=bool(hf_config.get("value_heads_tiled", False)),
    )
    if shape.num_value_heads % shape.num_key_heads:
        raise UnsupportedModelError(
            f"linear_num_value_heads ({shape.num_value_heads}) must be a multiple of linear_num_key_heads "
            f"({shape.num_key_heads})"
        )
    if not 1 <= shape.conv_kernel <= 17:
        raise UnsupportedModelError(
            f"linear_conv_kernel_dim {shape.conv_kernel} is not supported; 1 to 17 are"
        )
    return shape


def hybrid_layer_types(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """layer_types, or transformers' rule without them: every full_attention_interval-th layer full."""
    types = hf_config.get("layer_types")
    if types is None:
        interval = int(hf_config.get("full_attention_interval", 4))
        types = [
            FULL if (i + 1) % interval == 0 else LINEAR for i in range(int(hf_config["num_hidden_layers"]))
        ]
    if FULL not in types:
        raise UnsupportedModelError("layer_types has no full_attention layer; kvd needs at least one")
    return tuple(types)


class Qwen3_5ForCausalLM(CausalLM):
    # The DeltaNet's gated norm is a plain scale: renamed so that the (1 + weight) offset of norms passes it by.
    WEIGHT_RENAMES = ((".linear_attn.norm.weight", ".linear_attn.out_norm.scale"),)

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        name = text_model_name(name, _NOT_TEXT)
        return [] if name is None else [(name, tensor)]

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        bias = bool(hf_config.get("attention_bias", False))
        return Layout(
            attention_bias=bias,
            o_proj_bias=bias,
            qk_norm=True,
            norm_weight_offset=1.0,
            attention_output_gate=True,
            layer_types=hybrid_layer_types(hf_config),
            linear_attention=linear_attention(hf_config),
        )

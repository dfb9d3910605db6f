"""gpt-oss: attention with biases, sinks (a learned logit per head in each softmax's denominator) and sliding
layers between full ones, YaRN RoPE; a mixture of experts on every layer whose router has a bias and softmaxes
over the top k logits only, and whose experts have biases and a clamped SwiGLU.

Its checkpoints hold each layer's experts in three tensors, inputs first ([experts, hidden, 2 x width] with gate
and up interleaved column by column, and [experts, width, hidden]): cut into each expert's Llama-named
matrices as they load, so that quantization and tensor parallelism treat them as any MLP's."""

from __future__ import annotations

from typing import Any

import torch

from kvd.model.config import (
    CLAMPED_SWIGLU,
    TOPK_THEN_SOFTMAX,
    Layout,
    ModelConfig,
    UnsupportedModelError,
    read_moe,
)
from kvd.model.decoder import CausalLM

_EXPERTS = ".mlp.experts."


class GptOssForCausalLM(CausalLM):
    WEIGHT_RENAMES = ((".mlp.router.", ".mlp.gate."),)

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        method = (hf_config.get("quantization_config") or {}).get("quant_method")
        if method is not None:  # the released checkpoints: MXFP4 experts as *_blocks / *_scales tensors
            raise UnsupportedModelError(
                f"gpt-oss checkpoints quantized with {method!r} are not supported as safetensors; load its GGUF file "
                "(its MXFP4 experts run natively) or a dequantized (bf16) checkpoint"
            )
        window = hf_config.get("sliding_window")
        types = hf_config.get("layer_types")
        if types is None:  # transformers' rule: even layers slide
            types = [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(int(hf_config["num_hidden_layers"]))
            ]
        moe = read_moe(
            hf_config,
            "intermediate_size",
            scoring=TOPK_THEN_SOFTMAX,
            router_bias=True,
            expert_bias=True,
            activation=CLAMPED_SWIGLU,
            swiglu_alpha=float(hf_config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf_config.get("swiglu_limit", 7.0)),
        )
        return Layout(
            attention_bias=True,
            o_proj_bias=True,
            attention_sinks=True,
            sliding_window=None if window is None else int(window),
            layer_types=tuple(types),
            moe=moe,
        )

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        if _EXPERTS not in name:
            return [(name, tensor)]
        prefix, kind = name.split(_EXPERTS)
        if kind == "gate_up_proj":  # [E, hidden, 2 width]: gate the even columns, up the odd
            parts = (("gate_proj.weight", lambda t: t[:, 0::2].T), ("up_proj.weight", lambda t: t[:, 1::2].T))
        elif kind == "gate_up_proj_bias":
            parts = (("gate_proj.bias", lambda t: t[0::2]), ("up_proj.bias", lambda t: t[1::2]))
        elif kind == "down_proj":  # [E, width, hidden]
            parts = (("down_proj.weight", lambda t: t.T),)
        elif kind == "down_proj_bias":
            parts = (("down_proj.bias", lambda t: t),)
        else:
            return [(name, tensor)]  # load_weights names it as having no place
        return [
            (f"{prefix}{_EXPERTS}{e}.{part}", cut(tensor[e]).contiguous())
            for e in range(tensor.shape[0])
            for part, cut in parts
        ]

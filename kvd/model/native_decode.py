"""Decode steps through all decoder layers in one native call (CPU, float32).

Between kernels, a Python layer loop costs more than the kernels of a small model at batch 1: each layer makes
a dozen calls, and the weights streamed through the caches evict the interpreter's own data between them. When
every piece of the model has a native kernel, a step whose tokens all decode (one new token per sequence) runs
the layer loop in C instead: the same kernels in the same order as the Python loop, so the results are equal.
Quantized linears take any batch; float32 ones up to linear.NATIVE_MAX_ROWS (beyond, torch's matmul is faster).
"""

from __future__ import annotations

import ctypes

import torch

from kvd.kernels import cpu_native
from kvd.model.layers.attention import AttentionMetadata
from kvd.model.layers.linear import NATIVE_MAX_ROWS, Linear
from kvd.model.layers.native_attention import NativeAttentionBackend, NativeDecodePlan
from kvd.model.layers.quantized_linear import NativeQuantizedLinear


class LayerWeights(ctypes.Structure):
    """kvd_layer."""

    _fields_ = [
        ("input_norm", ctypes.c_size_t),
        ("post_attention_norm", ctypes.c_size_t),
        ("q_norm", ctypes.c_size_t),
        ("k_norm", ctypes.c_size_t),
        ("qkv", cpu_native.LinearWeight),
        ("o", cpu_native.LinearWeight),
        ("gate_up", cpu_native.LinearWeight),
        ("down", cpu_native.LinearWeight),
        ("kv_cache", ctypes.c_size_t),
    ]


class ModelShape(ctypes.Structure):
    """kvd_shape."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def _linears(layers: torch.nn.ModuleList) -> list[torch.nn.Module]:
    return [
        m
        for layer in layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]


def _norm(module: torch.nn.Module | None) -> int:
    return 0 if module is None else module.weight.data_ptr()


class NativeDecoder:
    """The decoder layers of one model, bound to its KV pool, as the native layer loop sees them."""

    def __init__(self, model: torch.nn.Module) -> None:
        config, layers = model.config, model.model.layers
        cache = layers[0].self_attn.kv_cache
        self.shape = ModelShape(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, cache.shape[1], cache.shape[2], config.rms_norm_eps, config.head_dim**-0.5,
        )  # fmt: skip
        weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights.append(
                LayerWeights(
                    _norm(layer.input_layernorm),
                    _norm(layer.post_attention_layernorm),
                    _norm(attn.q_norm),
                    _norm(attn.k_norm),
                    attn.qkv_proj.native_weight(),
                    attn.o_proj.native_weight(),
                    mlp.gate_up_proj.native_weight(),
                    mlp.down_proj.native_weight(),
                    attn.kv_cache.data_ptr(),
                )
            )
        self.layers = (LayerWeights * len(weights))(*weights)
        self.key = self._key(model)
        float_linears = any(isinstance(m, Linear) for m in _linears(layers))
        self.max_rows = NATIVE_MAX_ROWS if float_linears else None

    @staticmethod
    def _key(model: torch.nn.Module) -> tuple[int, ...]:
        """The first layer's projection and where its weight and pool lie: a model whose modules were replaced
        or whose buffers moved is bound anew."""
        attn = model.model.layers[0].self_attn
        weight = getattr(attn.qkv_proj, "native_weight", None)
        return id(attn.qkv_proj), weight().data if weight else 0, attn.kv_cache.data_ptr()

    @staticmethod
    def applies(model: torch.nn.Module) -> bool:
        """Whether every piece of the model's decode step has a native kernel here."""
        layers = model.model.layers
        if not isinstance(model.attention_backend, NativeAttentionBackend) or not cpu_native.available():
            return False
        if layers[0].self_attn.kv_cache is None or model.rotary.cos_sin_cache.dtype != torch.float32:
            return False
        caches = [layer.self_attn.kv_cache for layer in layers]
        natives = all(
            isinstance(m, NativeQuantizedLinear)
            or (isinstance(m, Linear) and m.weight.dtype == torch.float32)
            for m in _linears(layers)
        )
        return natives and all(c.dtype == torch.float32 and c.is_contiguous() for c in caches)

    def valid_for(self, model: torch.nn.Module) -> bool:
        return self.key == self._key(model)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether this bound loop runs a step of hidden.shape[0] tokens (see max_rows)."""
        return self.max_rows is None or hidden.shape[0] <= self.max_rows

    @staticmethod
    def decodes(hidden: torch.Tensor, attn: AttentionMetadata) -> bool:
        """A float32 step in which every sequence decodes one token, in batch order."""
        decode = getattr(attn, "decode", None)
        return (
            isinstance(decode, NativeDecodePlan)
            and attn.prefill is None
            and decode.rows is None
            and hidden.dtype == torch.float32
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        cos_sin: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
    ) -> None:
        """Run every layer in place on hidden and residual [S, hidden_size] (contiguous float32)."""
        plan: NativeDecodePlan = attn.decode
        positions = positions.contiguous()
        status = cpu_native.library().kvd_decode_layers(
            ctypes.addressof(self.shape), ctypes.addressof(self.layers), len(self.layers), hidden.data_ptr(), residual.data_ptr(),
            hidden.shape[0], cos_sin.data_ptr(), positions.data_ptr(), attn.slot_mapping.data_ptr(),
            plan.block_tables.data_ptr(), plan.block_tables.shape[1], plan.context_lens.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise cpu_native.NativeKernelError("decode layers: out of memory")

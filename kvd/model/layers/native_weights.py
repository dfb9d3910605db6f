"""Which linears kvd's native kernels compute exactly as the Python layers do, and their weights as the kernels
take them: for the native layer loop (kvd.model.native_decode) and the native mixture of experts (moe)."""

from __future__ import annotations

import torch

from kvd.kernels import cpu_native
from kvd.model.layers.gguf_linear import GGUFLinear
from kvd.model.layers.linear import Linear
from kvd.model.layers.quantized_linear import NativeQuantizedLinear


def native_linear(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether a native loop computes this linear as its Python forward does: quantized (the kernel adds a float32
    bias), float32, or bfloat16 with batch invariance and no bias (torch adds a bf16 bias after rounding)."""
    if isinstance(module, NativeQuantizedLinear):
        return True
    if isinstance(module, GGUFLinear):  # its float parts are in the model's dtype, run by the same kernels
        return len(module.specs) <= cpu_native.MAX_PARTS
    if not isinstance(module, Linear) or module.weight.dtype != dtype:
        return False
    return dtype == torch.float32 or (module.batch_invariant and module.bias is None)


def native_parts(module: torch.nn.Module) -> tuple[cpu_native.LinearWeight, ...]:
    """A fused projection's weights as a native loop takes them: one, or a GGUF file's parts in their types."""
    return tuple(module.native_weights()) if isinstance(module, GGUFLinear) else (module.native_weight(),)

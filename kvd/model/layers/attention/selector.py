"""--attention-backend auto|torch|native|triton|flash-attn: which backend runs, and the block size it wants.

auto = flash-attn on CUDA when it is installed and the dtype is 16-bit, else triton on CUDA; on the CPU native
(kvd's own kernels) when they could be built on this host, else torch.
Asking for a backend whose package or device is missing is an error that says what to install or pick instead.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from kvd.kernels import cpu_native
from kvd.model.layers.attention.attention_base import (
    AttentionBackend,
    AttentionBackendError,
    AttentionBackendUnavailableError,
    resolve_block_size,
)
from kvd.model.layers.attention.flash_attention import FlashAttentionBackend
from kvd.model.layers.attention.native_attention import NativeAttentionBackend
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend
from kvd.model.layers.attention.triton_attention import TritonAttentionBackend

# Importing a backend is cheap: triton and flash_attn are imported when a kernel is launched or a backend built.
BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend
    for backend in (
        TorchAttentionBackend,
        NativeAttentionBackend,
        TritonAttentionBackend,
        FlashAttentionBackend,
    )
}
BACKEND_NAMES = ("auto", *BACKENDS)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's widest head (Gemma 4's full layers have 512)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend_name(
    name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int = 128
) -> str:
    """The concrete backend for `name` on this device and dtype, for heads of up to `head_dim` values; raises if it
    cannot run here."""
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return "native" if cpu_native.available() and dtype in _NATIVE_DTYPES else "torch"
        if dtype in _HALF_DTYPES and _installed("flash_attn") and head_dim <= FLASH_MAX_HEAD_DIM:
            return "flash-attn"
        return "triton" if _installed("triton") else "torch"
    if name == "triton":
        if not _installed("triton"):
            raise AttentionBackendUnavailableError(
                "the triton attention backend needs triton: `pip install triton` (CUDA builds of torch bring "
                "it), or pick --attention-backend torch"
            )
        if device.type != "cuda" and not _interpreting():
            raise AttentionBackendError(
                f"the triton attention backend runs on CUDA, not {device}; use --attention-backend torch "
                "(TRITON_INTERPRET=1 runs it on CPU for testing only)"
            )
    elif name == "native":
        if device.type != "cpu" or dtype not in _NATIVE_DTYPES:
            raise AttentionBackendError(
                f"the native attention backend runs on the CPU in float32 or bfloat16, not {device} {dtype}; "
                "use --attention-backend torch"
            )
        if not cpu_native.available():
            raise AttentionBackendUnavailableError(
                "the native attention backend needs kvd's CPU kernels, which could not be built here (see the "
                "log: a C compiler is needed); pick --attention-backend torch"
            )
    elif name == "flash-attn":
        if device.type != "cuda":
            raise AttentionBackendError(f"the flash-attn backend runs on CUDA, not {device}; use torch")
        if dtype not in _HALF_DTYPES:
            raise AttentionBackendError(
                f"flash-attn computes in float16 or bfloat16, not {dtype}; pass --dtype bfloat16 or pick "
                "--attention-backend triton"
            )
        if head_dim > FLASH_MAX_HEAD_DIM:
            raise AttentionBackendError(
                f"flash-attn takes heads of up to {FLASH_MAX_HEAD_DIM} values; this model has {head_dim}: pick "
                "--attention-backend triton"
            )
        if not _installed("flash_attn"):
            raise AttentionBackendUnavailableError(
                "the flash-attn attention backend needs the flash-attn package: `pip install flash-attn "
                "--no-build-isolation` (or kvd[cuda]) on a CUDA host, or pick --attention-backend triton"
            )
    elif name != "torch":
        raise AttentionBackendError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    return name


def create_attention_backend(backend_name: str) -> AttentionBackend:
    """An instance of a resolved backend (see resolve_backend_name)."""
    if backend_name not in BACKENDS:
        raise AttentionBackendError(f"{backend_name!r} is not a concrete backend; resolve it first")
    return BACKENDS[backend_name]()


@dataclass(frozen=True)
class AttentionSelection:
    backend: AttentionBackend
    block_size: int


def select_attention_backend(
    name: str, device: torch.device | str, dtype: torch.dtype, block_size: int | None = None
) -> AttentionSelection:
    """Resolve `name` (one of BACKEND_NAMES), check the block size, build the backend."""
    resolved = resolve_backend_name(name, device, dtype)
    size = resolve_block_size(
        resolved, block_size
    )  # before building: a bad size fails before flash_attn loads
    return AttentionSelection(create_attention_backend(resolved), size)

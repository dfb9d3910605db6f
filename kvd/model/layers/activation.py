"""The gated activations of the MLP: act(gate) * up, SiLU (most families) or tanh-approximated GELU (Gemma), and
gpt-oss's clamped SwiGLU for its experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvd.kernels import cpu_native


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; torch's ops compute it in gate's memory (the caller's fresh projection output)."""
    if _native(gate, up):
        return cpu_native.silu_mul(gate, up)
    return F.silu(gate, inplace=True).mul_(up)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up (transformers' gelu_pytorch_tanh)."""
    if _native(gate, up):
        return cpu_native.gelu_tanh_mul(gate, up)
    return F.gelu(gate, approximate="tanh").mul_(up)


def clamped_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """gpt-oss's: g * sigmoid(alpha g) * (u + 1), with g = min(gate, limit) and u = up clipped to +-limit."""

    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp_(max=limit)
        return gate.mul_(torch.sigmoid(gate * alpha)).mul_(up.clamp(-limit, limit).add_(1))

    return activation


def _native(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # The native layer loop of decode steps (kvd.model.native_decode) uses the same kernels.
    return cpu_native.supports(gate) and gate.dim() == 2 and cpu_native.same_rows(gate, up)


def gated_activation(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The gated activation of config.hidden_act's name (kvd.model.config.SUPPORTED_ACTIVATIONS)."""
    return {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}[name]

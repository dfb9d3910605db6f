"""RMSNorm, with the residual add fused in front of it (one native kernel on the CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvd.kernels import cpu_native


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x) and x.dim() <= 3 and x.stride(-1) == 1:
            # The native layer loop of decode steps (kvd.model.native_decode) uses the same kernel.
            return cpu_native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Below float32, round as transformers does (normalize in float32, cast, then scale), as the kernel does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the sum is written into `residual`, which the caller owns."""
        if self._native(x) and residual.dtype == x.dtype and residual.is_contiguous():
            return cpu_native.add_rms_norm(x, residual, self.weight, self.eps)
        residual.add_(x)
        return self.forward(residual), residual

    def _native(self, x: torch.Tensor) -> bool:
        # In bfloat16 the kernel sums the squares in another order than torch: a last-bit difference can move a
        # value across a rounding boundary, so greedy tokens agree with transformers' mostly, not always.
        return cpu_native.supports(x) and x.dtype == self.weight.dtype


class UnscaledRMSNorm(RMSNorm):
    """RMSNorm without a learned scale (Gemma 4's value norm): its weight a constant 1, which no checkpoint holds."""

    def __init__(self, size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.eps = eps
        self.register_buffer("weight", torch.ones(size), persistent=False)

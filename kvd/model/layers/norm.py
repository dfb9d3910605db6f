"""RMSNorm, with the residual add fused in front of it (one native kernel on the CPU in float32)."""

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
        if x.dtype == torch.float32:
            if cpu_native.supports(x) and x.dim() <= 3 and x.stride(-1) == 1:
                # The native layer loop of decode steps (kvd.model.native_decode) uses the same kernel.
                return cpu_native.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Below float32, round as transformers does (normalize in float32, cast, then scale): tokens agree.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the sum is written into `residual`, which the caller owns."""
        # float32 only: in bfloat16 a last-bit difference in the float32 sum of squares (the kernel sums in
        # another order than torch) can move a value across a bf16 rounding boundary, and transformers' greedy
        # tokens are matched exactly there by torch's own ops below.
        same_dtype = residual.dtype == self.weight.dtype == x.dtype == torch.float32
        if same_dtype and cpu_native.supports(x) and residual.is_contiguous():
            return cpu_native.add_rms_norm(x, residual, self.weight, self.eps)
        residual.add_(x)
        return self.forward(residual), residual

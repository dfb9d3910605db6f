"""SiLU-and-multiply, the gated activation of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvd.kernels import cpu_native


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; torch's ops compute it in gate's memory (the caller's fresh projection output)."""
    if cpu_native.supports(gate) and gate.dim() == 2 and gate.stride() == up.stride() and gate.stride(1) == 1:
        # The native layer loop of decode steps (kvd.model.native_decode) uses the same kernel.
        return cpu_native.silu_mul(gate, up)
    return F.silu(gate, inplace=True).mul_(up)

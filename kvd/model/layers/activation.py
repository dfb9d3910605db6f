"""SiLU-and-multiply, the gated activation of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in gate's memory (the caller's fresh projection output)."""
    return F.silu(gate, inplace=True).mul_(up)

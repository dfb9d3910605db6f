"""The gated MLP: down(act(gate(x)), up(x)), as every dense family has it and as each expert of a mixture is."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvd.model.layers.linear import Linear


class GatedMLP(nn.Module):
    """gate and up stacked in one projection (one matmul), then the activation and down. Under tensor parallelism
    this rank's share of the intermediate columns: its output is a partial sum that the caller all-reduces."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(*self.gate_up_proj.forward_shards(x)))

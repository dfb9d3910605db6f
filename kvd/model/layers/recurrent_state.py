"""The recurrent state of linear-attention layers: per sequence a slot, per layer and slot the causal
convolution's window and the Gated DeltaNet's state matrices (kvd.model.layers.gated_delta).

A slot belongs to one running sequence, or holds a checkpoint (kvd.engine.state_slots); a sequence's first rows
start its state from zeros or from a checkpoint, every later step carries it on. Unlike K/V a state cannot be
rebuilt from blocks of a prefix, so a step names for each sequence where its state starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.distributed.step import RecurrentRows
from kvd.model.config import LINEAR, LinearAttention, ModelConfig


@dataclass
class LayerState:
    """One linear-attention layer's slots: conv [num_slots, conv_kernel - 1, conv_dim] holds each sequence's last
    inputs to the convolution (in the model's dtype, as they were), state [num_slots, value_heads, key_head_dim,
    value_head_dim] its DeltaNet state in float32."""

    conv: torch.Tensor
    state: torch.Tensor


@dataclass
class RecurrentStep:
    """A step's rows as the linear-attention layers read them: sequence s owns rows starts[s]:starts[s + 1] and
    state slot rows[s].slot, its state starting from rows[s].source (kvd.distributed.step.RecurrentRows); the
    tensors are the same on the host for the native kernel (int64)."""

    starts: list[int]
    rows: list[RecurrentRows]
    starts_t: torch.Tensor  # [S + 1]
    slots_t: torch.Tensor  # [S], and the next three likewise: RecurrentRows' fields
    sources_t: torch.Tensor
    snapshot_rows_t: torch.Tensor
    snapshot_slots_t: torch.Tensor

    @classmethod
    def build(cls, query_lens: list[int], rows: list[RecurrentRows]) -> RecurrentStep:
        if len(rows) != len(query_lens):
            raise ValueError(f"got the recurrent rows of {len(rows)} sequences for {len(query_lens)}")
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        columns = [torch.tensor(c, dtype=torch.int64) for c in zip(*rows, strict=True)] if rows else []
        empty = torch.zeros(0, dtype=torch.int64)
        slots, sources, snapshot_rows, snapshot_slots = columns or [empty] * 4
        return cls(starts, list(rows), torch.tensor(starts), slots, sources, snapshot_rows, snapshot_slots)


def linear_layers(config: ModelConfig) -> list[int]:
    return [i for i, kind in enumerate(config.layer_types) if kind == LINEAR]


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes one sequence's state takes across the model's linear-attention layers."""
    shape = config.linear_attention
    if shape is None:
        return 0
    conv = (shape.conv_kernel - 1) * shape.conv_dim * torch.empty((), dtype=dtype).element_size()
    state = shape.num_value_heads * shape.key_head_dim * shape.value_head_dim * 4
    return len(linear_layers(config)) * (conv + state)


def allocate_state(
    config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
) -> list[LayerState]:
    """Zeroed slots for each linear-attention layer, in layer order."""
    shape: LinearAttention | None = config.linear_attention
    if shape is None:
        return []
    return [
        LayerState(
            torch.zeros(num_slots, shape.conv_kernel - 1, shape.conv_dim, dtype=dtype, device=device),
            torch.zeros(
                num_slots,
                shape.num_value_heads,
                shape.key_head_dim,
                shape.value_head_dim,
                dtype=torch.float32,
                device=device,
            ),
        )
        for _ in linear_layers(config)
    ]

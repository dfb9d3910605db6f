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
    """A step's rows as the linear-attention layers read them: sequence s owns rows starts[s]:starts[s + 1] (its
    chunk's and its draft's: one recurrence) and state slot rows[s].slot, its state starting from rows[s].source,
    copied after its rows' snapshot rows into their slots (kvd.distributed.step.RecurrentRows); the tensors are the
    same on the host for the native kernel (int64)."""

    starts: list[int]
    rows: list[RecurrentRows]
    starts_t: torch.Tensor  # [S + 1]
    slots_t: torch.Tensor  # [S]
    sources_t: torch.Tensor  # [S]
    # [S + 1]: sequence s's snapshots are snapshot_starts_t[s]:[s + 1] of the next two
    snapshot_starts_t: torch.Tensor
    snapshot_rows_t: torch.Tensor
    snapshot_slots_t: torch.Tensor

    @classmethod
    def build(cls, query_lens: list[int], rows: list[RecurrentRows]) -> RecurrentStep:
        """From the attention's sequences (a sequence's draft rows follow its chunk as sequences of their own)."""
        if sum(1 + r.drafts for r in rows) != len(query_lens):
            raise ValueError(f"got the recurrent rows of {len(rows)} sequences for {len(query_lens)}")
        starts, snapshot_starts, i = [0], [0], 0
        for r in rows:
            starts.append(starts[-1] + sum(query_lens[i : i + 1 + r.drafts]))
            snapshot_starts.append(snapshot_starts[-1] + len(r.snapshots))
            i += 1 + r.drafts
        pairs = [pair for r in rows for pair in r.snapshots]

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return cls(
            starts,
            list(rows),
            column(starts),
            column([r.slot for r in rows]),
            column([r.source for r in rows]),
            column(snapshot_starts),
            column([row for row, _ in pairs]),
            column([slot for _, slot in pairs]),
        )

    @property
    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """What kvd_gated_delta reads of the step after the starts (cpu_native.gated_delta's `step`)."""
        return (
            self.slots_t,
            self.sources_t,
            self.snapshot_starts_t,
            self.snapshot_rows_t,
            self.snapshot_slots_t,
        )


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

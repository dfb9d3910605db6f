"""The recurrent state of linear-attention layers: per sequence a slot, per layer and slot the causal
convolution's window and the Gated DeltaNet's state matrices (kvd.model.layers.gated_delta).

A slot belongs to one running sequence (kvd.engine.block_manager hands them out with its blocks); a sequence's
first rows start its state from zeros, every later step carries it on. Unlike K/V a state cannot be rebuilt
from blocks of a prefix, so a step names for each sequence whether its state is fresh."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    state slot slots[s], which starts from zeros when fresh[s] (the sequence's first computed token is in the
    step)."""

    starts: list[int]
    slots: list[int]
    fresh: list[bool]
    # The same as tensors on the host, for the native kernel: int64 [S + 1], int64 [S], int32 [S].
    starts_t: torch.Tensor
    slots_t: torch.Tensor
    fresh_t: torch.Tensor

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], slots: list[int]) -> RecurrentStep:
        if len(slots) != len(query_lens):
            raise ValueError(f"got {len(slots)} state slots for {len(query_lens)} sequences")
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        fresh = [c == n for n, c in zip(query_lens, context_lens, strict=True)]
        return cls(
            starts,
            list(slots),
            fresh,
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(fresh, dtype=torch.int32),
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

"""Attention over the paged KV pool: per-step metadata and the backend interface that kernels plug into."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host-side step data on `device`. On CUDA it is staged in pinned memory and copied without
    blocking (torch's caching host allocator keeps those pinned blocks and reuses each once its copy is done),
    so building a step's metadata never waits on a pageable copy."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class AttentionMetadataError(ValueError):
    """The block tables, context lengths and query lengths of a step do not describe a valid batch."""


@dataclass
class AttentionMetadata:
    """One flat varlen step: sequence s owns rows query_start_loc[s] : query_start_loc[s + 1] of the batch."""

    # long [T]: the pool slot (block * block_size + offset) of each new token's K/V; -1 = do not write
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [S]: tokens in the cache after this step (cached + new)
    query_start_loc: torch.Tensor  # int32 [S + 1]: cu_seqlens of the new tokens
    max_query_len: int
    max_context_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass
class StepLayout:
    """The host-side description of a step that backends precompute their metadata from."""

    block_tables: list[list[int]]  # each trimmed to the blocks its context uses
    context_lens: list[int]
    query_lens: list[int]
    slot_mapping: list[int]
    block_size: int

    @property
    def query_starts(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the pool and attends each new token over its sequence's context."""

    name: ClassVar[str]
    metadata_cls: ClassVar[type[AttentionMetadata]] = AttentionMetadata

    def build_metadata(self, layout: StepLayout, device: torch.device | str) -> AttentionMetadata:
        """Tensors for one step; backends extend this to precompute what every layer would otherwise redo."""
        width = max((len(t) for t in layout.block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in layout.block_tables]
        return AttentionMetadata(
            slot_mapping=host_to_device(layout.slot_mapping, torch.long, device),
            block_tables=host_to_device(padded, torch.int32, device).view(len(padded), width),
            context_lens=host_to_device(layout.context_lens, torch.int32, device),
            query_start_loc=host_to_device(layout.query_starts, torch.int32, device),
            max_query_len=max(layout.query_lens, default=0),
            max_context_len=max(layout.context_lens, default=0),
            block_size=layout.block_size,
        )

    def check_metadata(self, attn: AttentionMetadata) -> None:
        """Refuse metadata built for another backend (it lacks what this one precomputes)."""
        if not isinstance(attn, self.metadata_cls):
            raise TypeError(
                f"the {self.name} attention backend got {type(attn).__name__}; build the step's metadata with "
                "build_attention_metadata(..., backend=<this backend>)"
            )

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] (after RoPE) -> output [T, heads, head_dim].

        kv_cache is the layer's [2, num_blocks, block_size, kv_heads, head_dim] pool tensor.
        """


def build_attention_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str,
    backend: AttentionBackend | None = None,
    slot_mapping: list[int] | None = None,
) -> AttentionMetadata:
    """Metadata for one step, built once and shared by every layer.

    Sequence s has context_lens[s] tokens in the cache after this step, of which the last query_lens[s] are
    computed now (they are the flat batch's rows for s, in order). The slot mapping follows from the block
    tables unless given (an explicit -1 leaves that row's K/V unwritten). `backend` defaults to the torch one;
    pass the model's backend when it uses another.
    """
    if not len(block_tables) == len(context_lens) == len(query_lens):
        raise AttentionMetadataError(
            f"got {len(block_tables)} block tables, {len(context_lens)} context lengths and "
            f"{len(query_lens)} query lengths; they must be one per sequence"
        )
    trimmed: list[list[int]] = []
    derived_slots: list[int] = []
    for table, ctx, n in zip(block_tables, context_lens, query_lens, strict=True):
        if not 0 < n <= ctx:
            raise AttentionMetadataError(f"query length {n} must be in 1..context length ({ctx})")
        num_blocks = -(-ctx // block_size)
        if len(table) < num_blocks:
            raise AttentionMetadataError(
                f"a context of {ctx} tokens needs {num_blocks} blocks of {block_size}; "
                f"the block table has {len(table)}"
            )
        trimmed.append(list(table[:num_blocks]))
        derived_slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)
        )
    if slot_mapping is not None and len(slot_mapping) != len(derived_slots):
        raise AttentionMetadataError(
            f"slot_mapping has {len(slot_mapping)} rows, the batch {len(derived_slots)}"
        )
    layout = StepLayout(
        trimmed, list(context_lens), list(query_lens), slot_mapping or derived_slots, block_size
    )
    if backend is None:
        # Imported here: the torch backend builds on this module.
        from kvd.model.layers.torch_attention import TorchAttentionBackend

        backend = TorchAttentionBackend()
    return backend.build_metadata(layout, device)

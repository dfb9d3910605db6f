"""What every attention backend builds on: step metadata, the backend interface, its errors and block sizes.

It imports no backend, so backends, the selector and attention.build_attention_metadata all import it at the top.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from kvd.model.layers.recurrent_state import RecurrentStep


def host_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host-side step data on `device`. On CUDA it is staged in pinned memory and copied without
    blocking (torch's caching host allocator keeps those pinned blocks and reuses each once its copy is done),
    so building a step's metadata never waits on a pageable copy."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class AttentionMetadataError(ValueError):
    """The block tables, context lengths and query lengths of a step do not describe a valid batch."""


class AttentionBackendError(ValueError):
    """The attention backend or block size asked for cannot run with this device, dtype or block size."""


class AttentionBackendUnavailableError(AttentionBackendError):
    """The attention backend asked for needs a package that is not installed."""


@dataclass(frozen=True)
class BlockSizeRule:
    default: int
    multiple_of: int


BLOCK_SIZE_RULES = {
    "torch": BlockSizeRule(16, 1),
    "native": BlockSizeRule(16, 1),
    "triton": BlockSizeRule(16, 1),
    "flash-attn": BlockSizeRule(256, 256),  # flash-attn's paged KV reads whole 256-token pages
}


def resolve_block_size(backend_name: str, block_size: int | None) -> int:
    """The block size to run with: the backend's default when None, else checked against its rule."""
    rule = BLOCK_SIZE_RULES[backend_name]
    if block_size is None:
        return rule.default
    if block_size < 1 or block_size % rule.multiple_of:
        raise AttentionBackendError(
            f"the {backend_name} attention backend needs a block size that is a positive multiple of "
            f"{rule.multiple_of}, got {block_size}; leave --block-size unset for its default ({rule.default})"
        )
    return block_size


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
    window: int | None = None  # each token sees only its context's last `window` tokens (a sliding layer)
    # This is KV group 0's metadata; these the same step's for groups 1.. (build_attention_metadata).
    other_groups: tuple[AttentionMetadata, ...] = ()
    # The step as linear-attention layers read it (their state slots); None in a model without them.
    recurrent: RecurrentStep | None = None

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
    window: int | None = None  # see AttentionMetadata.window

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
            window=layout.window,
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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] (after RoPE) -> output [T, heads, head_dim].

        kv_cache is the layer's [2, num_blocks, block_size, kv_heads, head_dim] pool tensor. sinks: None, or
        float32 [heads]: a logit per query head that joins its softmax's denominator and attends to nothing
        (attention sinks, as gpt-oss has).
        """

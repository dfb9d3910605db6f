"""Attention over the paged KV pool: the step metadata every layer shares, built by the model's backend.

The backends (one module each), the CUDA-graph hook some of them offer (graph_decode) and the choice between
them (selector) live in this package; they build on attention_base, whose names model code uses are
re-exported here.
"""

from __future__ import annotations

import dataclasses

import torch

from kvd.model.layers.attention.attention_base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataError,
    StepLayout,
    host_to_device,
)
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionMetadataError",
    "build_attention_metadata",
    "host_to_device",
]


def build_attention_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str,
    backend: AttentionBackend | None = None,
    slot_mapping: list[int] | None = None,
    window: int | None = None,
) -> AttentionMetadata:
    """Metadata for one step, built once and shared by every layer.

    Sequence s has context_lens[s] tokens in the cache after this step, of which the last query_lens[s] are
    computed now (they are the flat batch's rows for s, in order). The slot mapping follows from the block
    tables unless given (an explicit -1 leaves that row's K/V unwritten). `backend` defaults to the torch one;
    pass the model's backend when it uses another. `window`: the window of the model's sliding-window layers,
    for which the metadata's `sliding` is built (CausalLM.attention_window).
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
        backend = TorchAttentionBackend()
    metadata = backend.build_metadata(layout, device)
    if window is not None:
        if window < 1:
            raise AttentionMetadataError(f"a sliding window must be at least 1 token, got {window}")
        metadata.sliding = backend.build_metadata(dataclasses.replace(layout, window=window), device)
    return metadata

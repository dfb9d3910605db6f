"""Attention over the paged KV pool: the step metadata every layer shares, built by the model's backend.

The backends (one module each), the CUDA-graph hook some of them offer (graph_decode) and the choice between
them (selector) live in this package; they build on attention_base, whose names model code uses are
re-exported here.
"""

from __future__ import annotations

import torch

from kvd.distributed.step import RecurrentRows
from kvd.model.layers.attention.attention_base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataError,
    StepLayout,
    host_to_device,
)
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend
from kvd.model.layers.kv_cache import KVGroups
from kvd.model.layers.recurrent_state import RecurrentStep

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
    kv_groups: KVGroups | None = None,
    group_tables: list[list[list[int]]] | None = None,
    recurrent: list[RecurrentRows] | None = None,
) -> AttentionMetadata:
    """Metadata for one step, built once and shared by every layer.

    Sequence s has context_lens[s] tokens in the cache after this step, of which the last query_lens[s] are
    computed now (they are the flat batch's rows for s, in order). The slot mapping follows from the block
    tables unless given (an explicit -1 leaves that row's K/V unwritten). `backend` defaults to the torch one;
    pass the model's backend when it uses another. `kv_groups`: the model's (CausalLM.kv_groups), for whose
    groups 1.. the metadata's `other_groups` are built, each with its window: from `group_tables` (the block
    tables of groups 1.., in a pool allocated with the groups), or else from `block_tables` too; each group's
    blocks scaled to its layers' pages.
    """
    groups = kv_groups or KVGroups((), (), (None,))
    tables = [block_tables, *(group_tables or [block_tables] * (groups.num_groups - 1))]
    if len(tables) != groups.num_groups:
        raise AttentionMetadataError(
            f"got the block tables of {len(tables)} KV groups; the model has {groups.num_groups}"
        )
    if backend is None:
        backend = TorchAttentionBackend()
    metadata = [
        backend.build_metadata(
            _layout(
                _scaled(t, groups.block_scale(g)), context_lens, query_lens, block_size, slot_mapping, window
            ),
            device,
        )
        for g, (t, window) in enumerate(zip(tables, groups.windows, strict=True))
    ]
    metadata[0].other_groups = tuple(metadata[1:])
    if recurrent is not None:
        metadata[0].recurrent = RecurrentStep.build(query_lens, recurrent)
    return metadata[0]


def _scaled(block_tables: list[list[int]], scale: int) -> list[list[int]]:
    """A group's blocks as pages of its layers' pool views (kvd.model.layers.kv_cache: KVGroups.block_scales)."""
    return block_tables if scale == 1 else [[b * scale for b in table] for table in block_tables]


def _layout(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    slot_mapping: list[int] | None,
    window: int | None,
) -> StepLayout:
    if not len(block_tables) == len(context_lens) == len(query_lens):
        raise AttentionMetadataError(
            f"got {len(block_tables)} block tables, {len(context_lens)} context lengths and "
            f"{len(query_lens)} query lengths; they must be one per sequence"
        )
    if window is not None and window < 1:
        raise AttentionMetadataError(f"a sliding window must be at least 1 token, got {window}")
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
    if slot_mapping is not None:
        if len(slot_mapping) != len(derived_slots):
            raise AttentionMetadataError(
                f"slot_mapping has {len(slot_mapping)} rows, the batch {len(derived_slots)}"
            )
        # The given mapping's -1 rows stay unwritten in every group; the others follow each group's table.
        derived_slots = [
            -1 if given < 0 else slot for given, slot in zip(slot_mapping, derived_slots, strict=True)
        ]
    return StepLayout(trimmed, list(context_lens), list(query_lens), derived_slots, block_size, window)

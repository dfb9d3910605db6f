"""A request's token ids and where their K/V live in the paged pool."""

from __future__ import annotations

import itertools
from enum import Enum

from kvd.engine.state_slots import Snapshot

_seq_ids = itertools.count()

RELEASED = -1
"""A block table entry that a sliding-window group freed: its window has passed that block."""


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt, then generated) with the block table the block manager gives them.

    `num_cached_tokens` is set by the block manager at allocation: the prompt tokens whose K/V were found in
    the prefix cache. `num_computed_tokens` is advanced by the engine as forward passes write K/V; the block
    manager reads it to know which full blocks may be offered to other sequences.
    """

    def __init__(
        self,
        token_ids: list[int],
        block_size: int = 16,
        cache_salt: str | None = None,
        reads_prefix_cache: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.token_ids = list(token_ids)
        self.block_size = block_size
        # Requests with different salts never share cached K/V (per-tenant isolation).
        self.cache_salt = cache_salt
        # False for requests that need every prompt position computed (prompt logprobs, embeddings).
        self.reads_prefix_cache = reads_prefix_cache
        # One table per KV group (kvd.model.layers.kv_cache.KVGroups); a sliding group's starts with RELEASED.
        self.block_tables: list[list[int]] = [[]]
        self.num_released: list[int] = [0]  # per group: the leading RELEASED entries of its table
        # Its recurrent state's slot while allocated, in a model with linear-attention layers (else None); the
        # checkpoint its next step resumes from after a prefix hit; the snapshot that step takes; the slots its
        # step's draft rows leave their states in, the first once draft_base tokens are computed (block manager).
        self.state_slot: int | None = None
        self.restore_slot: int | None = None
        self.snapshot: Snapshot | None = None
        self.draft_slots: list[int] = []
        self.draft_base = 0
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.seq_id = next(_seq_ids)
        self.status = SequenceStatus.WAITING
        self.num_prompt_tokens = len(self.token_ids)
        # Tokens present when the scheduler last admitted it: below this the sequence is still in prefill.
        self.num_admitted_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table: every block of the sequence's tokens (all it holds with one KV group)."""
        return self.block_tables[0]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """Admitted tokens still lack K/V (a prefill chunk, not a decode, comes next)."""
        return self.num_computed_tokens < self.num_admitted_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks the tokens occupy (the block table may lag by one until `may_append`)."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        """The token ids of logical block `i`."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} out of range for a sequence of {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

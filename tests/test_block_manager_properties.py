"""Stateful property test: random interleavings of admit / prefill chunk / decode / preempt / free / reset.

Besides `check_invariants()` after every step, the machine keeps its own model of what each physical block
holds (the salt and the whole token prefix whose K/V were computed into it) and checks that every prefix-cache
hit hands out exactly the K/V the sequence would have computed itself.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from xxhash import xxh3_64_intdigest

from kvd.engine.block_manager import (
    BlockManager,
    DoubleFreeError,
    HashFn,
    NoFreeBlocksError,
    NoFreeStateSlotsError,
)
from kvd.engine.sequence import Sequence
from kvd.engine.state_slots import StateSlots

BS = 4
NUM_BLOCKS = 16
# Prompts start with a slice of one of these, so that prefixes are shared partly, wholly or not at all.
PREFIXES = (tuple(range(100, 112)), (*range(100, 108), 7, 7, 7, 7), tuple(range(200, 212)))
SALTS = (None, None, "tenant-a", "tenant-b")

SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class BlockManagerMachine(RuleBasedStateMachine):
    hash_fn: HashFn | None = None
    group_windows: tuple[int | None, ...] = (None,)  # KV groups: group 0 and any others, with their windows
    num_blocks = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            self.num_blocks, BS, hash_fn=self.hash_fn, group_windows=self.group_windows, states=self.states()
        )
        self.running: list[Sequence] = []
        self.stopped: list[Sequence] = []  # preempted or finished: their blocks are freed
        self.content: dict[int, tuple] = {}  # block id -> (group, salt, token prefix) computed into it

    def states(self) -> StateSlots | None:
        return None

    def _holds(self, seq: Sequence, g: int, i: int) -> tuple:
        return (g, seq.cache_salt, tuple(seq.token_ids[: (i + 1) * BS]))

    def _live(self, seq: Sequence):
        for g, table in enumerate(seq.block_tables):
            for i in range(seq.num_released[g], len(table)):
                yield g, i, table[i]

    def _admit(self, seq: Sequence, first_chunk: int | None = None) -> None:
        before = self.bm.usage()
        if not self.bm.can_allocate(seq, first_chunk):
            with pytest.raises((NoFreeBlocksError, NoFreeStateSlotsError)):
                self.bm.allocate(seq, first_chunk)
            assert seq.block_table == [] and self.bm.usage() == before
            return
        self.bm.allocate(seq, first_chunk)
        num_hit_blocks, rem = divmod(seq.num_cached_tokens, BS)
        assert rem == 0 and seq.num_cached_tokens < len(seq)
        for g, i, block_id in self._live(seq):
            if i < num_hit_blocks:
                assert self.content.get(block_id) == self._holds(seq, g, i)
            else:
                self.content.pop(block_id, None)  # a new block: whatever it held is overwritten
        self.running.append(seq)

    def _compute(self, seq: Sequence, num_tokens: int) -> None:
        """A forward pass writes the K/V of the next `num_tokens` tokens; each reads its window's blocks."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
        for g, (window, table) in enumerate(zip(self.group_windows, seq.block_tables, strict=True)):
            first_read = 0 if window is None else max(0, start - window + 1) // BS
            assert len(table) * BS >= end and seq.num_released[g] <= first_read, (g, table, start, end)
            for i in range(start // BS, end // BS):
                self.content[table[i]] = self._holds(seq, g, i)
        seq.num_computed_tokens = end
        self.bm.cache_computed_blocks(seq)

    def _stop(self, seq: Sequence) -> None:
        self.bm.deallocate(seq)
        assert seq.block_table == [] and seq.num_cached_tokens == 0
        self.running.remove(seq)
        self.stopped.append(seq)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        prefix_len=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), max_size=9),
        salt=st.sampled_from(SALTS),
    )
    def admit(self, prefix, prefix_len, suffix, salt):
        tokens = [*prefix[:prefix_len], *suffix] or [0]
        self._admit(Sequence(tokens, BS, cache_salt=salt), first_chunk=1 + len(suffix) % 8)

    @precondition(lambda self: self.stopped)
    @rule(i=st.integers(0, 1000))
    def readmit(self, i):
        """A preempted sequence comes back and recomputes what the cache no longer holds."""
        self._admit(self.stopped.pop(i % len(self.stopped)))

    @precondition(lambda self: any(s.num_computed_tokens < len(s) for s in self.running))
    @rule(i=st.integers(0, 1000), chunk=st.integers(1, 8))
    def prefill_chunk(self, i, chunk):
        prefilling = [s for s in self.running if s.num_computed_tokens < len(s)]
        seq = prefilling[i % len(prefilling)]
        chunk = min(chunk, len(seq) - seq.num_computed_tokens)
        if not self.bm.can_append(seq, chunk):  # a windowed group's blocks come chunk by chunk
            with pytest.raises(NoFreeBlocksError):
                self.bm.may_append(seq, chunk)
            self._stop(seq)
            return
        tables = [list(t) for t in seq.block_tables]
        self.bm.may_append(seq, chunk)
        for old, table in zip(tables, seq.block_tables, strict=True):
            for block_id in table[len(old) :]:
                self.content.pop(block_id, None)
        self._compute(seq, chunk)

    @precondition(lambda self: any(s.num_computed_tokens == len(s) for s in self.running))
    @rule(i=st.integers(0, 1000), token=st.integers(0, 3))
    def decode(self, i, token):
        decoding = [s for s in self.running if s.num_computed_tokens == len(s)]
        seq = decoding[i % len(decoding)]
        seq.append_token(token)
        if not self.bm.can_append(seq):
            with pytest.raises(NoFreeBlocksError):
                self.bm.may_append(seq)
            self._stop(seq)  # the scheduler would preempt it
            return
        lengths = [len(t) for t in seq.block_tables]
        self.bm.may_append(seq)
        for old, table in zip(lengths, seq.block_tables, strict=True):
            assert len(table) == seq.num_blocks
            for block_id in table[old:]:
                self.content.pop(block_id, None)
        self._compute(seq, 1)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 1000))
    def free(self, i):
        self._stop(self.running[i % len(self.running)])

    @precondition(lambda self: self.stopped)
    @rule(i=st.integers(0, 1000))
    def double_free(self, i):
        with pytest.raises(DoubleFreeError):
            self.bm.deallocate(self.stopped[i % len(self.stopped)])

    @rule()
    def reset_prefix_cache(self):
        assert self.bm.reset_prefix_cache() == (not self.running)
        if not self.running:
            assert self.bm.usage().cached_blocks == 0

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        usage = self.bm.usage()
        assert usage.used_blocks == len({b for s in self.running for _, _, b in self._live(s)})
        assert usage.used_blocks == sum(g.used_blocks for g in usage.groups)
        assert usage.cached_blocks == sum(g.cached_blocks for g in usage.groups)
        assert usage.used_blocks + usage.free_blocks == self.num_blocks
        assert usage.allocated_tokens + usage.internal_fragmentation_tokens == usage.reserved_tokens

    def teardown(self):
        for seq in list(self.running):
            self._stop(seq)
        self.bm.check_invariants()
        usage = self.bm.usage()
        assert usage.used_blocks == 0 and usage.free_blocks == self.num_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)


class RecurrentStateMachine(BlockManagerMachine):
    """A model with linear-attention layers: 3 live state slots, 2 checkpoints every 2 blocks. The machine keeps
    what each slot's state was computed from (salt and token prefix) as the runner would write it, and checks
    that a hit resumes from a checkpoint of exactly the prefix it skips."""

    def states(self) -> StateSlots:
        self.state: dict[int, tuple] = {}  # slot -> (salt, tokens) its state holds
        return StateSlots(3, 2, 2 * BS)

    def _admit(self, seq: Sequence, first_chunk: int | None = None) -> None:
        super()._admit(seq, first_chunk)
        if seq.state_slot is None:
            return
        if seq.num_cached_tokens:
            assert self.state[seq.restore_slot] == (
                seq.cache_salt,
                tuple(seq.token_ids[: seq.num_cached_tokens]),
            )
        else:
            assert seq.restore_slot is None

    def _compute(self, seq: Sequence, num_tokens: int) -> None:
        start = seq.num_computed_tokens
        snapshot = self.bm.plan_snapshot(seq, num_tokens)
        if snapshot is not None:
            assert start < snapshot.tokens <= start + num_tokens and snapshot.tokens % (2 * BS) == 0
            self.state[snapshot.slot] = (seq.cache_salt, tuple(seq.token_ids[: snapshot.tokens]))
        self.state[seq.state_slot] = (seq.cache_salt, tuple(seq.token_ids[: start + num_tokens]))
        super()._compute(seq, num_tokens)
        assert seq.restore_slot is None and seq.snapshot is None

    @precondition(lambda self: any(s.num_computed_tokens == len(s) for s in self.running))
    @rule(
        i=st.integers(0, 1000),
        token=st.integers(0, 3),
        draft=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        accepted=st.integers(0, 4),
    )
    def decode_with_draft(self, i, token, draft, accepted):
        """A decode step verifying a draft as long as the free slots and blocks allow: each row's state goes to a
        draft slot, the last to the sequence's own; after `accepted` draft tokens stood, the sequence's slot holds
        the state of exactly its computed tokens and the other slots are free."""
        decoding = [s for s in self.running if s.num_computed_tokens == len(s)]
        seq = decoding[i % len(decoding)]
        seq.append_token(token)
        if not self.bm.can_append(seq):
            self._stop(seq)
            return
        k = min(len(draft), self.bm.draft_room(seq, 1))
        k = k if k and self.bm.can_append(seq, num_lookahead=k) else 0
        lengths = [len(t) for t in seq.block_tables]
        self.bm.may_append(seq, num_lookahead=k)
        for old, table in zip(lengths, seq.block_tables, strict=True):
            for block_id in table[old:]:
                self.content.pop(block_id, None)
        if k:
            self.bm.take_draft_slots(seq, 1, k)
        start, tokens = seq.num_computed_tokens, [*seq.token_ids, *draft[:k]]
        snapshot = self.bm.plan_snapshot(seq, 1)
        if snapshot is not None:
            self.state[snapshot.slot] = (seq.cache_salt, tuple(tokens[: snapshot.tokens]))
        for j, slot in enumerate(seq.draft_slots):
            assert (start + 2 + j) % (2 * BS), "a draft row computes a checkpoint position's token"
            self.state[slot] = (seq.cache_salt, tuple(tokens[: start + 1 + j]))
        self.state[seq.state_slot] = (seq.cache_salt, tuple(tokens[: start + 1 + k]))
        BlockManagerMachine._compute(self, seq, 1)
        for t in draft[: min(accepted, k)]:
            seq.append_token(t)
            BlockManagerMachine._compute(self, seq, 1)
        self.bm.trim_lookahead(seq)
        self.bm.settle_draft_state(seq)
        assert seq.draft_slots == []
        assert self.state[seq.state_slot] == (seq.cache_salt, tuple(seq.token_ids[: seq.num_computed_tokens]))

    def teardown(self):
        super().teardown()
        assert self.bm.states.num_free_live == 3


class CollidingHashMachine(BlockManagerMachine):
    """Three hash values in all: nearly every lookup collides, and token plus parent checks must catch it."""

    @staticmethod
    def hash_fn(token_bytes: bytes, parent_hash: int) -> int:
        return xxh3_64_intdigest(token_bytes, parent_hash) % 3


class GroupedMachine(BlockManagerMachine):
    """Three KV groups: a window of 6 tokens (it frees blocks behind it) and a second full group."""

    group_windows = (None, 6, None)
    num_blocks = 28


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = SETTINGS
TestBlockManagerPropertiesWithCollisions = CollidingHashMachine.TestCase
TestBlockManagerPropertiesWithCollisions.settings = SETTINGS
TestBlockManagerPropertiesWithKVGroups = GroupedMachine.TestCase
TestBlockManagerPropertiesWithKVGroups.settings = SETTINGS
TestBlockManagerPropertiesWithRecurrentState = RecurrentStateMachine.TestCase
TestBlockManagerPropertiesWithRecurrentState.settings = SETTINGS

"""Block manager: one test (or more) per rule of the spec, the Sequence, and the seed benchmark's figures."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest
from xxhash import xxh3_64_intdigest

from benchmarks.block_manager import main, shared_prefix_report, speed_report
from kvd.engine import block_manager as block_manager_module
from kvd.engine import sequence as sequence_module
from kvd.engine.block_manager import (
    BlockManager,
    BlockManagerError,
    BlockSizeMismatchError,
    ComputedTokensError,
    DoubleFreeError,
    EmptySequenceError,
    InvariantError,
    NoFreeBlocksError,
    SequenceAlreadyAllocatedError,
    SequenceNotAllocatedError,
)
from kvd.engine.sequence import RELEASED, Sequence

BS = 4
PREFIX = list(range(100, 112))  # three full blocks of BS tokens


def seq_of(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(tokens, BS, cache_salt=salt)


def prefill(bm: BlockManager, seq: Sequence) -> Sequence:
    """Admit the sequence and compute its whole prompt, as the engine does."""
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_computed_blocks(seq)
    bm.check_invariants()
    return seq


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    """One decode step: the sampled token joins the sequence, gets a slot, and the forward computes it."""
    seq.append_token(token)
    bm.may_append(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_computed_blocks(seq)
    bm.check_invariants()


# Sequence


def test_sequence_blocks():
    seq = Sequence(list(range(10)), block_size=4, cache_salt="t")
    assert (len(seq), seq.num_blocks) == (10, 3)
    assert seq.block(0) == [0, 1, 2, 3] and seq.block(2) == [8, 9]
    assert seq.block_table == [] and seq.num_cached_tokens == 0 and seq.cache_salt == "t"
    with pytest.raises(IndexError):
        seq.block(3)
    seq.append_token(10)
    seq.append_token(11)
    assert seq.num_blocks == 3
    seq.append_token(12)
    assert seq.num_blocks == 4


def test_sequence_defaults_and_copies_tokens():
    tokens = [1, 2, 3]
    seq = Sequence(tokens)
    seq.append_token(4)
    assert seq.block_size == 16 and seq.cache_salt is None and tokens == [1, 2, 3]
    with pytest.raises(ValueError, match="block_size"):
        Sequence([1], block_size=0)


# Rule 1: ref-counted blocks


def test_two_sequences_share_a_three_block_prefix_with_ref_count_2():
    bm = BlockManager(16, BS)
    a = prefill(bm, seq_of([*PREFIX, 1, 2]))
    b = seq_of([*PREFIX, 3])
    bm.allocate(b)
    bm.check_invariants()
    assert b.block_table[:3] == a.block_table[:3]
    assert [bm.blocks[i].ref_count for i in b.block_table[:3]] == [2, 2, 2]
    assert a.block_table[3] != b.block_table[3]
    assert b.num_cached_tokens == 12
    assert bm.usage().used_blocks == 5


def test_shared_block_is_released_by_its_last_holder():
    bm = BlockManager(16, BS)
    a = prefill(bm, seq_of([*PREFIX, 1, 2]))
    b = prefill(bm, seq_of([*PREFIX, 3]))
    shared = a.block_table[:3]
    bm.deallocate(a)
    bm.check_invariants()
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1, 1]
    assert bm.usage().used_blocks == 4
    bm.deallocate(b)
    bm.check_invariants()
    assert [bm.blocks[i].ref_count for i in shared] == [0, 0, 0]
    assert bm.usage().used_blocks == 0
    assert a.block_table == [] and b.block_table == [] and a.num_cached_tokens == 0


# Rule 2: prefix caching with a verified chained hash


def test_third_sequence_hits_all_three_cached_blocks_after_both_free():
    bm = BlockManager(16, BS)
    a = prefill(bm, seq_of([*PREFIX, 1, 2]))
    shared = a.block_table[:3]
    b = prefill(bm, seq_of([*PREFIX, 3]))
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.usage().cached_blocks == 3
    c = seq_of([*PREFIX, 4, 5, 6])
    bm.allocate(c)
    bm.check_invariants()
    assert c.num_cached_tokens == 12 and c.num_computed_tokens == 12
    assert c.block_table[:3] == shared
    assert bm.usage().cached_blocks == 0  # the three were revived


def test_same_tokens_after_a_different_prefix_do_not_hit():
    bm = BlockManager(16, BS)
    prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    b = seq_of([9, 9, 9, 9, 5, 6, 7, 8, 0])
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_salted_request_never_hits_unsalted_or_other_salt_blocks():
    bm = BlockManager(32, BS)
    unsalted = prefill(bm, seq_of([*PREFIX, 1]))
    tenant_a = prefill(bm, seq_of([*PREFIX, 1], salt="tenant-a"))
    assert tenant_a.num_cached_tokens == 0
    assert not set(tenant_a.block_table) & set(unsalted.block_table)
    tenant_b = prefill(bm, seq_of([*PREFIX, 1], salt="tenant-b"))
    assert tenant_b.num_cached_tokens == 0
    assert not set(tenant_b.block_table) & (set(unsalted.block_table) | set(tenant_a.block_table))
    again_a = prefill(bm, seq_of([*PREFIX, 2], salt="tenant-a"))
    assert again_a.num_cached_tokens == 12 and again_a.block_table[:3] == tenant_a.block_table[:3]
    again_unsalted = prefill(bm, seq_of([*PREFIX, 2]))
    assert again_unsalted.block_table[:3] == unsalted.block_table[:3]


def test_forced_hash_collision_is_caught_by_token_verification():
    bm = BlockManager(16, BS, hash_fn=lambda token_bytes, parent_hash: 42)  # every block collides
    a = prefill(bm, seq_of([1, 2, 3, 4, 5]))
    b = seq_of([9, 9, 9, 9, 5])
    bm.allocate(b)
    bm.check_invariants()
    assert b.num_cached_tokens == 0
    assert b.block_table[0] != a.block_table[0]
    c = seq_of([1, 2, 3, 4, 6])  # a true hit still works under the colliding hash
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]


def test_collision_on_a_parent_block_is_caught_by_the_parent_identity():
    # Blocks [1,2,3,4] and [5,6,7,8] hash alike; every other hash is honest and chained.
    def colliding(token_bytes: bytes, parent_hash: int) -> int:
        if token_bytes == struct.pack("<4q", 5, 6, 7, 8):
            token_bytes = struct.pack("<4q", 1, 2, 3, 4)
        return xxh3_64_intdigest(token_bytes, parent_hash)

    bm = BlockManager(16, BS, hash_fn=colliding)
    x = prefill(bm, seq_of([1, 2, 3, 4, 0]))  # registers block [1,2,3,4]
    # [5,6,7,8] misses (token check), its copy stays unregistered; its child [10..13] is registered under the
    # same hash as a child of [1,2,3,4] would be.
    y = prefill(bm, seq_of([5, 6, 7, 8, 10, 11, 12, 13, 0]))
    assert y.num_cached_tokens == 0
    z = seq_of([1, 2, 3, 4, 10, 11, 12, 13, 0])
    bm.allocate(z)
    bm.check_invariants()
    # Block 0 is a true hit; block 1 matches by hash and tokens but was computed after [5,6,7,8]: rejected.
    assert z.num_cached_tokens == 4
    assert z.block_table[0] == x.block_table[0]
    assert z.block_table[1] != y.block_table[1]


def test_duplicate_content_keeps_its_children_findable():
    bm = BlockManager(16, BS)
    # Admitted together, both miss and compute the same first block; the second copy is not registered.
    a, b = seq_of([1, 2, 3, 4, 5]), seq_of([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and a.block_table[0] != b.block_table[0]
    for seq in (a, b):
        seq.num_computed_tokens = len(seq)
        bm.cache_computed_blocks(seq)
    for token in (6, 7, 8, 9):  # b decodes a second full block, chained on its unregistered copy
        decode(bm, b, token)
    c = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    assert c.block_table[:2] == [a.block_table[0], b.block_table[1]]


# Rule 3: cached-free blocks, plain free first, LRU eviction, revival


def test_freed_full_blocks_stay_cached_and_partial_ones_become_free():
    bm = BlockManager(8, BS)
    a = prefill(bm, seq_of([*PREFIX, 1, 2]))
    bm.deallocate(a)
    bm.check_invariants()
    usage = bm.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.cached_blocks) == (0, 8, 3)


def test_new_blocks_come_from_plain_free_blocks_before_evicting_cached_ones():
    bm = BlockManager(5, BS)
    a = prefill(bm, seq_of([*PREFIX, 1]))  # 3 full blocks + 1 partial
    bm.deallocate(a)  # 3 cached-free, 2 plain free
    b = seq_of([50, 51, 52, 53, 54])  # 2 fresh blocks: the plain free ones
    bm.allocate(b)
    bm.check_invariants()
    assert bm.prefix_cache_stats().evictions == 0 and bm.usage().cached_blocks == 3
    c = seq_of([60, 61])  # no plain block left: evicts the least recently used cached block
    bm.allocate(c)
    bm.check_invariants()
    assert bm.prefix_cache_stats().evictions == 1 and bm.usage().cached_blocks == 2
    # a was freed tail first, so its third block went first and its first two blocks still hit.
    bm.deallocate(b)
    bm.deallocate(c)
    d = seq_of([*PREFIX, 7])
    bm.allocate(d)
    assert d.num_cached_tokens == 8


def test_eviction_order_is_least_recently_used_and_removes_the_hash_entry():
    bm = BlockManager(4, BS)
    a = prefill(bm, seq_of([1, 2, 3, 4, 100]))
    b = prefill(bm, seq_of([5, 6, 7, 8, 100]))
    bm.deallocate(a)
    bm.deallocate(b)  # cached-free, least recently used first: a's block, b's block
    a_again = prefill(bm, seq_of([1, 2, 3, 4, 101]))  # revives a's block: now b's is the LRU one
    assert a_again.num_cached_tokens == 4
    bm.deallocate(a_again)
    x = seq_of([50, 51, 52, 53, 54, 55, 56, 57, 58])  # 3 blocks: 2 plain free + 1 eviction
    bm.allocate(x)
    bm.check_invariants()
    assert bm.prefix_cache_stats().evictions == 1
    bm.deallocate(x)  # never computed: nothing of x is cached
    assert bm.usage().cached_blocks == 1
    b_again = seq_of([5, 6, 7, 8, 100])
    bm.allocate(b_again)
    assert b_again.num_cached_tokens == 0  # b's block was evicted and its hash entry removed
    a_third = seq_of([1, 2, 3, 4, 100])
    bm.allocate(a_third)
    assert a_third.num_cached_tokens == 4
    bm.check_invariants()


def test_prompt_blocks_are_offered_only_once_computed():
    bm = BlockManager(16, BS)
    a = seq_of([*PREFIX, 1])
    bm.allocate(a)  # not computed yet: nothing to share
    b = seq_of([*PREFIX, 2])
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    a.num_computed_tokens = 9  # a chunked prefill computed two full blocks and a bit
    bm.cache_computed_blocks(a)
    bm.check_invariants()
    c = seq_of([*PREFIX, 3])
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]


def test_preempted_prefill_caches_only_its_computed_blocks():
    bm = BlockManager(16, BS)
    a = seq_of([*PREFIX, 1])
    bm.allocate(a)
    a.num_computed_tokens = 4
    bm.cache_computed_blocks(a)
    bm.deallocate(a)
    assert bm.usage().cached_blocks == 1
    bm.allocate(a)  # re-admitted: recomputes what was never written
    assert a.num_cached_tokens == 4


# Rule 4: can_allocate counts hits


def test_can_allocate_counts_hits_on_blocks_in_use():
    bm = BlockManager(5, BS)
    prefill(bm, seq_of([*PREFIX, 1]))  # 4 of 5 blocks used
    b = seq_of([*PREFIX, 2])  # 4 blocks, 3 of them hits in use: needs 1
    assert bm.num_free_blocks == 1 and b.num_blocks == 4
    assert bm.can_allocate(b)
    bm.allocate(b)
    bm.check_invariants()
    assert not bm.can_allocate(seq_of([*PREFIX, 3]))  # pool full now


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(4, BS)
    bm.deallocate(prefill(bm, seq_of([*PREFIX, 1])))  # 3 cached-free + 1 free
    too_long = seq_of([*PREFIX, *range(5)])  # 3 revived + 2 new = 5 > 4
    assert not bm.can_allocate(too_long)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(too_long)
    fits = seq_of([*PREFIX, 2])  # 3 revived + 1 new = 4
    assert bm.can_allocate(fits)
    bm.allocate(fits)
    bm.check_invariants()
    assert fits.num_cached_tokens == 12 and bm.num_free_blocks == 0


# Rule 5: the last prompt token is always computed


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, BS)
    a = prefill(bm, seq_of(PREFIX))  # exactly three full blocks
    a_blocks = list(a.block_table)
    bm.deallocate(a)
    b = seq_of(PREFIX)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 < len(b)
    assert b.block_table[:2] == a_blocks[:2] and b.block_table[2] != a_blocks[2]
    b.num_computed_tokens = len(b)
    bm.cache_computed_blocks(b)  # the recomputed copy of block 2 is a duplicate, not registered
    bm.check_invariants()
    bm.deallocate(b)
    assert bm.usage().cached_blocks == 3
    c = seq_of([*PREFIX, 1])
    bm.allocate(c)
    assert c.num_cached_tokens == 12


def test_one_token_prompt_caches_nothing():
    bm = BlockManager(4, 1)
    a = Sequence([7], block_size=1)
    bm.allocate(a)
    assert a.num_cached_tokens == 0


# Rule 6: the decode lag of the seed


def test_may_append_takes_a_block_exactly_when_len_mod_block_size_is_1():
    bm = BlockManager(4, BS)
    seq = prefill(bm, seq_of([1, 2, 3, 4]))
    for token in range(5, 17):
        seq.append_token(token)
        before = len(seq.block_table)
        assert bm.can_append(seq)
        bm.may_append(seq)
        assert len(seq.block_table) - before == (1 if len(seq) % BS == 1 else 0), len(seq)
        assert len(seq.block_table) == seq.num_blocks
        seq.num_computed_tokens = len(seq)
        bm.check_invariants()
    seq.append_token(17)  # needs a fifth block: none left
    assert not bm.can_append(seq)
    with pytest.raises(NoFreeBlocksError, match="can_append"):
        bm.may_append(seq)
    bm.check_invariants()


def test_cache_filled_block_registers_the_block_that_just_filled():
    bm = BlockManager(8, BS)
    a = prefill(bm, seq_of([1, 2, 3]))
    a.append_token(4)
    bm.may_append(a)  # len 4: block 0 is full, no new block
    bm.cache_filled_block(a)  # hashed and registered now, before the token's K/V is computed
    assert len(a.block_table) == 1 and bm.blocks[a.block_table[0]].hash is not None
    b = seq_of([1, 2, 3, 4, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants()


def test_block_size_one_decodes_and_caches():
    bm = BlockManager(8, 1)
    a = Sequence([5], block_size=1)
    prefill(bm, a)
    for token in (6, 7):
        decode(bm, a, token)
    assert len(a.block_table) == 3
    b = Sequence([5, 6, 7, 8], block_size=1)
    bm.allocate(b)
    assert b.num_cached_tokens == 3 and b.block_table[:3] == a.block_table


# Rule 7: metrics


def test_usage_counts_a_shared_block_once():
    bm = BlockManager(16, BS)
    prefill(bm, seq_of([*PREFIX, 1, 2]))  # 14 tokens
    prefill(bm, seq_of([*PREFIX, 3]))  # 13 tokens, 12 of them shared
    usage = bm.usage()
    assert usage.used_blocks == 5 and usage.free_blocks == 11 and usage.cached_blocks == 0
    assert usage.reserved_tokens == 20
    assert usage.allocated_tokens == 12 + 2 + 1
    assert usage.internal_fragmentation_tokens == 5
    assert usage.block_utilization == pytest.approx(15 / 20)


def test_usage_while_a_decode_waits_for_may_append():
    bm = BlockManager(4, BS)
    seq = prefill(bm, seq_of([1, 2, 3, 4]))
    seq.append_token(5)  # no slot yet: the token is not counted until may_append gives it one
    assert bm.usage().allocated_tokens == 4
    bm.may_append(seq)
    assert bm.usage().allocated_tokens == 5 and bm.usage().internal_fragmentation_tokens == 3


def test_prefix_cache_stats():
    bm = BlockManager(4, BS)
    assert bm.prefix_cache_stats().hit_rate == 0.0
    bm.deallocate(prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])))  # 9 queried, 0 hit; 2 cached
    bm.deallocate(prefill(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 10])))  # 9 queried, 8 hit
    prefill(bm, seq_of(list(range(20, 36))))  # 16 queried, 0 hit; 4 blocks: evicts the 2 cached
    stats = bm.prefix_cache_stats()
    assert (stats.queried_tokens, stats.hit_tokens, stats.evictions) == (34, 8, 2)
    assert stats.hit_rate == pytest.approx(8 / 34)


# Rule 8: misuse raises typed exceptions


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(2, BS)
    prefill(bm, seq_of([1, 2, 3, 4, 5]))
    seq = seq_of([9] * 5)
    before = bm.usage()
    with pytest.raises(NoFreeBlocksError, match="can_allocate"):
        bm.allocate(seq)
    assert seq.block_table == [] and bm.usage() == before
    bm.check_invariants()


def test_misuse_raises_typed_errors():
    bm = BlockManager(8, BS)
    seq = seq_of([1, 2, 3])
    with pytest.raises(SequenceNotAllocatedError, match="allocate it first"):
        bm.may_append(seq)
    with pytest.raises(SequenceNotAllocatedError):
        bm.cache_computed_blocks(seq)
    with pytest.raises(DoubleFreeError, match="never allocated"):
        bm.deallocate(seq)
    bm.allocate(seq)
    with pytest.raises(SequenceAlreadyAllocatedError):
        bm.allocate(seq)
    bm.deallocate(seq)
    with pytest.raises(DoubleFreeError, match="freed twice"):
        bm.deallocate(seq)
    with pytest.raises(BlockSizeMismatchError, match="block_size"):
        bm.allocate(Sequence([1, 2], block_size=8))
    with pytest.raises(EmptySequenceError):
        bm.allocate(seq_of([]))
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    with pytest.raises(ComputedTokensError, match="exceeds"):
        bm.cache_computed_blocks(seq)
    for error in (NoFreeBlocksError, DoubleFreeError, SequenceAlreadyAllocatedError, InvariantError):
        assert issubclass(error, BlockManagerError)
    assert issubclass(DoubleFreeError, SequenceNotAllocatedError)
    bm.check_invariants()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_constructor_validates(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


@pytest.mark.parametrize("module", [block_manager_module, sequence_module])
def test_no_assert_and_no_torch(module):
    """Validation must survive `python -O`, and the block manager stays torch-free."""
    tree = ast.parse(Path(module.__file__).read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.split(".")[0] == "torch"}


# reset, caching off, invariant checker


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    a = prefill(bm, seq_of([*PREFIX, 1]))
    assert bm.reset_prefix_cache() is False  # blocks in use
    bm.deallocate(a)
    assert bm.usage().cached_blocks == 3
    assert bm.reset_prefix_cache() is True
    bm.check_invariants()
    assert bm.usage().cached_blocks == 0
    b = seq_of([*PREFIX, 1])
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    bm.deallocate(prefill(bm, seq_of([*PREFIX, 1])))
    assert bm.usage().cached_blocks == 0
    b = prefill(bm, seq_of([*PREFIX, 1]))
    assert b.num_cached_tokens == 0
    decode(bm, b, 5)
    assert all(block.hash is None for block in bm.blocks)


def test_check_invariants_detects_corruption():
    bm = BlockManager(8, BS)
    a = prefill(bm, seq_of([*PREFIX, 1]))
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(InvariantError, match="ref_count"):
        bm.check_invariants()
    bm.blocks[a.block_table[0]].ref_count -= 1
    bm.blocks[a.block_table[1]].hash = 12345
    with pytest.raises(InvariantError):
        bm.check_invariants()


# The benchmark reproduces the seed's published figures

# The seed article's benchmark output for `--block-size 16 --total-blocks 64 --request-tokens 9,17,33,5,41,12`,
# as printed there (nanoLLMServe's KV block manager), and its per-request tables.
SEED_JSON = {
    "block_size": 16,
    "block_usage": {
        "allocated_tokens": 117,
        "block_utilization": 0.6647727272727273,
        "free_blocks": 53,
        "internal_fragmentation_tokens": 59,
        "reserved_tokens": 176,
        "used_blocks": 11,
    },
    "contiguous_fixed_slot_baseline": {
        "internal_fragmentation_tokens": 129,
        "reserved_tokens": 246,
        "utilization": 0.47560975609756095,
    },
    "fragmentation_tokens_saved_vs_contiguous": 70,
    "request_tokens": [9, 17, 33, 5, 41, 12],
}
# request: tokens, blocks, reserved, fragmentation, utilization | fixed slot: reserved, fragmentation, utilization
SEED_ROWS = {
    "A": ("9", "1", "16", "7", "56.3%", "41", "32", "22.0%"),
    "B": ("17", "2", "32", "15", "53.1%", "41", "24", "41.5%"),
    "C": ("33", "3", "48", "15", "68.8%", "41", "8", "80.5%"),
    "D": ("5", "1", "16", "11", "31.3%", "41", "36", "12.2%"),
    "E": ("41", "3", "48", "7", "85.4%", "41", "0", "100.0%"),
    "F": ("12", "1", "16", "4", "75.0%", "41", "29", "29.3%"),
    "total": ("117", "11", "176", "59", "66.5%", "246", "129", "47.6%"),
}
SEED_ARGV = ["--block-size", "16", "--total-blocks", "64", "--request-tokens", "9,17,33,5,41,12"]


def test_benchmark_json_is_the_seeds_published_output():
    printed: list[str] = []
    main([*SEED_ARGV, "--json"], out=printed.append)
    report = json.loads(printed[0])
    assert {k: report[k] for k in SEED_JSON} == SEED_JSON


def test_benchmark_table_is_the_seeds_published_table():
    printed: list[str] = []
    main(SEED_ARGV, out=printed.append)
    rows = {}
    for line in printed[0].splitlines():
        cells = line.replace("|", " ").split()
        if cells and cells[0] in SEED_ROWS:
            rows[cells[0]] = tuple(cells[1:])
    assert rows == SEED_ROWS
    assert "70 tokens saved" in printed[0]


def test_benchmark_shared_prefix():
    report = shared_prefix_report(4, prefix_tokens=64, suffix_tokens=8, block_size=16)
    assert (report["queried_tokens"], report["hit_tokens"]) == (4 * 72, 3 * 64)
    assert (report["used_blocks"], report["blocks_without_prefix_cache"], report["blocks_saved"]) == (
        8,
        20,
        12,
    )


def test_benchmark_speed_scenarios_do_what_their_labels_say():
    report = speed_report(block_size=16, prompt_tokens=256, num_seqs=8, repeats=2)
    prompt = report["prompt_us"]
    # "fully cached (all but the last block hit)" and "every block evicts an LRU cached one".
    assert prompt["cached"]["hit_tokens"] == 256 - 16
    assert prompt["cold_evicting"]["evictions"] == 256 // 16
    assert set(report["decode_step_us"]) == {"append", "append_no_prefix_caching", "cache_computed_blocks"}


# KV groups: group 0 keeps every block, a windowed group frees those its window has passed


def test_a_windowed_group_frees_the_blocks_its_window_has_passed():
    bm = BlockManager(32, BS, group_windows=(None, 6))
    seq = prefill(bm, seq_of([*PREFIX, 1, 2]))  # 14 tokens: the next (14) reads 9..14, blocks 2 and 3
    assert seq.block_tables[1][:2] == [RELEASED, RELEASED] and RELEASED not in seq.block_tables[1][2:]
    usage = bm.usage()
    assert [(g.window, g.used_blocks, g.cached_blocks) for g in usage.groups] == [(None, 4, 0), (6, 2, 2)]
    assert usage.used_blocks == 6
    for token in range(30):
        decode(bm, seq, token)
        # The window's 6 tokens span at most 3 blocks of 4; group 0 holds all 44 tokens' 11.
        assert len(seq.block_tables[1]) - seq.num_released[1] <= 3
    assert [g.used_blocks for g in bm.usage().groups] == [11, 2]
    bm.deallocate(seq)
    assert bm.usage().used_blocks == 0
    bm.check_invariants()


def test_a_windowed_group_takes_its_blocks_chunk_by_chunk():
    bm = BlockManager(32, BS, group_windows=(None, 6))
    seq = seq_of([*PREFIX, 1])  # 13 tokens
    assert bm.can_allocate(seq, 5)
    bm.allocate(seq, 5)  # group 0 holds the whole prompt, group 1 the first chunk's tokens 0..4
    assert [len(t) for t in seq.block_tables] == [4, 2]
    seq.num_computed_tokens = 5
    bm.cache_computed_blocks(seq)
    bm.may_append(seq, 8)  # tokens 5..12; token 5 reads 0..5, so nothing is freed yet
    assert [len(t) for t in seq.block_tables] == [4, 4] and seq.num_released == [0, 0]
    seq.num_computed_tokens = 13
    bm.cache_computed_blocks(seq)
    assert seq.num_released == [0, 2]  # token 13 reads 8..13
    bm.check_invariants()


def test_a_prefix_hit_needs_only_the_blocks_the_window_reads():
    bm = BlockManager(16, BS, group_windows=(None, 6))
    a = seq_of([*PREFIX, 1])
    bm.allocate(a)
    window_blocks = a.block_tables[1][1:3]
    a.num_computed_tokens = len(a)
    bm.cache_computed_blocks(a)  # frees group 1's blocks 0 and 1
    bm.deallocate(a)
    b = seq_of([*PREFIX, 2, 3])
    bm.allocate(b)  # 12 tokens hit: token 12 reads 7..12, blocks 1 and 2 of group 1
    assert b.num_cached_tokens == 12
    assert b.block_tables[1][:3] == [RELEASED, *window_blocks] and b.num_released == [0, 1]
    bm.check_invariants()


@pytest.mark.parametrize(("evicted", "hit_tokens"), [(1, 12), (2, 0)])
def test_a_prefix_hit_stops_where_a_window_block_was_evicted(evicted, hit_tokens):
    bm = BlockManager(16, BS, group_windows=(None, 6))
    bm.deallocate(prefill(bm, seq_of([*PREFIX, 1])))
    # Cached-free, least recent first: group 1's blocks 0 and 1 (freed as the window passed), group 0's 2, 1, 0,
    # group 1's 2. Ten plain free blocks; the filler takes 10 + `evicted`.
    filler = seq_of(list(range(500, 524)))  # group 0: 6 blocks; group 1: the first chunk's
    bm.allocate(filler, 4 * (4 + evicted))
    assert bm.prefix_cache_stats().evictions == evicted
    bm.deallocate(filler)
    again = seq_of([*PREFIX, 2, 3])
    bm.allocate(again)
    assert again.num_cached_tokens == hit_tokens  # group 0's chain is whole; group 1's window decides
    bm.check_invariants()


def test_windows_are_validated_and_group_0_keeps_every_block():
    with pytest.raises(ValueError, match="group_windows"):
        BlockManager(8, BS, group_windows=(6, None))
    with pytest.raises(ValueError, match="window"):
        BlockManager(8, BS, group_windows=(None, 0))


def test_a_block_registered_ahead_of_its_last_token_is_forgotten_if_that_step_never_ran():
    """cache_filled_block registers the block a decode's token fills before the step writes that token's K/V;
    a sequence preempted after it was scheduled (a later prefill chunk needing its blocks) never writes it."""
    bm = BlockManager(16, BS)
    seq = prefill(bm, seq_of(PREFIX[:7]))
    seq.append_token(99)  # token 7 fills block 1
    bm.may_append(seq)
    bm.cache_filled_block(seq)
    bm.deallocate(seq)  # preempted: token 7's K/V was never written
    bm.check_invariants()
    again = seq_of([*PREFIX[:7], 99, 5])
    bm.allocate(again)
    assert again.num_cached_tokens == BS  # block 0 only; block 1 would hand out a slot nobody wrote


def test_the_first_chunk_shrinks_to_the_blocks_a_windowed_group_can_have():
    bm = BlockManager(9, BS, group_windows=(None, 6))
    seq = seq_of(list(range(500, 528)))  # 28 tokens: group 0 takes 7 blocks whatever the chunk
    assert bm.first_chunk(seq, 64) == 2 * BS  # two blocks left for group 1: a chunk of 8 tokens
    assert not bm.can_allocate(seq, 9) and bm.can_allocate(seq, 8)
    assert BlockManager(7, BS, group_windows=(None, 6)).first_chunk(seq, 64) == 0  # none left for group 1
    assert BlockManager(9, BS).first_chunk(seq, 64) == 64  # without a window the chunk takes no blocks
    bm.allocate(seq, 8)
    assert [len(t) for t in seq.block_tables] == [7, 2] and bm.num_free_blocks == 0

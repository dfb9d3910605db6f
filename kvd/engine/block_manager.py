"""Paged-KV block manager: ref-counted blocks, prefix caching with verified hits, LRU reuse of cached blocks.

Every physical block is in exactly one state:
  used         ref_count > 0, listed in the block table of each sequence that holds it;
  cached-free  ref_count 0, full and registered in the hash map: findable until its memory is needed;
  free         ref_count 0, holds nothing anyone can find.
New blocks come from `free` first, then from `cached-free`, least recently used first (an eviction).

A full block is registered under a chained hash of its parent's hash and its token ids (for a first block the
parent hash comes from the request's cache salt). Prompt blocks are registered once the engine reports their
K/V computed (`cache_computed_blocks`); a decoding sequence's block by `cache_filled_block` as it fills.
A hit is never trusted on the hash alone: the candidate must hold the same token ids and have been computed
after exactly the parent content this sequence has (compared by content id), so hits are exact at any hash
width.

KV groups (kvd.model.layers.kv_cache.KVGroups): each sequence has a block table per group, all drawn from the one
pool. Group 0 keeps every block and names content as above; another group's block is registered under the
content id of group 0's block at the same place. A group with a window frees (RELEASED) the blocks wholly behind
the window of the next token to compute, and gets blocks chunk by chunk; a prefix hit needs group 0's blocks
and, in each other group, the blocks its window still reads at the hit's end.

Recurrent state (models with linear-attention layers, kvd.engine.state_slots): each allocated sequence holds a
live state slot; a prefix hit reaches only as far as the last hit block that holds a checkpoint of the state
there, which the sequence's first step copies into its own slot. A step that passes a checkpoint position
snapshots the state there (`plan_snapshot`), and the block the snapshot ends at keeps it once registered.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from xxhash import xxh3_64_intdigest

from kvd.engine.sequence import RELEASED, Sequence
from kvd.engine.state_slots import Snapshot, StateSlots

HashFn = Callable[[bytes, int], int]
"""hash_fn(token_bytes, parent_hash): a full block's hash from its token ids (little-endian int64) and its
parent's hash. The default, xxh3_64 seeded with the parent hash, chains without building a buffer; see
docs/block_manager.md for why 64 bits suffice."""

ROOT_HASH = 0
"""The parent hash of an unsalted sequence's first block."""


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class NoFreeBlocksError(BlockManagerError):
    """Not enough free blocks; ask `can_allocate` / `can_append` first, or free (preempt) other sequences."""


class SequenceNotAllocatedError(BlockManagerError):
    """The sequence holds no blocks in this manager."""


class DoubleFreeError(SequenceNotAllocatedError):
    """`deallocate` on a sequence that is not allocated: freed twice, or never allocated."""


class SequenceAlreadyAllocatedError(BlockManagerError):
    """`allocate` on a sequence that already has a block table."""


class BlockSizeMismatchError(BlockManagerError, ValueError):
    """The sequence was built with another block size than the manager's."""


class EmptySequenceError(BlockManagerError, ValueError):
    """A sequence without tokens cannot be allocated."""


class ComputedTokensError(BlockManagerError, ValueError):
    """`num_computed_tokens` counts more tokens than the sequence has."""


class NoFreeStateSlotsError(BlockManagerError):
    """Every recurrent state slot is held by a running sequence."""


class InvariantError(BlockManagerError):
    """`check_invariants` found the manager's state inconsistent (a bug, never a usage error)."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    group: int = 0  # the KV group whose table holds it
    # The key it is registered under once full: in group 0 its chained hash, in another group the uid of group
    # 0's block at the same place. None while it holds a partial block or nothing.
    hash: int | None = None
    token_bytes: bytes | None = None
    # What this block's K/V was computed after: the parent block's `uid`, or the cache salt for a first block.
    parent_key: int | str | None = None
    # Identity of the content: equal uids mean identical K/V (same tokens after the same prefix).
    uid: int = -1
    # A registered group-0 block's checkpoint slot: the recurrent state after its last token (StateSlots).
    checkpoint: int | None = None


@dataclass(frozen=True)
class GroupUsage:
    window: int | None  # the group frees blocks behind this window; None: it keeps them all
    used_blocks: int  # blocks its tables hold
    cached_blocks: int  # of the cached-free blocks, those it registered


@dataclass(frozen=True)
class BlockUsage:
    used_blocks: int
    free_blocks: int  # includes the cached-free ones: free_blocks + used_blocks == total
    cached_blocks: int  # free but findable by the prefix cache
    allocated_tokens: int  # token slots holding a token, in used blocks (a shared block counts once)
    reserved_tokens: int  # used_blocks * block_size
    internal_fragmentation_tokens: int  # reserved_tokens - allocated_tokens
    block_utilization: float  # allocated_tokens / reserved_tokens (0.0 when nothing is used)
    groups: tuple[GroupUsage, ...]  # per KV group


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int  # prompt tokens looked up by `allocate`
    hit_tokens: int  # of those, tokens whose K/V came from the cache
    hit_rate: float  # hit_tokens / queried_tokens (0.0 before any query)
    evictions: int  # cached-free blocks reused for new content


class BlockManager:
    """The blocks of one paged KV pool and which sequences hold them (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
        group_windows: tuple[int | None, ...] = (None,),
        states: StateSlots | None = None,
    ) -> None:
        """group_windows: per KV group, the window behind which it frees blocks (KVGroups.release_windows);
        group 0's is None. states: for a model with linear-attention layers, its recurrent state slots; a hit
        then reaches only as far as a checkpoint (none without checkpoint slots)."""
        if not group_windows or group_windows[0] is not None:
            raise ValueError(
                f"group_windows[0] must be None (group 0 keeps every block), got {group_windows}"
            )
        if any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"a group's window must be at least 1 token, got {group_windows}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn: HashFn = hash_fn or xxh3_64_intdigest
        self.group_windows = tuple(group_windows)
        # The groups that free blocks behind a window.
        self.num_windowed = sum(w is not None for w in group_windows)
        self.windowed = self.num_windowed > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self._cached_free: OrderedDict[int, Block] = OrderedDict()  # least recently used first, all groups
        # Per group: key (Block.hash) -> the block registered under it.
        self._cached: list[dict[int, Block]] = [{} for _ in group_windows]
        self._seqs: dict[int, Sequence] = {}  # id(seq) -> each allocated sequence
        self._uids = count()
        if states is not None and states.interval % block_size:
            raise ValueError(
                f"the state checkpoint interval ({states.interval} tokens) must be whole blocks of {block_size}"
            )
        self.states = states
        self._pack_block = struct.Struct(f"<{block_size}q").pack
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids) + len(self._cached_free)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def can_allocate(self, seq: Sequence, max_new_tokens: int | None = None) -> bool:
        """Whether `allocate(seq, max_new_tokens)` would succeed: cached prefix blocks in use cost nothing."""
        self._check_block_size(seq)
        if self.states is not None and not self.states.has_live:
            return False
        free = self.num_free_blocks
        if free >= seq.num_blocks * self.num_groups:  # never needs more, so skip the lookup
            return True
        return free >= self._blocks_needed(seq, self._hits(seq), max_new_tokens)

    def first_chunk(self, seq: Sequence, most: int) -> int:
        """The most tokens, up to `most`, of seq's first chunk that `allocate(seq, n)` has blocks for now; 0 when
        it cannot be admitted. Only a windowed group takes fewer blocks for a shorter chunk."""
        self._check_block_size(seq)
        if self.states is not None and not self.states.has_live:
            return 0
        if self.num_free_blocks >= seq.num_blocks * self.num_groups:  # never needs more
            return most
        hits = self._hits(seq)
        spare = self.num_free_blocks - self._blocks_needed(seq, hits, 0)  # what a chunk of none leaves
        windowed = self.num_windowed
        if spare < 0 or (windowed and spare < windowed):
            return 0
        if not windowed:
            return most
        # A chunk of m tokens after the hit's h takes ceil((h + m) / bs) - num_hit blocks in each windowed group.
        num_hit = len(hits[0]) if hits else 0
        return min(most, len(seq) - num_hit * self.block_size, spare // windowed * self.block_size)

    def allocate(self, seq: Sequence, max_new_tokens: int | None = None) -> None:
        """Give `seq` block tables, reusing cached prefix blocks; sets `num_cached_tokens`. Groups without a
        window get blocks for every token; windowed ones for the first `max_new_tokens` tokens to compute (None:
        all of them), the rest chunk by chunk (`may_append`)."""
        self._check_block_size(seq)
        if id(seq) in self._seqs or seq.block_table:
            raise SequenceAlreadyAllocatedError(
                "allocate: the sequence already has a block table; deallocate it before allocating again"
            )
        if not seq.token_ids:
            raise EmptySequenceError("allocate: the sequence has no tokens")
        hits = self._hits(seq)
        needed = self._blocks_needed(seq, hits, max_new_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"allocate: {len(seq)} tokens need {needed} free blocks but {self.num_free_blocks} are free; "
                "check can_allocate(seq) first, or free other sequences"
            )
        if self.states is not None:
            seq.state_slot = self.states.take_live()
            if seq.state_slot is None:
                raise NoFreeStateSlotsError(
                    f"allocate: all {self.states.num_live} recurrent state slots are held; check "
                    "can_allocate(seq) first, or free other sequences"
                )
            if hits and hits[0]:
                seq.restore_slot = self.states.pin(hits[0][-1])
        group_hits = hits or [[] for _ in self.group_windows]
        num_hit = len(group_hits[0])
        seq.block_tables = [[] for _ in self.group_windows]
        seq.num_released = [0] * self.num_groups
        # Every group's hits first: taking new blocks may evict cached-free ones, another group's hits among them.
        for g, (window, table, found) in enumerate(
            zip(self.group_windows, seq.block_tables, group_hits, strict=True)
        ):
            first = self._released_below(window, num_hit * self.block_size)
            table += [RELEASED] * first
            seq.num_released[g] = first
            for block in found:
                if block.ref_count == 0:  # revive a cached-free block
                    del self._cached_free[block.block_id]
                block.ref_count += 1
                table.append(block.block_id)
        for g, (window, table) in enumerate(zip(self.group_windows, seq.block_tables, strict=True)):
            end = self._first_chunk_end(seq, window, num_hit, max_new_tokens)
            table += self._take_free_blocks(-(-end // self.block_size) - len(table), g)
        num_cached = num_hit * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens = num_cached
        self._seqs[id(seq)] = seq
        self._queried_tokens += len(seq)
        self._hit_tokens += num_cached

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V are now computed (`seq.num_computed_tokens`) for reuse, then free
        the blocks the windows have passed.

        Call after each forward pass. Blocks are not offered at `allocate` time: a chunked prefill would
        otherwise let another request read K/V that nobody has written yet.
        """
        table = seq.block_table
        if not table:
            raise SequenceNotAllocatedError(
                "cache_computed_blocks: the sequence holds no blocks; allocate it first"
            )
        if self.enable_prefix_caching:
            num_full = seq.num_computed_tokens // self.block_size
            if num_full > len(table) or num_full * self.block_size > len(seq.token_ids):
                raise ComputedTokensError(
                    f"cache_computed_blocks: num_computed_tokens {seq.num_computed_tokens} exceeds the "
                    f"{len(seq.token_ids)} tokens or the {len(table)} blocks of the sequence"
                )
            if num_full and self.blocks[table[num_full - 1]].hash is None:
                self._hash_blocks(seq, num_full)
        if seq.restore_slot is not None:  # the step that read the checkpoint has run
            self.states.unpin(seq.restore_slot)
            seq.restore_slot = None
        if seq.snapshot is not None and seq.snapshot.tokens <= seq.num_computed_tokens:
            self._keep_snapshot(seq)
        if self.windowed:
            self._release_behind_windows(seq)

    def plan_snapshot(self, seq: Sequence, num_new_tokens: int) -> Snapshot | None:
        """For a step computing the sequence's next `num_new_tokens` tokens: the checkpoint position it passes
        last and the slot to copy the state into there, or None (no position, prefix caching off, no slot).
        `cache_computed_blocks` then gives the slot to the block that ends there."""
        states = self.states
        if states is None or not states.num_checkpoints or not self.enable_prefix_caching:
            return None
        start = seq.num_computed_tokens
        tokens = states.boundary(start, start + num_new_tokens)
        if tokens is None or seq.snapshot is not None:
            return None
        chain = self._cached_chain(seq, tokens // self.block_size)
        if len(chain) == tokens // self.block_size and chain[-1].checkpoint is not None:
            return None  # that state is cached already: a snapshot would only evict another checkpoint
        slot = states.take_checkpoint()
        if slot is None:
            return None
        seq.snapshot = Snapshot(tokens, slot)
        return seq.snapshot

    def _keep_snapshot(self, seq: Sequence) -> None:
        """Hang the sequence's snapshot on the registered block of the same content it ends at, unless that block
        has one already (the same state: computed twice)."""
        snapshot, seq.snapshot = seq.snapshot, None
        block = self.blocks[seq.block_table[snapshot.tokens // self.block_size - 1]]
        registered = self._cached[0].get(block.hash) if block.hash is not None else None
        if registered is None or registered.uid != block.uid or registered.checkpoint is not None:
            self.states.give_checkpoint(snapshot.slot)
        else:
            self.states.attach(registered, snapshot.slot)

    def can_append(self, seq: Sequence, num_new_tokens: int | None = None, num_lookahead: int = 0) -> bool:
        """Whether `may_append(seq, num_new_tokens, num_lookahead)` would succeed."""
        if not seq.block_table:
            raise SequenceNotAllocatedError("can_append: the sequence holds no blocks; allocate it first")
        end = self._append_end(seq, num_new_tokens) + num_lookahead
        if not self.windowed:  # one table, or several that grow alike: a decode step's arithmetic only
            missing = -(-end // self.block_size) - len(seq.block_table)
            return missing <= 0 or self.num_free_blocks >= missing * self.num_groups
        freed, missing = 0, 0
        for g, (window, table) in enumerate(zip(self.group_windows, seq.block_tables, strict=True)):
            missing += max(0, -(-end // self.block_size) - len(table))
            below = min(len(table), self._released_below(window, seq.num_computed_tokens))
            for i in range(seq.num_released[g], below):
                freed += self.blocks[table[i]].ref_count == 1
        return missing <= 0 or self.num_free_blocks + freed >= missing

    def may_append(self, seq: Sequence, num_new_tokens: int | None = None, num_lookahead: int = 0) -> None:
        """Give the next `num_new_tokens` tokens to compute their slots in every group (None: the tokens
        appended since the last call, for a decode step: a new block for a token that starts one), after
        freeing the blocks the windows have passed. Hashes nothing; see `cache_filled_block`.

        `num_lookahead`: slots for that many tokens past the sequence's end too, which a step computes before
        they are its tokens (speculative drafts); `trim_lookahead` frees what they left unused."""
        if not seq.block_table:
            raise SequenceNotAllocatedError("may_append: the sequence holds no blocks; allocate it first")
        if self.windowed:
            self._release_behind_windows(seq)
        num_blocks = -(-(self._append_end(seq, num_new_tokens) + num_lookahead) // self.block_size)
        missing = sum(max(0, num_blocks - len(t)) for t in seq.block_tables)
        if not missing:
            return
        if missing > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"may_append: needs {missing} free block(s) but {self.num_free_blocks} are free; "
                "check can_append(seq) first, or preempt another sequence"
            )
        for g, table in enumerate(seq.block_tables):
            if num_blocks > len(table):
                table += self._take_free_blocks(num_blocks - len(table), g)

    def draft_room(self, seq: Sequence, num_new_tokens: int) -> int:
        """The most draft tokens a step of `num_new_tokens` may verify after them for the recurrent state: the state
        before each draft token goes to a free live slot (the state after the last stays in the sequence's own),
        and no draft row passes the next checkpoint position (the step's snapshot is planned for its own rows)."""
        states = self.states
        room = states.num_free_live
        if states.num_checkpoints and self.enable_prefix_caching:
            end = seq.num_computed_tokens + num_new_tokens
            room = min(room, end - end % states.interval + states.interval - end - 1)
        return room

    def take_draft_slots(self, seq: Sequence, num_new_tokens: int, num_draft: int) -> None:
        """Hold the slots of a draft of `num_draft` tokens after the step's `num_new_tokens` (draft_room)."""
        seq.draft_slots = [self.states.take_live() for _ in range(num_draft)]
        seq.draft_base = seq.num_computed_tokens + num_new_tokens

    def settle_draft_state(self, seq: Sequence) -> None:
        """After a draft was verified: the sequence's state is the one after its last accepted token, in its own
        slot where it accepted the whole draft, else in the draft slot of that row, which becomes its own."""
        accepted = seq.num_computed_tokens - seq.draft_base
        slots = [seq.state_slot, *seq.draft_slots]
        if accepted < len(seq.draft_slots):
            seq.state_slot = slots.pop(accepted + 1)
        else:
            slots.pop(0)
        for slot in slots:
            self.states.give_live(slot)
        seq.draft_slots = []

    def trim_lookahead(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's tokens (`may_append`'s lookahead, its drafts rejected). Never
        registered: only blocks of computed tokens are."""
        for table in seq.block_tables:
            while len(table) > seq.num_blocks:
                self._free_block(table.pop())

    def cache_filled_block(self, seq: Sequence) -> None:
        """After `may_append`: hash and register the block the last token filled (len(seq) % block_size == 0),
        although that token's K/V is not computed yet (the scheduler says why that is safe).

        For decoding sequences only: every token but the last computed, so every earlier full block is hashed.
        """
        num_tokens, bs = len(seq.token_ids), self.block_size
        if not self.enable_prefix_caching or num_tokens % bs:
            return  # the last token left its block partial: no block became full
        # Hashed blocks are a prefix of the table, so checking the last full one is enough.
        num_full = num_tokens // bs
        if self.blocks[seq.block_table[num_full - 1]].hash is None:
            self._hash_blocks(seq, num_full)

    def deallocate(self, seq: Sequence) -> None:
        """Release the sequence's blocks; full registered blocks stay findable (cached-free)."""
        if self._seqs.pop(id(seq), None) is None:
            raise DoubleFreeError(
                "deallocate: the sequence holds no blocks here (freed twice, or never allocated); "
                "call deallocate exactly once per allocate"
            )
        # A block registered a step ahead of its last token's K/V (cache_filled_block) whose step never ran,
        # because the sequence was preempted after it was scheduled, must not stay findable.
        computed = seq.num_computed_tokens
        for table in seq.block_tables:
            for block_id in table[
                computed // self.block_size :
            ]:  # never RELEASED: a window passes computed ones
                block = self.blocks[block_id]
                if block.ref_count == 1 and self._cached[block.group].get(block.hash) is block:
                    del self._cached[block.group][block.hash]
        # Tail first, group 0 last: the LRU then evicts a sequence's tail before the prefix others share, and
        # another group's blocks before the group 0 blocks that every hit on them needs.
        for table in reversed(seq.block_tables):
            for block_id in reversed(table):
                if block_id != RELEASED:
                    self._free_block(block_id)
        seq.block_tables = [[]]
        seq.num_released = [0]
        seq.num_cached_tokens = seq.num_computed_tokens = 0
        if seq.state_slot is not None:
            self.states.give_live(seq.state_slot)
            seq.state_slot = None
        for slot in seq.draft_slots:  # its draft was verified, but it finished in the step
            self.states.give_live(slot)
        seq.draft_slots = []
        if seq.restore_slot is not None:
            self.states.unpin(seq.restore_slot)
            seq.restore_slot = None
        if seq.snapshot is not None:  # its step never ran
            self.states.give_checkpoint(seq.snapshot.slot)
            seq.snapshot = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block in self._cached_free.values():
            block.hash = block.token_bytes = block.parent_key = None
            if block.checkpoint is not None:
                self.states.detach(block)
            self._free_ids.append(block.block_id)
        self._cached_free.clear()
        for cached in self._cached:
            cached.clear()
        return True

    def usage(self) -> BlockUsage:
        used = self.num_blocks - self.num_free_blocks
        reserved = used * self.block_size
        # Only a table's last block can be partial, and a partial block is never shared.
        empty_slots = sum(
            max(0, (len(t) * self.block_size - len(s))) for s in self._seqs.values() for t in s.block_tables
        )
        allocated = reserved - empty_slots
        group_used, group_cached = [0] * self.num_groups, [0] * self.num_groups
        for block in self.blocks:
            group_used[block.group] += block.ref_count > 0
        for block in self._cached_free.values():
            group_cached[block.group] += 1
        return BlockUsage(
            used_blocks=used,
            free_blocks=self.num_free_blocks,
            cached_blocks=len(self._cached_free),
            allocated_tokens=allocated,
            reserved_tokens=reserved,
            internal_fragmentation_tokens=empty_slots,
            block_utilization=allocated / reserved if reserved else 0.0,
            groups=tuple(
                GroupUsage(w, u, c)
                for w, u, c in zip(self.group_windows, group_used, group_cached, strict=True)
            ),
        )

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            queried_tokens=self._queried_tokens,
            hit_tokens=self._hit_tokens,
            hit_rate=self._hit_tokens / self._queried_tokens if self._queried_tokens else 0.0,
            evictions=self._evictions,
        )

    def _check_block_size(self, seq: Sequence) -> None:
        if seq.block_size != self.block_size:
            raise BlockSizeMismatchError(
                f"sequence block_size {seq.block_size} != manager block_size {self.block_size}; "
                "build the Sequence with the engine's block size"
            )

    def _released_below(self, window: int | None, num_computed: int) -> int:
        """Blocks wholly behind the window of the token at `num_computed`, the next to compute: it reads
        positions num_computed - window + 1 .. num_computed."""
        return 0 if window is None else max(0, (num_computed - window + 1) // self.block_size)

    def _first_chunk_end(
        self, seq: Sequence, window: int | None, num_hit: int, max_new_tokens: int | None
    ) -> int:
        """The tokens a group holds blocks for once allocated: all of them without a window, else up to the
        end of the first chunk."""
        if window is None or max_new_tokens is None:
            return len(seq)
        return min(len(seq), num_hit * self.block_size + max_new_tokens)

    def _append_end(self, seq: Sequence, num_new_tokens: int | None) -> int:
        if num_new_tokens is None:
            return len(seq.token_ids)
        end = seq.num_computed_tokens + num_new_tokens
        if not (num_new_tokens > 0 and end <= len(seq.token_ids)):
            raise ComputedTokensError(
                f"{num_new_tokens} new tokens after {seq.num_computed_tokens} computed: the sequence has "
                f"{len(seq.token_ids)} tokens"
            )
        return end

    def _release_behind_windows(self, seq: Sequence) -> None:
        for g, (window, table) in enumerate(zip(self.group_windows, seq.block_tables, strict=True)):
            below = min(len(table), self._released_below(window, seq.num_computed_tokens))
            for i in range(seq.num_released[g], below):
                self._free_block(table[i])
                table[i] = RELEASED
            seq.num_released[g] = max(seq.num_released[g], below)

    def _free_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None and self._cached[block.group].get(block.hash) is block:
                self._cached_free[block_id] = block
            else:
                block.hash = block.token_bytes = block.parent_key = None
                if block.checkpoint is not None:
                    self.states.detach(block)
                self._free_ids.append(block_id)

    def _root_hash(self, cache_salt: str | None) -> int:
        return ROOT_HASH if cache_salt is None else self.hash_fn(cache_salt.encode(), ROOT_HASH)

    def _hits(self, seq: Sequence) -> list[list[Block]] | None:
        """The cached prefix `seq` may start from (_find_all_hits); None without prefix caching. With recurrent
        state, group 0's hits end at the last that holds a checkpoint."""
        if not self.enable_prefix_caching:
            return None
        hits = self._find_hits(seq)
        while True:
            if self.states is not None:
                while hits and hits[-1].checkpoint is None:
                    hits.pop()
            found = self._find_all_hits(hits)
            if self.states is None or len(found[0]) == len(hits):
                return found
            hits = hits[: len(found[0])]  # another group's blocks end it before a checkpoint

    def _find_all_hits(self, hits: list[Block]) -> list[list[Block]]:
        """Per group, the cached blocks of the longest prefix of group 0's `hits` that every group holds: group
        0's from the first block, a windowed group's from the first its window reads at the prefix's end."""
        num_hit = len(hits)
        while num_hit:
            groups, missing = [hits[:num_hit]], None
            for g in range(1, self.num_groups):
                cached = self._cached[g]
                first = self._released_below(self.group_windows[g], num_hit * self.block_size)
                found = [cached.get(block.uid) for block in hits[first:num_hit]]
                if None in found:
                    # No shorter prefix that still reads this block can hit either.
                    missing = first + found.index(None)
                    break
                groups.append(found)
            if missing is None:
                return groups
            num_hit = missing
        return [[] for _ in self.group_windows]

    def _find_hits(self, seq: Sequence) -> list[Block]:
        """Group 0's verified cached blocks of the longest cached prefix, leaving the last token to compute."""
        if not seq.reads_prefix_cache:
            return []
        # At most (len - 1) // bs blocks: the last token must be computed for the prompt to yield logits.
        return self._cached_chain(seq, (len(seq.token_ids) - 1) // self.block_size)

    def _cached_chain(self, seq: Sequence, num_blocks: int) -> list[Block]:
        """The registered group-0 blocks that hold seq's first blocks, up to num_blocks, verified."""
        hash_fn, cached = self.hash_fn, self._cached[0]
        parent_hash = self._root_hash(seq.cache_salt)
        parent_key: int | str | None = seq.cache_salt
        hits: list[Block] = []
        # Probe the first block alone: most lookups stop there, and packing a long prompt costs more.
        for first, last in ((0, min(1, num_blocks)), (1, num_blocks)):
            for token_bytes in self._pack_blocks(seq.token_ids, first, last):
                parent_hash = hash_fn(token_bytes, parent_hash)
                block = cached.get(parent_hash)
                if block is None or block.token_bytes != token_bytes or block.parent_key != parent_key:
                    return hits
                hits.append(block)
                parent_key = block.uid
        return hits

    def _pack_blocks(self, tokens: list[int], first: int, last: int) -> list[bytes]:
        """The token ids of blocks [first, last), each as little-endian int64 bytes, packed in one call (the
        packing, not the hashing, is the costly part)."""
        bs = self.block_size
        if last - first == 1:
            return [self._pack_block(*tokens[first * bs : last * bs])]
        if last <= first:
            return []
        data = struct.pack(f"<{(last - first) * bs}q", *tokens[first * bs : last * bs])
        step = 8 * bs
        return [data[offset : offset + step] for offset in range(0, len(data), step)]

    def _blocks_needed(
        self, seq: Sequence, hits: list[list[Block]] | None, max_new_tokens: int | None
    ) -> int:
        """Free blocks `allocate` takes: one per miss up to each group's end, plus one per revived cached hit."""
        needed, num_hit = 0, len(hits[0]) if hits else 0
        for window, found in zip(self.group_windows, hits or [[] for _ in self.group_windows], strict=True):
            end = self._first_chunk_end(seq, window, num_hit, max_new_tokens)
            needed += -(-end // self.block_size) - num_hit + sum(1 for b in found if b.ref_count == 0)
        return needed

    def _take_free_blocks(self, n: int, group: int) -> list[int]:
        """`n` blocks for new content in `group`: plain free ones first, then the least recently used cached
        ones."""
        free_ids, blocks = self._free_ids, self.blocks
        keep = max(0, len(free_ids) - n)
        taken = free_ids[keep:]
        del free_ids[keep:]
        taken.reverse()  # in pop order
        num_evicted = n - len(taken)
        if num_evicted:
            popitem, cached = self._cached_free.popitem, self._cached
            for _ in range(num_evicted):
                block_id, block = popitem(last=False)
                del cached[block.group][block.hash]
                block.hash = block.token_bytes = block.parent_key = None
                if block.checkpoint is not None:
                    self.states.detach(block)
                taken.append(block_id)
            self._evictions += num_evicted
        for block_id in taken:
            block = blocks[block_id]
            block.ref_count, block.group = 1, group
        return taken

    def _hash_blocks(self, seq: Sequence, num_full: int) -> None:
        """Hash the sequence's not yet hashed blocks below `num_full` (all full) and register them, in group 0
        by their chained hash, in the other groups by the content id of group 0's block at the same place."""
        blocks, table = self.blocks, seq.block_table
        first = num_full - 1
        while first and blocks[table[first - 1]].hash is None:
            first -= 1
        if first:
            parent = blocks[table[first - 1]]
            parent_hash, parent_key = parent.hash, parent.uid
        else:
            parent_hash, parent_key = self._root_hash(seq.cache_salt), seq.cache_salt
        hash_fn, cached, uids = self.hash_fn, self._cached[0], self._uids
        for i, token_bytes in enumerate(self._pack_blocks(seq.token_ids, first, num_full), first):
            block = blocks[table[i]]
            parent_hash = hash_fn(token_bytes, parent_hash)
            block.hash, block.token_bytes, block.parent_key = parent_hash, token_bytes, parent_key
            registered = cached.setdefault(parent_hash, block)
            if (
                registered is not block
                and registered.token_bytes == token_bytes
                and registered.parent_key == parent_key
            ):
                # The same content computed twice (e.g. by two requests admitted together): this copy stays
                # unregistered, but its children chain on the registered copy's identity, so stay findable.
                block.uid = registered.uid
            else:  # new content, or a hash collision (then this block stays unregistered)
                block.uid = next(uids)
            parent_key = block.uid
        for g in range(1, self.num_groups):
            group_table, group_cached = seq.block_tables[g], self._cached[g]
            for i in range(max(first, seq.num_released[g]), num_full):
                block = blocks[group_table[i]]
                block.hash = blocks[table[i]].uid
                group_cached.setdefault(block.hash, block)  # a copy of registered content stays unregistered

    def check_invariants(self) -> None:
        """Raise InvariantError unless the state is consistent (for tests; O(blocks + tokens))."""
        free_ids = set(self._free_ids)
        _require(len(free_ids) == len(self._free_ids), "a block id is twice in the free list")
        cached_free_ids = set(self._cached_free)
        _require(
            not free_ids & cached_free_ids, f"blocks both free and cached-free: {free_ids & cached_free_ids}"
        )
        holders = [0] * self.num_blocks
        for seq in self._seqs.values():
            self._check_sequence(seq)
            for g, table in enumerate(seq.block_tables):
                for block_id in table[seq.num_released[g] :]:
                    holders[block_id] += 1
                    _require(self.blocks[block_id].group == g, f"block {block_id} is in group {g}'s table")
        num_used = 0
        for block in self.blocks:
            bid = block.block_id
            _require(
                block.ref_count == holders[bid],
                f"block {bid}: ref_count {block.ref_count} but {holders[bid]} block tables hold it",
            )
            registered = block.hash is not None and self._cached[block.group].get(block.hash) is block
            if block.ref_count > 0:
                num_used += 1
                _require(bid not in free_ids and bid not in cached_free_ids, f"used block {bid} is also free")
                _require(block.ref_count == 1 or block.hash is not None, f"shared block {bid} is not hashed")
            elif bid in cached_free_ids:
                _require(registered, f"cached-free block {bid} is not findable by its hash")
                _require(self._cached_free[bid] is block, f"cached-free entry {bid} points at another block")
            else:
                _require(bid in free_ids, f"block {bid} is neither used, cached-free nor free")
                _require(block.hash is None, f"free block {bid} still holds a hash")
        for g, cached in enumerate(self._cached):
            for h, block in cached.items():
                _require(
                    block.hash == h and block.group == g,
                    f"group {g}'s map entry {h} points at block {block.block_id} holding {block.hash}",
                )
                _require(
                    g or block.token_bytes is not None, f"registered block {block.block_id} has no tokens"
                )
        _require(
            len(free_ids) + len(cached_free_ids) + num_used == self.num_blocks,
            f"free {len(free_ids)} + cached-free {len(cached_free_ids)} + used {num_used} != total",
        )
        self._check_states()

    def _check_states(self) -> None:
        seqs = list(self._seqs.values())
        if self.states is None:
            _require(
                all(s.state_slot is None and s.snapshot is None for s in seqs),
                "a sequence holds a state slot in a pool without them",
            )
            return
        _require(None not in [s.state_slot for s in seqs], "an allocated sequence holds no state slot")
        for block in self.blocks:
            if block.checkpoint is not None:
                _require(
                    block.group == 0 and self._cached[0].get(block.hash) is block,
                    f"block {block.block_id} holds checkpoint {block.checkpoint} but is not registered",
                )
        problems = self.states.check(
            [slot for s in seqs for slot in (s.state_slot, *s.draft_slots)],
            [s.snapshot.slot for s in seqs if s.snapshot is not None],
            [s.restore_slot for s in seqs if s.restore_slot is not None],
        )
        _require(not problems, "; ".join(problems))

    def _check_sequence(self, seq: Sequence) -> None:
        bs, table = self.block_size, seq.block_table
        _require(bool(table), "an allocated sequence has an empty block table")
        _require(len(seq.block_tables) == self.num_groups, f"{len(seq.block_tables)} block tables")
        for g, group_table in enumerate(seq.block_tables):
            self._check_group_table(seq, g, group_table)
        _require(
            0 <= seq.num_cached_tokens < len(seq) and seq.num_cached_tokens % bs == 0,
            f"num_cached_tokens {seq.num_cached_tokens} for a sequence of {len(seq)} tokens",
        )
        parent_hash, parent_key = self._root_hash(seq.cache_salt), seq.cache_salt
        hashed = True
        for i, block_id in enumerate(table):
            block = self.blocks[block_id]
            if block.hash is None:
                hashed = False
                _require(block.ref_count == 1, f"unhashed block {block_id} is shared")
                continue
            _require(
                hashed and (i + 1) * bs <= len(seq), f"block {block_id} is hashed out of order, or not full"
            )
            token_bytes = self._pack_block(*seq.block(i))
            parent_hash = self.hash_fn(token_bytes, parent_hash)
            _require(
                block.hash == parent_hash
                and block.token_bytes == token_bytes
                and block.parent_key == parent_key,
                f"block {block_id} (position {i}) does not hold this sequence's block {i}",
            )
            parent_key = block.uid

    def _check_group_table(self, seq: Sequence, g: int, table: list[int]) -> None:
        """A group's table: RELEASED exactly where its window has passed, then distinct live blocks; a group
        other than 0 registers a block under group 0's content id at the same place."""
        released = seq.num_released[g]
        below = min(len(table), self._released_below(self.group_windows[g], seq.num_computed_tokens))
        _require(
            released == below and all(b == RELEASED for b in table[:released]),
            f"group {g}: {released} blocks released, but the window has passed {below}",
        )
        live = table[released:]
        _require(RELEASED not in live, f"group {g}'s table has a released block after a live one: {table}")
        _require(len(set(live)) == len(live), f"a block table lists a block twice: {table}")
        _require(len(table) <= seq.num_blocks, f"{len(table)} blocks for {len(seq)} tokens")
        if g == 0:
            return
        for i in range(released, len(table)):
            key = self.blocks[table[i]].hash
            _require(
                key is None or key == self.blocks[seq.block_table[i]].uid,
                f"group {g}'s block {table[i]} (position {i}) holds other content than group 0's block there",
            )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)

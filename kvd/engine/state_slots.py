"""The recurrent state slots of a model with linear-attention layers (kvd.model.layers.recurrent_state), as the
block manager hands them out: a live slot for each allocated sequence, and checkpoint slots, each holding a
sequence's state after the tokens of one cached block (every `interval` tokens), so that a prefix hit resumes a
linear-attention layer from there: unlike K/V, a state cannot be rebuilt from the prefix's blocks.

A checkpoint belongs to the cached block it ends at and goes when that block is evicted, or sooner, least recently
used first, when a new snapshot needs its slot. A checkpoint a sequence is about to resume from is pinned until
the step that reads it has run."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Protocol


class CheckpointHolder(Protocol):
    """What a checkpoint hangs on: a cached block (kvd.engine.block_manager.Block)."""

    checkpoint: int | None


@dataclass
class Snapshot:
    """A step's order to copy a sequence's state, once it has computed `tokens` tokens, into checkpoint `slot`."""

    tokens: int
    slot: int


class StateSlots:
    def __init__(self, num_live: int, num_checkpoints: int, interval: int) -> None:
        if num_live < 1 or num_checkpoints < 0 or interval < 1:
            raise ValueError(
                f"state slots: need >= 1 live slot, >= 0 checkpoints and an interval >= 1 token, got {num_live}, "
                f"{num_checkpoints} and {interval}"
            )
        self.num_live, self.num_checkpoints, self.interval = num_live, num_checkpoints, interval
        self._free_live = list(range(num_live - 1, -1, -1))  # stacks: the lowest slot first
        self._free_checkpoints = list(range(num_live + num_checkpoints - 1, num_live - 1, -1))
        self._held: OrderedDict[int, CheckpointHolder] = (
            OrderedDict()
        )  # slot -> its block, least recent first
        self._pinned: Counter[int] = Counter()

    @property
    def has_live(self) -> bool:
        return bool(self._free_live)

    @property
    def num_free_live(self) -> int:
        return len(self._free_live)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def take_live(self) -> int | None:
        return self._free_live.pop() if self._free_live else None

    def give_live(self, slot: int) -> None:
        self._free_live.append(slot)

    def boundary(self, start: int, end: int) -> int | None:
        """The last checkpoint position in (start, end]: a step computing tokens start .. end - 1 passes it."""
        last = end - end % self.interval
        return last if last > start else None

    def take_checkpoint(self) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used unpinned checkpoint's."""
        if self._free_checkpoints:
            return self._free_checkpoints.pop()
        for slot, holder in self._held.items():
            if not self._pinned[slot]:
                del self._held[slot]
                holder.checkpoint = None
                return slot
        return None

    def give_checkpoint(self, slot: int) -> None:
        self._free_checkpoints.append(slot)

    def attach(self, holder: CheckpointHolder, slot: int) -> None:
        holder.checkpoint = slot
        self._held[slot] = holder

    def detach(self, holder: CheckpointHolder) -> None:
        """Free the checkpoint of a block that is evicted or forgotten."""
        slot = holder.checkpoint
        if slot is None:
            return
        if self._pinned[slot]:  # a sequence's next step reads it; its block is held, so never evicted
            raise RuntimeError(f"checkpoint {slot} is detached while a sequence is to resume from it")
        holder.checkpoint = None
        del self._held[slot]
        self._free_checkpoints.append(slot)

    def pin(self, holder: CheckpointHolder) -> int:
        """The checkpoint a sequence resumes from: kept, and made the most recently used."""
        slot = holder.checkpoint
        self._pinned[slot] += 1
        self._held.move_to_end(slot)
        return slot

    def unpin(self, slot: int) -> None:
        self._pinned[slot] -= 1
        if not self._pinned[slot]:
            del self._pinned[slot]

    def check(self, live_held: list[int], snapshots: list[int], pins: list[int]) -> list[str]:
        """What is wrong, given the sequences' live slots, pending snapshots' slots and pinned checkpoints."""
        problems = []
        live = sorted(live_held + self._free_live)
        if live != list(range(self.num_live)):
            problems.append(f"live state slots held and free: {live}")
        checkpoints = sorted(snapshots + self._free_checkpoints + list(self._held))
        if checkpoints != list(range(self.num_live, self.num_live + self.num_checkpoints)):
            problems.append(f"checkpoint slots pending, free and held: {checkpoints}")
        for slot, holder in self._held.items():
            if holder.checkpoint != slot:
                problems.append(f"checkpoint {slot}'s block names checkpoint {holder.checkpoint}")
        if Counter(pins) != self._pinned:
            problems.append(f"pinned checkpoints {dict(self._pinned)}, sequences resuming from {pins}")
        return problems

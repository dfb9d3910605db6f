"""The all-reduce and logits gather through shared memory, for ranks on one host (CPU, x86-64).

gloo's collectives hand each operation to a worker thread and cross the loopback TCP stack: about 0.7 ms per
all-reduce here with the ranks free, 3 ms with each bound to one core, against a SmolLM2 decode step of ~40 ms
that makes 62 of them. Here each rank writes its part into its own slot of a shared file, publishes a sequence
number, and spins until every rank published the same one; then every rank sums the slots in rank order, so
all ranks get the same bits for any batch (batch invariance holds for any N). Slots are double-buffered by the
sequence's parity: a rank that publishes operation k+1 has finished reading operation k, so operation k+2 may
overwrite k's buffer. x86-64 keeps stores in program order and loads in order, so a published sequence number
implies the data before it is visible (another architecture would need fences: it keeps gloo).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvd.distributed.errors import TensorParallelError

_SPINS_BEFORE_YIELD = 2000  # then yield the core each turn: ranks may share cores
_CHECK_EVERY = 1024  # spins between looks at the clock and at the other ranks' liveness


def supported(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine() in ("x86_64", "AMD64")


MAX_SLOT_BYTES = 16 << 20  # a larger collective (a long prefill's logits) goes through torch.distributed
_GATHER_ROWS = 64  # decode logits rows the slots are sized for


def slot_bytes(hidden_size: int, vocab_rows: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A slot for a whole step's hidden states and a decode step's logits slice, float32, within the cap."""
    hidden = max_num_batched_tokens * hidden_size * 4
    logits = min(max_num_seqs, _GATHER_ROWS) * vocab_rows * 4
    return min(MAX_SLOT_BYTES, max(hidden, logits))


def create(path: str, world_size: int, slot_bytes: int) -> bool:
    """Rank 0: the zeroed file every local rank maps (flags, then 2 x world_size slots); False if /dev/shm
    cannot hold it (space is reserved now: a page past a full tmpfs would be a SIGBUS later)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, _size(world_size, slot_bytes))
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)
    return True


def _size(world_size: int, slot_bytes: int) -> int:
    return 64 * world_size + 2 * world_size * slot_bytes


@dataclass
class SharedCollectives:
    """One rank's view of the shared file; `alive` raises TensorParallelError if another rank is gone."""

    path: str
    rank: int
    world_size: int
    slot_bytes: int
    timeout_s: float
    alive: Callable[[], None]

    def __post_init__(self) -> None:
        raw = torch.from_file(
            self.path, shared=True, size=_size(self.world_size, self.slot_bytes), dtype=torch.uint8
        )
        # One flag per rank, each on its own 64-byte line so that ranks do not share a cache line.
        self.flags = raw[: 64 * self.world_size].view(torch.int64)[::8]
        self.slots = raw[64 * self.world_size :].view(2, self.world_size, self.slot_bytes)
        self.seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (contiguous), in rank order, written into x."""
        parts = self._exchange(x)
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's x; the others: None."""
        parts = self._exchange(x)
        return parts if self.rank == 0 else None  # views: valid until the collective after next

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.seq += 1
        nbytes = x.numel() * x.element_size()
        buffers = self.slots[self.seq % 2, :, :nbytes]
        buffers[self.rank].view(x.dtype).copy_(x.reshape(-1))
        self.flags[self.rank] = self.seq  # after the data: x86-64 makes them visible in this order
        for rank in range(self.world_size):
            if rank != self.rank:
                self._wait(rank)
        return [buffers[r].view(x.dtype).view(x.shape) for r in range(self.world_size)]

    def _wait(self, rank: int) -> None:
        flag, seq = self.flags[rank], self.seq
        spins = 0
        deadline = time.monotonic() + self.timeout_s
        while flag.item() < seq:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()
            if spins % _CHECK_EVERY == 0:
                self.alive()
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"rank {rank} did not answer within {self.timeout_s:g} s")


_active: SharedCollectives | None = None


def activate(collectives: SharedCollectives | None) -> None:
    """Route this process's all-reduces and gathers through `collectives` (None: back to torch.distributed)."""
    global _active
    _active = collectives


def active() -> SharedCollectives | None:
    return _active

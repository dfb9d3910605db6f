"""2 MiB pages for the large CPU tensors that every step reads: the KV pool and the weights.

With 4 KiB pages nearly every block a decode step reads from the pool, and every few weight rows a linear
streams, costs a TLB miss. Linux grants 2 MiB pages (transparent huge pages) where a range is advised with
madvise(MADV_HUGEPAGE) before its first touch, in its "madvise" and "always" modes; elsewhere the advice is
ignored and nothing else changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
ARENA_BYTES = 64 << 20  # weights are packed into arenas of this size: the copy's transient overhead
_LINUX = sys.platform == "linux"  # madvise and transparent huge pages


def advise_huge_pages(t: torch.Tensor) -> None:
    """Advise the whole 2 MiB pages inside t's memory (advice only: a kernel without them ignores it)."""
    begin = t.data_ptr()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    end = (begin + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        ctypes.CDLL(None, use_errno=True).madvise(
            ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE
        )


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor, on a Linux CPU in 2 MiB pages where the kernel grants them (advised before the zeroing
    faults its pages in)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and _LINUX:
        advise_huge_pages(t)
    return t.zero_()


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim, where there is one). glibc keeps the
    holes freed tensors leave in its heap: after a load's conversions and the moves below, ~150 MB of them beside
    a 95 MB GGUF model's weights."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _own_storage(t: torch.Tensor) -> bool:
    """Whether t is the whole of its storage (a view of a larger tensor keeps its place)."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


class Arenas:
    """Tensors carved one after another from arenas of ARENA_BYTES (or one tensor's size when larger) in 2 MiB
    pages (Linux; elsewhere plain tensors). An arena's unused end is never touched, so it costs address space,
    not memory. Each tensor is a view of its arena, so pack_weights leaves it where it is."""

    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self.free = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not _LINUX:
            return torch.empty(shape, dtype=dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if self.arena is None or nbytes > self.arena.numel() - self.free:
            return_freed_heap()  # what the caller freed since the last arena (pack_weights: the tensors moved)
            size = max(ARENA_BYTES, nbytes)
            self.arena = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
            self.free = -self.arena.data_ptr() % HUGE_PAGE
            advise_huge_pages(self.arena)
        home = self.arena[self.free : self.free + nbytes].view(dtype).view(shape)
        self.free += -(-nbytes // 64) * 64
        return home


def pack_weights(module: nn.Module) -> int:
    """Move module's CPU parameters and buffers into arenas of 2 MiB pages (Linux only); returns the bytes moved.

    A tensor registered twice (tied embeddings) stays one tensor; one that is a view of another (one made in
    Arenas already) stays where it is. Loading holds at most one arena more than the weights. Call it before
    anything keeps a weight's address (the native layer loop takes them on first use)."""
    if not _LINUX:
        return 0
    slots = [(m._parameters, name) for m in module.modules() for name in m._parameters]
    # Non-persistent buffers (the rotary tables) stay where they are: they are cut to the served context later
    # (ModelRunner), which an arena would not give back.
    slots += [
        (m._buffers, name)
        for m in module.modules()
        for name in m._buffers
        if name not in m._non_persistent_buffers_set
    ]
    moved: dict[int, torch.Tensor] = {}
    arenas, total = Arenas(), 0
    for table, name in slots:
        t = table[name]
        if t is None or not _own_storage(t) or t.numel() == 0:
            continue
        if id(t) not in moved:
            home = arenas.empty(tuple(t.shape), t.dtype)
            home.copy_(t)
            total += -(-t.numel() * t.element_size() // 64) * 64  # as laid out, 64-byte aligned
            if isinstance(t, nn.Parameter):
                t.data = home
                moved[id(t)] = t
            else:
                moved[id(t)] = home
        table[name] = moved[id(t)]
    return_freed_heap()
    return total

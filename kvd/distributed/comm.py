"""The collectives of a sharded forward pass: the sum after the row-parallel linears and the logits gather."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvd.distributed import shm
from kvd.distributed.errors import TensorParallelError
from kvd.distributed.shard import Shard

__all__ = ["STATS", "CommStats", "TensorParallelError", "all_reduce", "gather_vocab"]


@dataclass
class CommStats:
    """Time and bytes this process spent in collectives (benchmarks/tensor_parallel.py reads it)."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def add(self, started: float, tensor: torch.Tensor) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - started
        self.bytes += tensor.numel() * tensor.element_size()


STATS = CommStats()


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The sum of every rank's x, the same bits on every rank and for every batch shape.

    Ranks on one host exchange through shared memory (kvd.distributed.shm), summing in rank order. Otherwise,
    two ranks: one all-reduce (a + b is commutative, so each element rounds once, the same everywhere). More:
    gather and add in rank order, since a ring all-reduce starts each element's sum at a rank that depends on
    where the element falls in the tensor, that is, on the batch's size: batch invariance would not hold.
    """
    if not shard.sharded:
        return x
    started = time.perf_counter()
    x = x.contiguous()
    shared = shm.active()
    if shared is not None and shared.fits(x):
        out = shared.all_reduce(x)
        STATS.add(started, x)
        return out
    try:
        if shard.world_size == 2:
            dist.all_reduce(x)
            out = x
        else:
            parts = [torch.empty_like(x) for _ in range(shard.world_size)]
            dist.all_gather(parts, x)
            out = parts[0]
            for part in parts[1:]:
                out.add_(part)
    except RuntimeError as e:
        raise TensorParallelError(f"all-reduce failed: {e}") from e
    STATS.add(started, x)
    return out


def gather_vocab(local: torch.Tensor, shard: Shard, vocab_size: int) -> torch.Tensor:
    """Rank 0: the logits [rows, vocab_size] from every rank's slice of the vocabulary; others: their slice."""
    if not shard.sharded:
        return local
    started = time.perf_counter()
    local = local.contiguous()
    shared = shm.active()
    if shared is not None and shared.fits(local):
        parts = shared.gather(local)
    else:
        parts = [torch.empty_like(local) for _ in range(shard.world_size)] if shard.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0)
        except RuntimeError as e:
            raise TensorParallelError(f"logits gather failed: {e}") from e
    STATS.add(started, local)
    if parts is None:
        return local
    return torch.cat(parts, dim=-1)[:, :vocab_size]

"""What crosses from rank 0 to the other ranks each step: a command and its integers, in one broadcast.

A step is sent as its token ids, query and context lengths and block tables (positions and slot mapping follow
from them), so every rank builds the same attention metadata for its own pool. The broadcast buffer holds
HEADER_INTS integers; a larger command (a long prefill) sends the rest in a second broadcast.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import torch
import torch.distributed as dist

from kvd.distributed.comm import STATS
from kvd.distributed.errors import TensorParallelError

logger = logging.getLogger("kvd.distributed")

HEADER_INTS = 2048  # 16 KiB: a decode step of up to a few hundred sequences fits in one broadcast


class Command(IntEnum):
    STEP = 1  # run the model on StepInputs, keep the hidden states
    LOGITS = 2  # project the given rows of the kept hidden states, gather to rank 0
    PING = 3  # nothing: keeps an idle group's collectives inside their timeout
    STOP = 4  # leave the loop and exit


class RecurrentRows(NamedTuple):
    """A sequence's recurrent state in one step (kvd.model.layers.recurrent_state): its slot; where its state
    starts from (-1: zeros, a fresh sequence; its own slot: where the last step left it; another slot: a
    checkpoint to resume from); the (row, slot) pairs, rows ascending, after which row of its rows to copy the
    state into which slot (a checkpoint; with a draft, the state after the chunk's last row and after each draft
    row but the last); and how many draft rows follow its chunk's rows as sequences of their own in the step's
    attention (kvd.engine.speculative)."""

    slot: int
    source: int
    snapshots: tuple[tuple[int, int], ...] = ()
    drafts: int = 0


@dataclass
class StepInputs:
    """One flat varlen batch: sequence s computes query_lens[s] tokens ending at context_lens[s]."""

    input_ids: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # KV group 0's, one per sequence
    group_tables: list[list[list[int]]] = field(default_factory=list)  # groups 1..'s, [group][sequence]
    # Linear-attention models: per sequence its recurrent state's rows (RecurrentRows: slot, source, snapshot).
    recurrent: list[RecurrentRows] | None = None

    @property
    def positions(self) -> list[int]:
        return [p for q, c in zip(self.query_lens, self.context_lens, strict=True) for p in range(c - q, c)]

    def encode(self, block_size: int) -> list[int]:
        """[S, groups after 0, whether recurrent rows follow, then per sequence: query, context; then per sequence
        with recurrent rows: slot, source, drafts, snapshot count, its (row, slot) pairs; then per group and
        sequence: blocks, its blocks...; then the token ids]."""
        rows = self.recurrent
        out = [len(self.query_lens), len(self.group_tables), int(rows is not None)]
        for q, c in zip(self.query_lens, self.context_lens, strict=True):
            out += [q, c]
        for r in rows or []:
            out += [r.slot, r.source, r.drafts, len(r.snapshots), *(i for pair in r.snapshots for i in pair)]
        for tables in (self.block_tables, *self.group_tables):
            for c, table in zip(self.context_lens, tables, strict=True):
                used = table[: -(-c // block_size)]  # only the blocks the context covers
                out += [len(used), *used]
        return out + self.input_ids

    @classmethod
    def decode(cls, ints: list[int]) -> StepInputs:
        num_seqs, num_other, has_rows = ints[0], ints[1], ints[2]
        queries, contexts = ints[3 : 3 + 2 * num_seqs : 2], ints[4 : 4 + 2 * num_seqs : 2]
        i = 3 + 2 * num_seqs
        rows = None
        if has_rows:
            rows, covered = [], 0  # a sequence's draft rows are attention sequences of their own
            while covered < num_seqs:
                slot, source, drafts, num_snapshots = ints[i : i + 4]
                pairs = ints[i + 4 : i + 4 + 2 * num_snapshots]
                rows.append(
                    RecurrentRows(slot, source, tuple(zip(pairs[::2], pairs[1::2], strict=True)), drafts)
                )
                covered += 1 + drafts
                i += 4 + 2 * num_snapshots
        groups = []
        for _ in range(1 + num_other):
            tables = []
            for _ in range(num_seqs):
                tables.append(ints[i + 1 : i + 1 + ints[i]])
                i += 1 + ints[i]
            groups.append(tables)
        return cls(ints[i:], queries, contexts, groups[0], groups[1:], rows)


def _broadcast(ints: torch.Tensor, device: torch.device) -> torch.Tensor:
    started = time.perf_counter()
    on_device = ints.to(device) if device.type == "cuda" else ints  # NCCL moves device tensors only
    try:
        dist.broadcast(on_device, src=0)
    except RuntimeError as e:
        raise TensorParallelError(f"step broadcast failed: {e}") from e
    STATS.add(started, ints)
    return on_device.cpu()


class StepChannel:
    """Rank 0's end. Each command holds a lock from its broadcast until the collectives it starts are done,
    so the heartbeat thread's PING can only fall between commands, where every worker waits for the next."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.failure: TensorParallelError | None = None
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._interval = max(0.5, timeout_s / 4)
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="kvd-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    @contextlib.contextmanager
    def command(self, command: Command, payload: list[int] = ()) -> Iterator[None]:
        """Send the command, then run the body (rank 0's part of it) under the lock."""
        with self._lock:
            self.check()
            try:
                self._send(command, list(payload))
                yield
            except TensorParallelError as e:
                self.failure = e
                raise

    def check(self) -> None:
        """Raise the failure the channel saw (in a step or a heartbeat), if any."""
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Tell the workers to exit (unless the group already failed) and stop the heartbeat."""
        self._closed.set()
        self._heartbeat.join()
        if self.failure is None:
            with self._lock, contextlib.suppress(TensorParallelError):
                self._send(Command.STOP, [])

    def _send(self, command: Command, payload: list[int]) -> None:
        ints = [int(command), len(payload), *payload]
        head = torch.zeros(HEADER_INTS, dtype=torch.int64)
        first = ints[:HEADER_INTS]
        head[: len(first)] = torch.tensor(first, dtype=torch.int64)
        _broadcast(head, self.device)
        if len(ints) > HEADER_INTS:
            _broadcast(torch.tensor(ints[HEADER_INTS:], dtype=torch.int64), self.device)
        self._last = time.monotonic()

    def _beat(self) -> None:
        while not self._closed.wait(self._interval / 2):
            if time.monotonic() - self._last < self._interval or self.failure is not None:
                continue
            with self._lock:
                if self._closed.is_set() or self.failure is not None:
                    return
                try:
                    self._send(Command.PING, [])
                except TensorParallelError as e:
                    logger.error("tensor-parallel heartbeat failed: %s", e)
                    self.failure = e


def receive(device: torch.device) -> tuple[Command, list[int]]:
    """A worker's end: block until rank 0's next command; its payload."""
    head = _broadcast(torch.zeros(HEADER_INTS, dtype=torch.int64), device)
    command, length = int(head[0]), int(head[1])
    total = 2 + length
    ints = head[: min(total, HEADER_INTS)].tolist()
    if total > HEADER_INTS:
        rest = _broadcast(torch.zeros(total - HEADER_INTS, dtype=torch.int64), device)
        ints += rest.tolist()
    return Command(command), ints[2:]

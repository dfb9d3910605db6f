"""Continuous batching: decodes first, then chunked prefills and admissions, then (when speculating) the decodes'
drafts from what is left, within a token budget; preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.engine.block_manager import BlockManager
from kvd.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq` computed this step, starting at `seq.num_computed_tokens`; a decode's
    `draft` tokens after them (kvd.engine.speculative), each computed as a decode of its own would be."""

    seq: Sequence
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last position yields the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences that hit the pool's capacity while running alone; they finish with reason "length".
    out_of_memory: list[Sequence] = field(default_factory=list)


Drafter = Callable[[Sequence, int], list[int]]
"""Up to n draft tokens to verify after a decoding sequence's next token (kvd.engine.speculative)."""


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        drafter: Drafter | None = None,
        max_drafting_seqs: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.drafter = drafter
        # Above this many decodes in a step, drafts stop paying: the batch already fills the hardware.
        self.max_drafting_seqs = max_drafting_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the first to be preempted
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget -= self._schedule_decodes(out, budget)
        budget -= self._schedule_running_prefills(out, budget)
        budget -= self._admit_waiting(out, budget)
        self._schedule_drafts(out, budget)
        if self.block_manager.states is not None:  # recurrent state: snapshots at checkpoint positions
            for chunk in out.chunks:
                self.block_manager.plan_snapshot(chunk.seq, chunk.num_new_tokens)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        used = 0
        for seq in list(self.running):
            if used == budget:
                break
            if seq.status != SequenceStatus.RUNNING or seq.is_prefilling:
                continue  # preempted earlier in this loop, or still in prefill
            if not self._make_room_to_append(seq, out):
                continue
            self.block_manager.may_append(seq)
            # The seed's one-step lag (the block manager kvd grew from did the same): the block the last
            # sampled token filled is registered now, a step before that token's K/V is written, so that a
            # request admitted below can already hit it. Safe: that request runs in the same forward pass, and
            # every layer writes the step's K/V before it attends.
            self.block_manager.cache_filled_block(seq)
            out.chunks.append(ScheduledChunk(seq, 1))
            used += 1
        return used

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafts for the step's decodes, last: from the token budget, blocks and rows that every decode,
        prefill chunk and admission left, so a draft never takes what another sequence needs. None past
        max_drafting_seqs decodes; never more sampled rows in all than max_num_seqs (one a running sequence at
        most, then the drafts: what the step's logits and the memory profile are sized for)."""
        decodes = [c for c in out.chunks if not c.seq.is_prefilling]
        if self.drafter is None or len(decodes) > self.max_drafting_seqs:
            return
        rows = self.max_num_seqs - len(self.running)
        states = self.block_manager.states is not None
        for chunk in decodes:
            seq, most = chunk.seq, min(rows, budget)
            if states:  # recurrent state: a slot for each draft row's state
                most = min(most, self.block_manager.draft_room(seq, chunk.num_new_tokens))
            if most < 1:
                continue
            draft = self.drafter(seq, most)
            n = self._fit(
                lambda m, s=seq: self.block_manager.can_append(s, num_lookahead=m), len(draft), True
            )
            if n:
                self.block_manager.may_append(seq, num_lookahead=n)
                if states:
                    self.block_manager.take_draft_slots(seq, chunk.num_new_tokens, n)
                chunk.draft = draft[:n]
                budget -= n
                rows -= n

    def _make_room_to_append(
        self, seq: Sequence, out: SchedulerOutput, num_new_tokens: int | None = None
    ) -> bool:
        """Preempt the most recently admitted sequences until `seq` can take the blocks of its next tokens
        (`BlockManager.may_append`); False if `seq` went."""
        while not self.block_manager.can_append(seq, num_new_tokens):
            if len(self.running) == 1:
                # Alone and still no block: the sequence has outgrown the whole pool; the engine finishes it.
                out.out_of_memory.append(seq)
                return False
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            # A prefill chunk's room may cost a decode scheduled earlier in this step.
            out.chunks = [c for c in out.chunks if c.seq is not victim]
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: int) -> int:
        used = 0
        for seq in list(self.running):
            if used == budget:
                break
            if seq.status == SequenceStatus.RUNNING and seq.is_prefilling:
                # A sliding-window group takes its blocks chunk by chunk (the others have the whole prompt's):
                # the chunk shrinks to the blocks there are, and only a chunk of none preempts.
                wanted = min(len(seq) - seq.num_computed_tokens, budget - used)
                n = self._fit(lambda m, s=seq: self.block_manager.can_append(s, m), wanted)
                if not n:
                    if not self._make_room_to_append(seq, out, 1):
                        continue
                    n = self._fit(lambda m, s=seq: self.block_manager.can_append(s, m), wanted)
                self.block_manager.may_append(seq, n)
                out.chunks.append(ScheduledChunk(seq, n))
                used += n
        return used

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        # Strict FCFS: when the head does not fit, nothing behind it jumps ahead, so no request starves.
        used = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Not one preempted in this step: its blocks were freed for others, not for it to take back.
            first_chunk = 0 if seq in out.preempted else self.block_manager.first_chunk(seq, budget)
            if not first_chunk:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, first_chunk)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.num_admitted_tokens = len(seq)
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, first_chunk)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
            used += n
        return used

    def _fit(self, fits: Callable[[int], bool], most: int, search: bool = False) -> int:
        """The largest n <= most with fits(n) (fits is monotonic), 0 if not even 1 fits. A prefill chunk takes
        fewer blocks for fewer tokens only in a group with a window: without one, the first try answers, unless
        `search`."""
        if fits(most):
            return most
        if not (search or self.block_manager.windowed):
            return 0
        low, high = 0, most  # fits(low) or low == 0; not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Advance computed counts; append the token sampled for each sequence whose chunk finished it (a
        draft's tokens follow through `accept_draft_token`)."""
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.cache_computed_blocks(seq)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.append_token(token)

    def accept_draft_token(self, seq: Sequence, token: int) -> None:
        """The last token appended was the draft's next, so its K/V (computed this step) stand and their full
        blocks are registered (before a stop may release the sequence); `token` is what the model gave after
        it."""
        seq.num_computed_tokens += 1
        self.block_manager.cache_computed_blocks(seq)
        seq.append_token(token)

    def settle_draft(self, seq: Sequence) -> None:
        """After a running sequence's draft was verified: free the blocks of what it rejected, and with recurrent
        state keep the state after what it accepted."""
        self.block_manager.trim_lookahead(seq)
        if self.block_manager.states is not None:
            self.block_manager.settle_draft_state(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) from its queue and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

"""The scheduler over a pool in KV groups, short of blocks: chunks shrink to the blocks a sliding group can have,
sequences are preempted (none of them run, nor re-admitted, in the step that preempts them), every chunk finds its
tokens' and its windows' blocks, and every request finishes with the block manager's invariants holding after
every step."""

from __future__ import annotations

import random

import pytest

from kvd.engine.block_manager import BlockManager
from kvd.engine.scheduler import Scheduler
from kvd.engine.sequence import Sequence, SequenceStatus

BS = 4
OUTPUT = 6  # tokens each request generates


def _run(seed: int, num_blocks: int, windows: tuple[int | None, ...]) -> dict[str, int]:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, group_windows=windows)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12)
    seqs = [Sequence([rng.randrange(50) for _ in range(rng.randint(3, 30))], BS) for _ in range(8)]
    for seq in seqs:
        scheduler.add(seq)
    counts = {"steps": 0, "preempted": 0, "shrunk": 0}
    while scheduler.has_unfinished():
        counts["steps"] += 1
        assert counts["steps"] < 2000, "no progress"
        out = scheduler.schedule()
        assert not out.out_of_memory
        scheduled = {id(c.seq) for c in out.chunks}
        for victim in out.preempted:
            assert id(victim) not in scheduled and victim.status == SequenceStatus.WAITING
            assert victim not in scheduler.running  # not re-admitted in the step that preempted it
        counts["preempted"] += len(out.preempted)
        for chunk in out.chunks:
            seq = chunk.seq
            # Every group has blocks for the chunk's tokens, and the windows' blocks are still there.
            end = seq.num_computed_tokens + chunk.num_new_tokens
            for g, (window, table) in enumerate(zip(windows, seq.block_tables, strict=True)):
                assert len(table) * BS >= end
                first_read = 0 if window is None else max(0, seq.num_computed_tokens - window + 1) // BS
                assert seq.num_released[g] <= first_read
            if seq.is_prefilling and chunk.num_new_tokens < min(12, len(seq) - seq.num_computed_tokens):
                counts["shrunk"] += 1
        bm.check_invariants()
        sampled = {c.seq.seq_id: 7 for c in out.chunks if c.samples}
        scheduler.postprocess(out, sampled)
        bm.check_invariants()
        for seq in list(scheduler.running):
            if seq.num_output_tokens >= OUTPUT:
                scheduler.finish(seq)
    assert all(s.num_output_tokens == OUTPUT for s in seqs)
    assert bm.usage().used_blocks == 0
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_a_pool_in_groups_short_of_blocks_finishes_every_request(seed):
    counts = _run(seed, num_blocks=16, windows=(None, 6))
    assert counts["steps"] > 0


def test_chunks_shrink_and_decodes_give_way_somewhere_in_the_runs():
    totals = [_run(seed, num_blocks=14, windows=(None, 6)) for seed in range(6)]
    assert sum(t["preempted"] for t in totals) > 0 and sum(t["shrunk"] for t in totals) > 0


def test_one_group_runs_as_before():
    assert _run(0, num_blocks=16, windows=(None,))["steps"] > 0

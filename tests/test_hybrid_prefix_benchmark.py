"""benchmarks/hybrid_prefix.py: a conversation's turns with state checkpoints and without give the same answers,
and the later turns resume from checkpoints."""

from __future__ import annotations

import os

import pytest
from quick_benchmark import run_quick

from kvd.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels cannot be built here")


def test_later_turns_hit_checkpoints_and_the_figures_are_printed(tiny_checkpoint):
    out, result = run_quick(
        "benchmarks.hybrid_prefix", dict(os.environ), "--model", str(tiny_checkpoint("qwen3_5"))
    )
    assert result["turns"] == 3 and len(result["ttft_s"]["checkpoints"]) == 3
    assert result["hit_tokens"] >= 64  # turn 2 reads turn 1's prompt back, at least, from a checkpoint
    assert result["checkpoint_interval_tokens"] == 16 and result["checkpoint_bytes"] > 0
    assert result["checkpoint_bytes_per_cached_token"] == result["checkpoint_bytes"] / 16
    assert result["speedup"] == pytest.approx(
        result["ttft_later_turns_s"]["none"] / result["ttft_later_turns_s"]["checkpoints"]
    )
    assert result["cpu"] in out and "per cached token" in out

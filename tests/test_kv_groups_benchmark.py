"""benchmarks/kv_groups.py: the pool a long Gemma 3 conversation holds in KV groups, against every layer full."""

from __future__ import annotations

import os

from quick_benchmark import run_quick


def test_a_gemma3_conversation_holds_its_full_layers_and_five_windows():
    stdout, result = run_quick("benchmarks.kv_groups", dict(os.environ))
    assert "all full / in groups" in stdout
    assert result["tokens"] == 1024 + 32
    assert [g["window"] for g in result["groups"]] == [None] + [512] * 5
    full, *sliding = result["blocks_held"]
    assert full == -(-result["tokens"] // 16)  # the full layers keep every token
    assert all(b <= 512 // 16 + 1 for b in sliding)  # a sliding group only its window, between steps
    # At 1,056 tokens the five windows hold as much as the full layers: 66 + 5 x 33 blocks against 6 x 66, 1.7x
    # (the full run's 8k tokens: 4.5x).
    assert result["saving"] == 6 * full / (full + sum(sliding)) > 1.5
    assert result["grouped_bytes_per_token"] < result["all_full_bytes_per_token"]

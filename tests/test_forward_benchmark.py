"""benchmarks/forward.py runs end to end (--quick), on shapes it says, with both sides computing the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_quick(*extra: str) -> tuple[str, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.forward", "--quick", "--json", "--threads", "1", *extra],
        cwd=ROOT,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_quick_run_times_the_shapes_it_names_on_the_same_model(quantization):
    stdout, result = run_quick("--quantization", quantization)
    assert (result["dtype"], result["quantization"], result["threads"]) == ("float32", quantization, 1)
    assert [(r["batch"], r["length"]) for r in result["prefill"]] == [(1, 16), (2, 24)]
    assert [(r["batch"], r["length"]) for r in result["decode"]] == [(1, 32), (4, 32)]
    diffs = [row["max_logit_diff"] for row in result["prefill"]]
    if quantization == "none":
        # float32 kvd and transformers on the same weights: the ratio compares equal work.
        assert max(diffs) < 1e-4, diffs
    else:
        # The quantized weights really run (the logits move), and stay near the float model's.
        assert 1e-4 < max(diffs) < 0.5, diffs
    assert "kvd tok/s" in stdout.splitlines()[1]  # the human-readable table comes first

"""benchmarks/structured_output.py runs end to end on a tiny config and reports every figure it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--schemas", "2", "--prompts", "1", "--rounds", "1", "--max-tokens", "24"]
SMALL += ["--throughput-max-tokens", "4", "--num-requests", "2", "--mask-rows", "2", "--mask-steps", "5"]


def test_tiny_run_reports_compile_validity_throughput_and_mask_cost():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.structured_output", *SMALL, "--threads", "1", "--json"],
        cwd=ROOT,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert lines[0].startswith("CPU: ") and result["cpu"]["model"] in lines[0]
    assert result["threads"] == 1

    c = result["compile"]
    assert c["library"].startswith("llguidance") and len(c["per_schema_ms"]) == 2
    assert 0 < c["compile"]["p50_ms"] <= c["compile"]["p99_ms"] <= c["compile"]["max_ms"]
    assert c["tokenizer_build_s"] > 0 and isinstance(c["goal_met"], bool)

    for run in result["validity"]["runs"].values():
        assert run["outputs"] == 2
        # Every output either validates, is cut by max_tokens, or is listed as invalid with its reason.
        assert run["valid"] + len(run["cut_by_length"]) + len(run["invalid"]) == 2
    assert set(result["validity"]["runs"]) == {"greedy", "t0.7"}

    t = result["throughput"]
    assert (t["num_requests"], t["constrained_requests"], t["rounds"]) == (2, 1, 1)
    assert set(t["tok_s"]) == {"constrained", "unconstrained", "same_shape"}
    assert all(v > 0 for v in t["tok_s"].values()) and t["ratio"] > 0
    # The same-shape run repeats the constrained run's lengths exactly.
    assert t["tokens"]["same_shape"] == t["tokens"]["constrained"]

    m = result["mask"]
    assert (m["rows"], m["steps"]) == (2, 5)
    assert m["us_per_token"]["fill"] > 0 and m["us_per_token"]["apply_masks"] > 0

    x = result["xgrammar"]
    if "skipped" in x:
        assert "xgrammar" in x["skipped"]
    else:
        assert x["library"].startswith("xgrammar") and len(x["per_schema_ms"]) == 2
        assert x["us_per_token"]["fill"] > 0
        assert x["rejected_tokens"] == 0  # both libraries take the same documents
    assert "1. compile" in proc.stdout and "4. mask cost" in proc.stdout

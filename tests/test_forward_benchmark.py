"""benchmarks/forward.py runs end to end (--quick) and reports sane figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_prints_sane_json():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.forward", "--quick", "--json", "--threads", "1"],
        cwd=ROOT,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "float32" and result["threads"] == 1
    assert [(r["batch"], r["length"]) for r in result["prefill"]] == [(1, 16), (2, 24)]
    assert [(r["batch"], r["length"]) for r in result["decode"]] == [(1, 32), (4, 32)]
    for row in result["prefill"] + result["decode"]:
        assert math.isfinite(row["kvd_tok_s"]) and row["kvd_tok_s"] > 0
        assert math.isfinite(row["hf_tok_s"]) and row["hf_tok_s"] > 0
        assert math.isclose(row["ratio"], row["kvd_tok_s"] / row["hf_tok_s"])
    assert "kvd tok/s" in proc.stdout  # the human-readable table comes first

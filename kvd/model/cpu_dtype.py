"""The dtype "auto" runs in on a CPU: bfloat16 where the cores multiply it natively, float32 elsewhere."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

# Linux /proc/cpuinfo flags of units that multiply bfloat16 natively (Xeon AMX tiles, AVX-512 BF16 dot products).
# Without one, oneDNN emulates bfloat16 through float32 and a bf16 matmul runs 1.2-7x slower than float32.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for the log and `info`


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The first core's feature flags; empty where the file cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def pick_cpu_dtype(flags: Iterable[str]) -> DtypeChoice:
    """bfloat16 when the flags name a native bf16 unit, else float32; with the reason."""
    flags = set(flags)
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return DtypeChoice(torch.bfloat16, f"CPU has {' and '.join(native)}: bfloat16 matmuls run natively")
    if not flags:
        return DtypeChoice(torch.float32, "CPU flags unreadable: float32, the safe choice")
    return DtypeChoice(
        torch.float32,
        "CPU has neither amx_bf16 nor avx512_bf16: bfloat16 would be emulated, slower than float32",
    )

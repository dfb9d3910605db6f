"""Rank placement on the CPU: each rank on its own cores, one NUMA node per rank where there are several.

Memory follows: Linux places a page on the node of the core that first touches it, and each rank loads its own
shard after it is bound, so its weights and KV pool lie in its node's memory.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NODES = Path("/sys/devices/system/node")


class CpuBindingError(ValueError):
    """--cpu-binding names no cores, cores this process may not use, or fewer lists than ranks."""


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            cpus.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise CpuBindingError(f"{text!r} is not a list of cores like 0-15 or 0-7,16-23") from None
    if not cpus:
        raise CpuBindingError(f"{text!r} names no cores")
    return cpus


def format_cpulist(cpus: list[int]) -> str:
    """The inverse of parse_cpulist, with runs folded: [0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_nodes(allowed: set[int]) -> list[list[int]]:
    """The cores of each NUMA node that this process may run on (nodes without any are left out)."""
    nodes = []
    for path in sorted(NODES.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = [c for c in parse_cpulist((path / "cpulist").read_text() or "") if c in allowed]
        if cpus:
            nodes.append(cpus)
    return nodes


def rank_cpus(spec: str, local_index: int, local_ranks: int) -> list[int] | None:
    """The cores of the local_index-th of local_ranks ranks on this host; None: leave placement to the OS.

    spec: "none"; "auto" (one NUMA node per rank when there are at least as many nodes as ranks, else an even
    split of the allowed cores in order); or one cpulist per rank separated by "|" ("0-15|16-31")."""
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "none" or (spec == "auto" and local_ranks == 1):
        return None
    if spec != "auto":
        lists = spec.split("|")
        if len(lists) < local_ranks:
            raise CpuBindingError(
                f"--cpu-binding {spec!r} has {len(lists)} core lists for {local_ranks} ranks"
            )
        cpus = parse_cpulist(lists[local_index])
        outside = sorted(set(cpus) - set(allowed))
        if outside:
            raise CpuBindingError(
                f"--cpu-binding names cores {format_cpulist(outside)} this process may not use"
            )
        return cpus
    nodes = numa_nodes(set(allowed))
    if len(nodes) >= local_ranks > 1:
        return nodes[local_index * len(nodes) // local_ranks]
    if len(allowed) < local_ranks:
        return None  # fewer cores than ranks: they share all of them
    per = len(allowed) // local_ranks
    return allowed[local_index * per : (local_index + 1) * per]


def bind_process(cpus: list[int]) -> None:
    """Bind every thread of this process (OpenMP's pool may exist already) to cpus."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)
    os.sched_setaffinity(0, cpus)

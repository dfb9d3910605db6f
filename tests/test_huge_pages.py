"""Weights and the KV pool in 2 MiB pages (kvd.model.huge_pages): same values, tied weights tied, advised memory."""

import itertools
import mmap
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from quick_benchmark import run_quick
from torch import nn

from kvd.kernels import cpu_native
from kvd.model.huge_pages import ARENA_BYTES, HUGE_PAGE, pack_weights, pool_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the 2 MiB page advice is Linux's madvise")


def thp_mode() -> str | None:
    """The bracketed mode of the kernel's transparent huge pages, or None without them."""
    if not THP.exists():
        return None
    found = re.search(r"\[(\w+)\]", THP.read_text())
    return found[1] if found else None


def thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may take 2 MiB pages (smaps' THPeligible)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def advised_inside(t: torch.Tensor) -> int:
    """An address of t's memory that lies in a whole 2 MiB page of it."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert start + HUGE_PAGE <= t.data_ptr() + t.numel() * t.element_size(), (
        "tensor too small to hold a 2 MiB page"
    )
    return start


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 1024)  # 4 MiB of float32: holds whole 2 MiB pages wherever it lands
        self.head = nn.Linear(1024, 1024, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(1024)
        big = torch.randn(8, 512)
        self.register_buffer("codes", torch.randint(-128, 127, (3000, 700), dtype=torch.int8))
        self.register_buffer("whole", big)
        self.register_buffer("view", big[2:4])  # a view of another buffer: stays where it is


def test_pack_keeps_values_ties_and_views():
    torch.manual_seed(0)
    module = Tied()
    before = {name: t.clone() for name, t in module.state_dict(keep_vars=True).items()}
    view_address = module.view.data_ptr()
    moved = pack_weights(module)
    if sys.platform != "linux":
        assert moved == 0
        return
    for name, t in module.state_dict(keep_vars=True).items():
        assert torch.equal(t, before[name]), name
    assert module.head.weight is module.embed.weight  # one Parameter, moved once
    assert isinstance(module.embed.weight, nn.Parameter)
    assert module.view.data_ptr() == view_address
    packed = [module.embed.weight, module.norm.weight, module.norm.bias, module.codes, module.whole]
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in packed]
    assert moved == sum(sizes)
    assert all(t.data_ptr() % 64 == 0 for t in packed)
    # Each lies in an arena (a storage larger than itself), and no two overlap.
    assert all(t.untyped_storage().nbytes() > t.numel() * t.element_size() for t in packed)
    spans = sorted((t.data_ptr(), t.data_ptr() + size) for t, size in zip(packed, sizes, strict=True))
    assert all(end <= begin for (_, end), (begin, _) in itertools.pairwise(spans))
    # Still usable as a module's weights.
    out = module.head(module.embed(torch.tensor([1, 2])))
    assert out.shape == (2, 1024) and torch.isfinite(out).all()


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"), reason="this kernel grants no transparent huge pages"
)
def test_packed_weights_and_pool_are_advised_for_huge_pages():
    module = Tied()
    # A mapping of its own, never advised (heap memory may lie where an earlier test advised it).
    mapping = mmap.mmap(-1, 8 << 20)
    plain = torch.frombuffer(mapping, dtype=torch.uint8)
    pack_weights(module)
    pool = pool_zeros((2, 64, 16, 4, 64), torch.float32, torch.device("cpu"))  # 2 MiB: holds a page at most
    assert thp_eligible(advised_inside(module.embed.weight))
    assert thp_eligible(advised_inside(pool_zeros((4 << 20,), torch.uint8, torch.device("cpu"))))
    assert pool.abs().sum() == 0
    if thp_mode() == "madvise":  # in "always" every mapping is eligible: nothing to tell apart
        assert not thp_eligible(advised_inside(plain))


@linux_only
def test_arenas_bound_the_extra_memory():
    """A tensor larger than an arena gets one of its own size (and a page to align it); smaller ones share."""
    module = nn.Module()
    module.register_buffer("large", torch.ones(ARENA_BYTES // 4 + 1024))
    module.register_buffer("small_a", torch.ones(1000))
    module.register_buffer("small_b", torch.ones(1000))
    pack_weights(module)
    large, a, b = module.large, module.small_a, module.small_b
    assert large.untyped_storage().nbytes() < ARENA_BYTES + 1024 * 4 + 2 * HUGE_PAGE
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert large.sum() == large.numel() and a.sum() == 1000 and b.sum() == 1000


@linux_only
def test_loaded_cpu_model_is_packed(tiny_checkpoint):
    from kvd.model.loader import load_model

    model = load_model(tiny_checkpoint("qwen3"), dtype=torch.float32).model
    weights = [t for t in list(model.parameters()) + list(model.buffers()) if t.numel() > 0]
    arenas = {t.untyped_storage().data_ptr() for t in weights}
    assert len(arenas) < len(weights) // 4  # shared arenas, not a storage per tensor


@pytest.mark.skipif(not cpu_native.available(), reason="the native kernels cannot be built here")
def test_benchmark_times_both_placements_of_the_same_weights():
    out, result = run_quick("benchmarks.huge_pages", dict(os.environ), "--modes", "int4,bf16")
    modes = ["int4"] + ([] if "bf16" in result["skipped"] else ["bf16"])
    assert set(result["cases"]) == {f"{mode} rows 4" for mode in modes}
    assert (result["skipped"] == []) == cpu_native.bf16_kernel_order()
    for case in result["cases"].values():
        assert case["ratio"] == pytest.approx(case["ordinary_ms"] / case["huge_ms"], rel=1e-6)
    if sys.platform == "linux":
        assert all(result["moved_bytes"][mode] > 30 * (3072 * 576 // 2) for mode in modes)
    assert result["cpu"] in out and "ordinary/huge" in out

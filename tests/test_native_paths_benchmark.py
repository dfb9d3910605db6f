"""benchmarks/native_paths.py times two builds of the native kernels in one process and says which is which."""

from __future__ import annotations

import os

import pytest
from quick_benchmark import run_quick

from kvd.kernels import cpu_native
from kvd.kernels.native_build import native_isa

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels cannot be built here")


def test_times_every_case_on_the_host_build_and_a_portable_one():
    out, result = run_quick("benchmarks.native_paths", dict(os.environ), "--cflags=-mno-avx2")
    assert result["isa"]["alt"] == "portable" and result["isa"]["host"] == native_isa()
    want = {
        f"{mode} {n}x{k} rows {m}"
        for mode in ("int4", "int8")
        for n, k in ((3072, 576), (576, 1536)) + (((49152, 576),) if mode == "int8" else ())
        for m in (4, 16)
    }
    assert set(result["cases"]) == want | {"attention 64x64 a layer"}
    for case in result["cases"].values():
        assert case["host_us"] > 0 and case["alt_us"] > 0
        assert case["ratio"] == pytest.approx(case["alt_us"] / case["host_us"], rel=0.01)
    assert "alt/host" in out and result["cpu"] in out
    # Each side ran its own library in the one process: plain C is far slower than the SIMD paths.
    if result["isa"]["host"] != "portable":
        ratios = sorted(c["ratio"] for name, c in result["cases"].items() if "rows" in name)
        assert ratios[len(ratios) // 2] > 1.5, result["cases"]

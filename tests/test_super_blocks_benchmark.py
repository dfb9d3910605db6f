"""benchmarks/super_blocks.py times packed super-block linears against the file's layout and checks their bits."""

from __future__ import annotations

import os

import pytest
from quick_benchmark import run_quick

from kvd.kernels import cpu_native, native_build

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels cannot be built here")


def test_times_both_layouts_of_each_matrix():
    out, result = run_quick("benchmarks.super_blocks", dict(os.environ))
    isa = native_build.isa(native_build.library())
    assert result["packs"] == ("avx512" in isa and "vnni" in isa)
    if not result["packs"]:
        assert "packs no super-blocks" in out and result["cases"] == {}
        return
    assert set(result["cases"]) == {f"{s} rows {m}" for s in ("Q4_K 64x512", "Q6_K 48x256") for m in (1, 5)}
    for case in result["cases"].values():
        assert case["file"] > 0 and case["packed"] > 0
        assert case["ratio"] == pytest.approx(case["file"] / case["packed"])
    assert "file/packed" in out and result["cpu"] in out

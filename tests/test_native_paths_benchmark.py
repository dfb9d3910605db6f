"""benchmarks/native_paths.py times two builds of the native kernels in one process and says which is which."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from quick_benchmark import ROOT, run_quick

from benchmarks import native_paths
from kvd.kernels import cpu_native, native_build
from kvd.kernels.native_build import native_isa

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels cannot be built here")
ATTENTION = {"attention 64x64 a layer", "prefill attention 4x40 bf16", "prefill attention 4x40 kv8"}


def test_times_every_case_on_the_host_build_and_a_portable_one():
    out, result = run_quick("benchmarks.native_paths", dict(os.environ), "--cflags=-mno-avx2")
    assert result["isa"]["alt"] == "portable" and result["isa"]["host"] == native_isa()
    want = {
        f"{mode} {n}x{k} rows {m}"
        for mode in ("int4", "int8")
        for n, k in ((3072, 576), (576, 1536)) + (((49152, 576),) if mode == "int8" else ())
        for m in (4, 16)
    }
    assert set(result["cases"]) == want | ATTENTION
    for case in result["cases"].values():
        assert case["host_us"] > 0 and case["alt_us"] > 0
        assert case["ratio"] == pytest.approx(case["alt_us"] / case["host_us"], rel=0.01)
    assert "alt/host" in out and result["cpu"] in out
    # Each side ran its own library in the one process: plain C is far slower than the SIMD paths.
    if result["isa"]["host"] != "portable":
        ratios = sorted(c["ratio"] for name, c in result["cases"].items() if "rows" in name)
        assert ratios[len(ratios) // 2] > 1.5, result["cases"]


@pytest.mark.skipif(
    not cpu_native.bf16_kernel_order(), reason="bf16 weights in tile order need AMX tiles or AVX-512 BF16"
)
def test_times_bf16_weights_against_the_kernels_of_a_commit():
    """--alt-commit builds the kernels' source of that commit beside the working tree's; HEAD's is this one's
    source or its ancestor, so both sides run the same paths."""
    out, result = run_quick(
        "benchmarks.native_paths",
        dict(os.environ),
        "--alt-commit",
        "HEAD",
        "--modes",
        "bf16",
    )
    assert result["alt_commit"] == "HEAD" and result["isa"]["alt"] == result["isa"]["host"] == native_isa()
    assert (
        set(result["cases"])
        == {f"bf16 {n}x{k} rows {m}" for n, k in ((3072, 576), (576, 1536)) for m in (4, 16)} | ATTENTION
    )
    assert all(case["host_us"] > 0 and case["alt_us"] > 0 for case in result["cases"].values())
    assert "kernels at HEAD" in out


def test_the_engine_workload_runs_on_both_builds_and_compares_their_tokens():
    """--engine: the throughput workload through one engine on each build; with `--cflags=` both sides are the
    host's build, so every request has the same tokens."""
    _, result = run_quick(
        "benchmarks.native_paths", dict(os.environ), "--cflags=", "--engine", "int4", "--engine-requests", "3"
    )
    case = result["cases"]["engine int4 3 requests"]
    assert case["same_requests"] == 3 and case["host_tok_s"] > 0 and case["alt_tok_s"] > 0


def test_the_engine_prefill_counts_prompt_tokens():
    """--engine-prompt-tokens: 4 prompts of that many tokens and one output token each, in prompt tok/s."""
    out, result = run_quick(
        "benchmarks.native_paths",
        dict(os.environ),
        "--cflags=",
        "--engine",
        "int4",
        "--engine-prompt-tokens",
        "96",
    )
    case = result["cases"]["engine int4 prefill 4x96"]
    assert case["same_requests"] == 4 and "prompt tok/s" in out
    # 384 prompt tokens a call, against the one output token each of the 4 requests
    assert case["host_tok_s"] == pytest.approx(384 / (case["host_us"] / 1e6), rel=0.01)


def test_an_unknown_commit_is_refused_by_name():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.native_paths", "--alt-commit", "no-such-commit", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "--alt-commit no-such-commit" in proc.stderr


def test_a_commit_with_its_kernels_in_several_files_is_built_from_all_of_them(tmp_path, monkeypatch):
    """--alt-commit at a commit whose kernels are a file per concern (this tree's, as git would show them):
    every C file and header of its kernels' folder is fetched, and the C files are built into one library."""
    tree = {f"kvd/kernels/{p.name}": p.read_text() for p in (*native_build.SOURCES, *native_build.HEADERS)}
    tree["kvd/kernels/cpu_native.py"] = "not C: left out"

    def git(commit: str, *args: str) -> str:
        if args[0] == "ls-tree":
            return "\n".join(tree) if args[-1] == "kvd/kernels/" else ""
        return tree[args[-1].split(":", 1)[1]]

    monkeypatch.setattr(native_paths, "_git", git)
    path = native_paths.commit_library("a-commit", "", str(tmp_path))
    assert {p.name for p in tmp_path.iterdir()} == {
        Path(name).name for name in tree if name.endswith((".c", ".h"))
    } | {"alt.so"}
    assert native_build.isa(native_build.ffi.dlopen(path)) == native_isa()

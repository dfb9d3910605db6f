"""benchmarks/vllm_peer.py runs every workload end to end (--quick): kvd alone without $VLLM_VENV, with vLLM's
CPU backend taking turns when its venv is given."""

from __future__ import annotations

import os

import pytest
import quick_benchmark

WORKLOADS = ["single stream", "4 concurrent"]


def run_quick(env: dict[str, str], *extra: str) -> tuple[str, dict]:
    return quick_benchmark.run_quick("benchmarks.vllm_peer", env, *extra)


def test_without_the_peer_says_so_and_measures_kvd():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VENV"}
    stdout, result = run_quick(env, "--kvd", "bf16,int4-kv8")
    assert "vLLM peer skipped: $VLLM_VENV is unset; run the vLLM CPU install script" in stdout
    assert result["peer_model"] is None and "vllm" not in result
    assert result["kvd"] == {
        "kvd bf16": {"dtype": "bfloat16", "quantization": "none", "kv_cache_dtype": "bfloat16"},
        "kvd int4-kv8": {
            "dtype": result["kvd"]["kvd int4-kv8"]["dtype"],
            "quantization": "int4",
            "kv_cache_dtype": "int8",
        },
    }
    assert result["cpu"]["model"] == "" or result["cpu"]["model"] in stdout
    assert list(result["workloads"]) == WORKLOADS
    single, concurrent = (result["workloads"][name] for name in WORKLOADS)
    assert set(single) == set(concurrent) == {"kvd bf16", "kvd int4-kv8"}  # no peer, no ratio
    for side in single:
        assert set(single[side]) == {"decode", "prefill"} and set(concurrent[side]) == {"output"}


@pytest.mark.skipif(not os.environ.get("VLLM_VENV"), reason="needs vLLM's CPU backend in $VLLM_VENV")
def test_with_vllm_taking_turns_prints_ratios():
    stdout, result = run_quick(dict(os.environ), "--kvd", "bf16,int4")
    assert result["vllm"]["start_s"] > 0 and f"vLLM {result['vllm']['version']}: started in" in stdout
    assert result["kvd"]["kvd int4"]["quantization"] == "int4"
    for name in WORKLOADS:
        row = result["workloads"][name]
        assert set(row) == {"kvd bf16", "kvd int4", "vLLM", "ratio"}
        assert set(row["ratio"]) == {"kvd bf16", "kvd int4"}
        assert all(set(ratio) == set(row["vLLM"]) == set(row["kvd bf16"]) for ratio in row["ratio"].values())

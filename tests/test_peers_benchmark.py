"""benchmarks/peers.py runs every workload end to end (--quick): kvd alone without $LLAMA_CPP_BIN, with
llama-server alternating when a build is given."""

from __future__ import annotations

import os

import pytest
import quick_benchmark

WORKLOADS = ["single stream", "4 concurrent", "shared prefix"]


def run_quick(env: dict[str, str], *extra: str) -> tuple[str, dict]:
    return quick_benchmark.run_quick("benchmarks.peers", env, *extra)


def test_without_a_peer_says_so_and_measures_kvd():
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_BIN"}
    stdout, result = run_quick(env)
    assert "llama.cpp peer skipped: $LLAMA_CPP_BIN is unset" in stdout
    assert result["peer_model"] is None and result["kvd_quantization"] == "gguf"  # Q4_1 in place
    assert result["kvd_kv_cache_dtype"] == result["kvd_dtype"]  # auto: the model's dtype
    assert list(result["workloads"]) == WORKLOADS
    single = result["workloads"]["single stream"]
    assert set(single) == {"kvd"} and set(single["kvd"]) == {"decode", "prefill"}
    assert all(set(result["workloads"][w]["kvd"]) == {"output"} for w in WORKLOADS[1:])


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_BIN"), reason="needs a llama.cpp build in $LLAMA_CPP_BIN")
def test_with_llama_server_alternating_prints_ratios():
    _, result = run_quick(dict(os.environ))
    for name in WORKLOADS:
        row = result["workloads"][name]
        assert set(row) == {"kvd", "llama.cpp", "ratio"}
        assert set(row["ratio"]) == set(row["kvd"]) == set(row["llama.cpp"])

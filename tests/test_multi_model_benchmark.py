"""benchmarks/multi_model.py: a model not loaded answers after its load, idle models beside one leave its decode
as it is, and the figures are printed."""

from __future__ import annotations

import os

from quick_benchmark import run_quick


def test_cold_and_warm_first_tokens_and_decode_beside_other_models():
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_BIN"}
    out, result = run_quick("benchmarks.multi_model", env)
    assert result["cold"] > result["warm"] > 0  # a load comes first
    assert result["alone"] > 0 and result["beside"] > 0
    assert result["gap_loading"] >= result["gap_median"] > 0 and result["gap_alone"] >= result["gap_median"]
    assert result["load_streaming"] > 0
    assert "peer_ready" not in result and "llama.cpp peer skipped" in out
    assert result["cpu"] in out and "first token, model not loaded" in out

"""benchmarks/gguf_memory.py: kvd's memory and load time of a GGUF file, beside llama-server's when there is one."""

from __future__ import annotations

import os

from quick_benchmark import run_quick


def test_without_a_peer_says_so_and_measures_kvd():
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_BIN"}
    stdout, result = run_quick("benchmarks.gguf_memory", env)
    assert "llama.cpp: skipped" in stdout and "llama.cpp" not in result
    kvd = result["kvd"]
    assert kvd["quantization"] == "gguf"  # the bundled Q4_1 file in its own type
    assert 0 < kvd["load_s"] < kvd["start_s"]
    assert kvd["imports_rss_mib"] < kvd["rss_mib"] <= kvd["peak_mib"]
    # The weights are in memory once, at about the file's size (not a float copy of them).
    assert 0.5 < kvd["model_over_file"] < 2.5

"""The families added after the first four, through a real daemon: the same greedy tokens as in process (a prompt
longer than Gemma 3's tiny window), streamed alike, and embeddings. (Structured output is the same path for every
family: tests/test_structured_output.py; these tiny checkpoints' tokenizer is larger than their vocabulary, which
grammars refuse.)"""

from __future__ import annotations

import pytest
from daemon_fixtures import start_daemon

from kvd import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 250 for i in range(30)]  # longer than the tiny Gemma 3's 8-token window


FAMILIES = [
    "granite",
    "gemma3",
    "gemma4",
    "gemma4_moe",
    "olmo2",
    "phi3",
    "qwen3_moe",
    "gpt_oss",
    "qwen3_5",
    "qwen3_next",
]
# Each family's KV groups' windows: Gemma 3's and gpt-oss's sliding layer a group; Gemma 4's full layer and each of
# its three sliding layers that keep K/V (the last two layers share earlier ones').
WINDOWS = {"gemma3": [None, 8], "gpt_oss": [None, 8], "gemma4": [None, 8, 8, 8], "gemma4_moe": [None, 8]}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_daemon_serves_the_family(tiny_checkpoint, tmp_path, family):
    folder = tiny_checkpoint(family)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16M")
    expected = llm.generate([PROMPT], greedy, use_tqdm=False)[0].token_ids
    del llm
    daemon = start_daemon(tmp_path, "--dtype", "float32", model=folder, kv_cache_memory="16M")
    try:
        with daemon.client() as client:
            info = client.info()
            assert info["model"] == folder.name
            windows = [g["window"] for g in info["kv_groups"]]
            assert windows == WINDOWS.get(family, [None])
            assert (info["experts"] is not None) == family.endswith(("moe", "oss", "next"))
            # Qwen3.5's and Qwen3-Next's linear-attention layers: state slots and checkpoints beside the pool.
            assert (info["recurrent_state"] is not None) == family.startswith(("qwen3_5", "qwen3_next"))
            got = client.generate(PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
            assert got.token_ids == expected
            streamed = [
                t
                for chunk in client.stream(PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
                for t in chunk.token_ids
            ]
            assert streamed == expected
            groups = client.stats()["kv_cache"]["groups"]
            assert [g["window"] for g in groups] == windows and all(g["used_blocks"] == 0 for g in groups)
            vectors = client.embed([PROMPT, PROMPT[:9]]).embeddings
            assert len(vectors) == 2 and vectors[0] != vectors[1]
            assert all(abs(sum(x * x for x in v) - 1.0) < 1e-4 for v in vectors)
    finally:
        assert daemon.stop() == 0, daemon.log()

"""Embeddings: pooled final hidden states against transformers, unchanged by chunking or batching, the pooling
choice, and the daemon's `embed` op with its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvd import LLM
from kvd.engine.pooling import choose_pooling
from kvd_client import BadRequestError, TooLargeError

# float32: vectors are compared with transformers' in float32.
DTYPE = "float32"
TEXTS = ["The quick brown fox", "jumps over the lazy dog, twice and then once more", "A"]


@pytest.fixture(scope="module")
def llm(tiny_daemon_model) -> LLM:
    return LLM(str(tiny_daemon_model), dtype=DTYPE, kv_cache_memory="16M")


def _reference(folder, token_ids: list[int], pooling: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0]  # after the final norm
    pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0)


def test_mean_pooled_vectors_match_transformers(tiny_daemon_model, llm):
    assert llm.engine.pooling == "mean"
    vectors = llm.embed(TEXTS, use_tqdm=False)
    for text, vector in zip(TEXTS, vectors, strict=True):
        want = _reference(tiny_daemon_model, llm.engine.encode(text), "mean")
        assert torch.allclose(torch.tensor(vector), want, atol=1e-5)
        assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-6)


def test_last_token_pooling(tiny_daemon_model):
    llm = LLM(str(tiny_daemon_model), dtype=DTYPE, kv_cache_memory="16M", pooling="last")
    assert llm.engine.info()["pooling"] == "last"
    vector = llm.embed(TEXTS[1], use_tqdm=False)[0]
    want = _reference(tiny_daemon_model, llm.engine.encode(TEXTS[1]), "last")
    assert torch.allclose(torch.tensor(vector), want, atol=1e-5)


def test_vectors_do_not_depend_on_chunking_batching_or_the_cache(tiny_daemon_model, llm):
    alone = [llm.embed(t, use_tqdm=False)[0] for t in TEXTS]
    assert llm.embed(TEXTS, use_tqdm=False) == alone
    assert llm.embed(TEXTS, use_tqdm=False) == alone  # the prompts' blocks are cached now: never read
    chunked = LLM(
        str(tiny_daemon_model), dtype=DTYPE, kv_cache_memory="16M", max_num_batched_tokens=4, max_num_seqs=4
    )
    assert chunked.embed(TEXTS, use_tqdm=False) == alone
    # Beside generations in the same steps.
    engine = chunked.engine
    engine.add_request("g", "Some prompt that generates", None)
    for i, text in enumerate(TEXTS):
        engine.add_embed_request(i, text)
    got = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.embedding is not None:
                got[out.request_id] = out.embedding
    assert [got[i] for i in range(len(TEXTS))] == alone


def test_pooling_choice(tmp_path):
    assert choose_pooling("mean", tmp_path, "Qwen3-Embedding-0.6B")[0] == "mean"
    assert choose_pooling("auto", tmp_path, "Qwen3-Embedding-0.6B")[0] == "last"
    assert choose_pooling("auto", tmp_path, "SmolLM2-135M")[0] == "mean"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    pooling, reason = choose_pooling("auto", tmp_path, "model")
    assert pooling == "last" and "1_Pooling" in reason


def test_the_daemon_embeds_beside_generations(tiny_daemon, llm):
    with tiny_daemon.client() as client:
        stream = client.stream("Keep generating", max_tokens=40, temperature=0, ignore_eos=True)
        result = client.embed(TEXTS)
        assert [c for c in stream][-1].finish_reason == "length"
        assert result.pooling == "mean" and result.dimensions == 64
        assert result.prompt_tokens == sum(len(llm.engine.encode(t)) for t in TEXTS)
        want = llm.embed(TEXTS, use_tqdm=False)
        assert all(
            torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-6)
            for g, w in zip(result.embeddings, want, strict=True)
        )
        short = client.embed(TEXTS[0], dimensions=8).embeddings[0]
        head = torch.nn.functional.normalize(torch.tensor(want[0][:8]), dim=0)
        assert len(short) == 8 and torch.allclose(torch.tensor(short), head, atol=1e-6)
        by_ids = client.embed([llm.engine.encode(TEXTS[0])]).embeddings[0]
        assert torch.allclose(torch.tensor(by_ids), torch.tensor(want[0]), atol=1e-6)


@pytest.mark.parametrize(
    ("fields", "error", "field"),
    [
        ({"input": []}, BadRequestError, "input"),
        ({"input": ["ok", ""]}, BadRequestError, "input[1]"),
        ({"input": [["x"]]}, BadRequestError, "input[0]"),
        ({"input": "x", "dimensions": 0}, BadRequestError, "dimensions"),
        ({"input": "x", "dimensions": 65}, BadRequestError, "dimensions"),
        ({"input": ["x"] * 257}, BadRequestError, "input"),
        ({"input": ["fine", "word " * 5000]}, TooLargeError, "input[1]"),
    ],
)
def test_bad_embed_requests_name_the_field(tiny_daemon, fields, error, field):
    with tiny_daemon.client() as client:
        with pytest.raises(error) as e:
            client._call("embed", fields)
        assert e.value.field == field
        assert client.embed("still serving").dimensions == 64

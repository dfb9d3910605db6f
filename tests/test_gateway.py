"""The OpenAI-compatible gateway against a real daemon (`kvd serve --http`): the official openai client, curl,
disconnects, errors and /metrics. The reference for every output is the daemon itself through kvd_client."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from client_parity import stale_socket
from daemon_fixtures import REPO, DaemonProcess, daemon_env, start_daemon
from gateway_fixtures import (  # noqa: F401
    daemon_fixture,
    free_port,
    gateway_daemon,
    http_get,
    kvd_fixture,
    model_fixture,
    oai_fixture,
)
from prometheus_client.parser import text_string_to_metric_families

from kvd.gateway import callers
from kvd.gateway.metrics import GatewayMetrics
from kvd.gateway.outcome import answer
from kvd.server.serve import EXIT_GATEWAY_FAILED
from kvd_client import Client

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
PROMPT = "The capital of France is"
# Longer than two 16-token blocks, so that a second request hits the prefix cache.
LONG_PROMPT = "Once upon a time in a land far away there lived a king who had three daughters. " * 3


def test_models_and_health(oai: openai.OpenAI, kvd: Client, daemon: DaemonProcess):
    (card,) = oai.models.list().data
    assert card.id == kvd.info()["model"] and card.owned_by == "kvd"
    assert oai.models.retrieve(card.id) == card
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.models.retrieve("gpt-4")
    assert json.loads(http_get(daemon.base_url, "/health")[1]) == {"status": "ready"}


def test_completions_match_the_daemon_streamed_or_not(oai: openai.OpenAI, kvd: Client, model: str):
    expected = kvd.generate(PROMPT, **GREEDY)
    extra = {"ignore_eos": True}
    whole = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12, extra_body=extra)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.usage.prompt_tokens, 12)
    assert whole.usage.total_tokens == expected.usage.prompt_tokens + 12
    stream = oai.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_ids_as_prompt_and_cached_prompt_tokens(oai: openai.OpenAI, kvd: Client, model: str):
    ids = kvd.tokenize(LONG_PROMPT)
    first = oai.completions.create(model=model, prompt=ids, temperature=0, max_tokens=4)
    second = oai.completions.create(model=model, prompt=ids, temperature=0, max_tokens=4)
    assert first.usage.prompt_tokens == len(ids)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The daemon's count for a repeat: kvd_client's requests have a namespace of their own (the gateway salts
    # its callers'), so the first one warms it.
    kvd.generate(ids, temperature=0, max_tokens=1)
    assert cached >= 32 and cached == kvd.generate(ids, temperature=0, max_tokens=1).usage.cached_tokens


def test_sampling_fields_reach_the_daemon(oai: openai.OpenAI, kvd: Client, model: str):
    params = dict(
        temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=10
    )
    expected = kvd.generate(PROMPT, **params, ignore_eos=True).text
    got = oai.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True}, **params)
    assert got.choices[0].text == expected
    # stop: the text ends before the stop string, as the daemon cuts it.
    stop = expected[3:6]
    cut = oai.completions.create(model=model, prompt=PROMPT, stop=[stop], **params)
    assert cut.choices[0].text == kvd.generate(PROMPT, **params, stop=[stop]).text
    assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_usage_counts_the_tokens_returned_before_a_stop_string(
    oai: openai.OpenAI, kvd: Client, model: str, chat: bool
):
    """OpenAI's and vLLM's completion_tokens: the tokens of the completion returned, not those of the stop string
    that the daemon sampled too (its own usage counts them), whole or streamed."""
    messages = [{"role": "user", "content": "Hi"}]

    def daemon(**fields: object):
        return kvd.chat(messages, **fields) if chat else kvd.generate(PROMPT, **fields)

    # Two tokens from a token's start: the stop string's tokens are sampled, then dropped from the reply.
    stop = kvd.detokenize(daemon(**GREEDY).token_ids[4:6])
    expected = daemon(**GREEDY, stop=[stop])
    returned = len(expected.token_ids)
    assert expected.finish_reason == "stop" and expected.usage.completion_tokens > returned, expected
    create = oai.chat.completions.create if chat else oai.completions.create
    params = dict(model=model, temperature=0, max_tokens=12, stop=[stop], extra_body={"ignore_eos": True})
    params |= {"messages": messages} if chat else {"prompt": PROMPT}
    whole = create(**params)
    assert (whole.choices[0].message.content if chat else whole.choices[0].text) == expected.text
    assert whole.usage.completion_tokens == returned
    assert whole.usage.total_tokens == expected.usage.prompt_tokens + returned
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(create(**params, stream=True, stream_options=options))
    (last,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.usage.completion_tokens == returned and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == returned


def test_n_choices_with_a_seed_are_the_seeds_of_each_choice(oai: openai.OpenAI, kvd: Client, model: str):
    messages = [{"role": "user", "content": "Hi"}]
    params = dict(temperature=1.0, max_tokens=8)
    expected = [kvd.chat(messages, seed=5 + i, ignore_eos=True, **params).text for i in range(3)]
    extra = {"ignore_eos": True}
    whole = oai.chat.completions.create(
        model=model, messages=messages, n=3, seed=5, extra_body=extra, **params
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 24
    stream = oai.chat.completions.create(
        model=model, messages=messages, n=3, seed=5, stream=True, extra_body=extra, **params
    )
    texts = ["", "", ""]
    roles = []
    for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles.append(choice.delta.role)
    assert texts == expected
    assert roles.count("assistant") == 3  # the first delta of each choice carries the role


def test_chat_logprobs_match_the_daemon(oai: openai.OpenAI, kvd: Client, model: str):
    messages = [{"role": "user", "content": "Name a colour"}]
    expected = kvd.chat(messages, logprobs=2, **GREEDY)
    got = oai.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = got.choices[0].logprobs.content
    assert "".join(t.token for t in content) == got.choices[0].message.content == expected.text
    assert [t.logprob for t in content] == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(expected.logprobs[0].top_logprobs[0][1])


def test_completion_logprobs_have_offsets_into_the_text(oai: openai.OpenAI, model: str):
    got = oai.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3)
    lp, text = got.choices[0].logprobs, got.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.token_logprobs) == 6
    assert [text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens, strict=True)] == lp.tokens
    assert all(len(top) <= 3 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    # Cut by a stop string in the middle of the output: the tokens are those whose text begins in the text
    # (the last may run past the cut), streamed or not; the stop string's own tokens are gone.
    stop = text[len(text) // 2 :][:2]
    seen = []
    for stream in (False, True):
        params = dict(model=model, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=1, stop=[stop])
        if stream:
            chunks = [c.choices[0] for c in oai.completions.create(**params, stream=True)]
            cut = "".join(c.text for c in chunks)
            tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
            offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        else:
            got = oai.completions.create(**params).choices[0]
            cut, tokens, offsets = got.text, got.logprobs.tokens, got.logprobs.text_offset
        joined = "".join(tokens)
        assert cut == text[: text.index(stop)] and joined.startswith(cut), (stream, stop, tokens)
        assert len(joined) - len(tokens[-1]) < len(cut) and len(tokens) < 6, (stream, stop, tokens)
        seen.append((tokens, offsets))
    assert seen[0] == seen[1]  # each token's offset is where its text starts, streamed or not


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"temperature": 500}, 400, "temperature"),  # the daemon's own validation, field named
        ({"frobnicate": 1}, 400, "frobnicate"),  # unknown fields are rejected, not ignored
        ({"n": 0}, 400, "n"),
        ({"model": "gpt-4"}, 404, "model"),
        # Values JSON carries but msgpack cannot: refused with the field named, not a 500.
        ({"seed": 2**64}, 400, "seed"),
        ({"max_tokens": 10**30}, 400, "max_tokens"),
        ({"prompt": "a\udc00b"}, 400, "prompt"),
        ({"stop": ["x", "\ud800"]}, 400, "stop[1]"),
        ({"stream": True, "seed": 2**64}, 400, "seed"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream
        ({"suffix": "and so on"}, 400, "suffix"),
    ],
)
def test_errors_have_openai_shape_and_status(
    daemon: DaemonProcess, model: str, body: dict, status: int, param: str
):
    request = {"model": model, "prompt": PROMPT, "max_tokens": 2, **body}
    code, text = _post(daemon.base_url, "/v1/completions", request)
    error = json.loads(text)["error"]
    assert code == status and error["param"] == param and error["message"], text
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("short", "long"), [("Hi", "Hi " * 5000), ([28], [28] * 5000)])
def test_a_too_long_prompt_of_a_list_is_named_by_its_index(
    daemon: DaemonProcess, model: str, short: object, long: object
):
    request = {"model": model, "prompt": [short, long], "n": 2, "max_tokens": 2}
    code, text = _post(daemon.base_url, "/v1/completions", request)
    error = json.loads(text)["error"]
    assert (code, error["param"]) == (400, "prompt[1]") and error["message"].startswith("prompt[1]: "), text
    # One prompt, a text or token ids, is `prompt` itself.
    code, text = _post(daemon.base_url, "/v1/completions", {**request, "prompt": long})
    assert (code, json.loads(text)["error"]["param"]) == (400, "prompt"), text


@pytest.mark.parametrize("role", ["system", "user"])
def test_null_content_is_a_400_naming_the_message(oai: openai.OpenAI, model: str, role: str):
    """Allowed only in an assistant message with tool_calls. Streamed with continuous usage, the gateway asks the
    daemon's tokenize first, which refuses it as chat does."""
    messages = [{"role": role, "content": None}, {"role": "user", "content": "Hi"}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    for extra in ({}, {"stream": True, "stream_options": options}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=model, messages=messages, max_tokens=2, **extra)
        assert info.value.param == "messages[0].content", info.value


def test_null_is_the_default_and_errors_name_the_request_field_once(daemon: DaemonProcess, model: str):
    nulls = {"n": None, "stream": None, "echo": None, "logprobs": None, "stop": None, "seed": None}
    code, text = _post(
        daemon.base_url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2, **nulls}
    )
    assert code == 200 and len(json.loads(text)["choices"]) == 1, text
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    code, text = _post(
        daemon.base_url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}
    )
    error = json.loads(text)["error"]
    assert (code, error["param"]) == (400, "top_logprobs") and error["message"].startswith(
        "top_logprobs: must"
    )
    assert "logprobs:" not in error["message"].removeprefix("top_logprobs:"), error
    # Choice j samples with seed + j: a seed that would overflow for the last choice is refused up front.
    code, text = _post(
        daemon.base_url, "/v1/completions", {"model": model, "prompt": PROMPT, "n": 2, "seed": 2**63 - 1}
    )
    error = json.loads(text)["error"]
    assert (code, error["param"]) == (400, "seed") and str(2**63 - 2) in error["message"], error
    echoed = {"model": model, "prompt": PROMPT, "n": 2, "seed": 2**63 - 1, "echo": True, "max_tokens": 0}
    code, text = _post(daemon.base_url, "/v1/completions", echoed)  # echo lifts the max_tokens refusal only
    assert (code, json.loads(text)["error"]["param"]) == (400, "seed"), text


def test_an_overloaded_daemon_is_a_429_with_retry_after_for_that_caller_only(
    tiny_daemon_model: Path, tmp_path: Path
):
    with gateway_daemon(tiny_daemon_model, tmp_path, "--max-queued-per-client", "1") as proc:
        with proc.client() as kvd:
            model = kvd.info()["model"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
        holder = http.client.HTTPConnection(proc.base_url.removeprefix("http://"), timeout=30)
        holder.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), JSON_HEADERS)
        stream = holder.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data:")  # it holds the one slot
        code, text = _post(proc.base_url, "/v1/completions", body, with_headers=True)
        # Another caller (its `user`) has a connection, and so a quota, of its own.
        other, _ = _post(proc.base_url, "/v1/completions", {**body, "max_tokens": 2, "user": "another"})
        holder.close()
    (status, retry_after), error = code, json.loads(text)["error"]
    assert (status, retry_after, error["type"]) == (429, "1", "rate_limit_error"), error
    assert other == 200


def test_a_gateway_bug_is_a_500_in_the_apis_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from fastapi.testclient import TestClient

    from kvd.gateway.app import create_app
    from kvd.gateway.state import Gateway

    async def broken(self: Gateway, request: object) -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Gateway, "models", broken)
    app = create_app(f"ipc://{tmp_path}/none.sock")
    # A loopback base URL: the gateway refuses TestClient's default Host, "testserver" (kvd.gateway.auth).
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as http:
        reply = http.get("/v1/models")
        ollama = http.get("/api/tags")
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error", reply.text
    assert "RuntimeError" in reply.json()["error"]["message"]
    assert ollama.status_code == 500 and "RuntimeError" in ollama.json()["error"], ollama.text


def test_health_answers_within_its_bound_when_the_daemon_is_gone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    from fastapi.testclient import TestClient

    from kvd.gateway import app as gateway_app

    monkeypatch.setattr(gateway_app, "HEALTH_TIMEOUT_S", 0.5)
    endpoint = stale_socket(
        tmp_path / "crashed.sock"
    )  # as a killed daemon leaves it: the client would wait 30 s
    with TestClient(gateway_app.create_app(endpoint), base_url="http://localhost") as http:
        started = time.monotonic()
        reply = http.get("/health")
    assert reply.status_code == 503 and reply.json()["status"] == "unavailable"
    assert time.monotonic() - started < 5, "the probe waited for the client's timeout"


@pytest.mark.parametrize("socket_file", ["missing", "stale"])
def test_an_absent_daemon_is_a_503_naming_the_gateways_flag(tmp_path: Path, socket_file: str):
    """Whoever reads it runs the gateway: the way to point it elsewhere is its --endpoint flag."""
    from fastapi.testclient import TestClient

    from kvd.gateway.app import create_app

    path = tmp_path / "kvd.sock"
    endpoint = stale_socket(path) if socket_file == "stale" else f"ipc://{path}"
    with TestClient(create_app(endpoint, timeout=0.5), base_url="http://localhost") as http:
        replies = [http.get("/v1/models"), http.get("/api/tags"), http.get("/health")]
    assert [r.status_code for r in replies] == [503] * 3
    openai_error, ollama_error, health = (r.json() for r in replies)
    assert openai_error["error"]["code"] == "daemon_unavailable"
    for message in (openai_error["error"]["message"], ollama_error["error"], health["message"]):
        assert "`kvd gateway --endpoint`" in message and "AsyncClient" not in message, message


def test_an_unexpected_failure_is_a_counted_server_error():
    metrics = GatewayMetrics()

    async def broken() -> dict:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        asyncio.run(answer(metrics, "/v1/completions", {}, broken()))
    scraped = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition(None).decode())
        for s in family.samples
    }
    assert (
        scraped[
            ("kvd_gateway_requests_total", (("endpoint", "/v1/completions"), ("outcome", "server_error")))
        ]
        == 1
    )


def test_the_openai_client_raises_its_typed_errors(oai: openai.OpenAI, model: str):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=500)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.completions.create(model="nope", prompt=PROMPT)


JSON_HEADERS = {"Content-Type": "application/json"}


def _post(base_url: str, path: str, body: dict, with_headers: bool = False) -> tuple:
    """The status (with the Retry-After header if asked) and the body of a plain POST."""
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), JSON_HEADERS)
        response = conn.getresponse()
        status = (response.status, response.getheader("Retry-After")) if with_headers else response.status
        return status, response.read().decode()
    finally:
        conn.close()


def _curl(daemon: DaemonProcess, path: str, body: dict) -> str:
    cmd = ["curl", "-sS", "-N", f"{daemon.base_url}{path}", "-H", "Content-Type: application/json"]
    return subprocess.run(
        [*cmd, "-d", json.dumps(body)], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_curl_plain_and_server_sent_events(daemon: DaemonProcess, kvd: Client, model: str):
    messages = [{"role": "user", "content": "Hi"}]
    expected = kvd.chat(messages, **GREEDY).text
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    whole = json.loads(_curl(daemon, "/v1/chat/completions", body))
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == expected
    events = _curl(daemon, "/v1/chat/completions", {**body, "stream": True}).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected


def _wait_idle(kvd: Client, within: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        if kvd.stats()["daemon"]["num_requests"] == 0:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight {within} s after the HTTP client left: {kvd.stats()}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request(
    daemon: DaemonProcess, kvd: Client, model: str, stream: bool
):
    # 4000 tokens of the tiny model take several seconds; the abort must come well before.
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    conn = http.client.HTTPConnection(daemon.base_url.removeprefix("http://"), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while kvd.stats()["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    if stream:
        response = conn.getresponse()
        assert response.read(6) == b"data: "  # the stream began
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert _wait_idle(kvd, within=3.0) < 3.0


def test_metrics(daemon: DaemonProcess, oai: openai.OpenAI, kvd: Client, model: str):
    before = _metrics(daemon)
    oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt=PROMPT, temperature=500)
    with pytest.raises(openai.BadRequestError):  # refused by the gateway's own validation
        oai.completions.create(model=model, prompt=PROMPT, extra_body={"frobnicate": 1})
    assert http_get(daemon.base_url, "/no/such/route")[0] == 404
    assert http_get(daemon.base_url, "/v1/completions")[0] == 405
    after = _metrics(daemon)

    def delta(name: str, **labels: str) -> float:
        return after.get((name, tuple(sorted(labels.items()))), 0) - before.get(
            (name, tuple(sorted(labels.items()))), 0
        )

    assert delta("kvd_gateway_requests_total", endpoint="/v1/completions", outcome="success") == 1
    assert delta("kvd_gateway_requests_total", endpoint="/v1/completions", outcome="client_error") == 1
    http = "kvd_gateway_http_requests_total"
    assert delta(http, endpoint="/v1/completions", status="200") == 1
    assert delta(http, endpoint="/v1/completions", status="400") == 2
    assert delta(http, endpoint="/v1/completions", status="405") == 1
    assert delta(http, endpoint="unmatched", status="404") == 1
    assert delta(http, endpoint="/metrics", status="200") == 1  # the scrape before
    assert not [k for k in after if k[0] == http and ("endpoint", "/no/such/route") in k[1]]
    assert delta("kvd_gateway_generation_tokens_total") == 5
    assert delta("kvd_gateway_prompt_tokens_total") == len(kvd.tokenize(PROMPT))
    assert delta("kvd_gateway_time_to_first_token_seconds_count") == 1
    assert delta("kvd_gateway_inter_token_latency_seconds_count") == 4
    info, stats = kvd.info(), kvd.stats()
    by_model = (("model", model),)  # the engines' figures are labelled by model
    assert after[("kvd_daemon_up", ())] == 1
    assert after[("kvd_kv_cache_blocks", by_model)] == info["num_blocks"]
    one_group = (("group", "0"), ("model", model), ("window", "full"))  # one group here
    assert ("kvd_kv_cache_group_used_blocks", one_group) in after
    assert after[("kvd_preemptions_total", by_model)] == stats["num_preemptions"]
    assert after[("kvd_prefix_cache_hit_tokens_total", by_model)] <= stats["prefix_cache"]["hit_tokens"]
    assert ("kvd_queued_requests", ()) in after  # the daemon's queue and every engine's
    for name in ("kvd_running_sequences", "kvd_kv_cache_usage_ratio", "kvd_prefix_cache_hit_rate"):
        assert (name, by_model) in after


def _metrics(daemon: DaemonProcess) -> dict[tuple[str, tuple], float]:
    status, text = http_get(daemon.base_url, "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_gateway_imports_no_torch():
    # Every module of the request surface too, not only those the gateway imports today: it may take any of them.
    code = (
        "import importlib, pkgutil, sys, kvd.gateway.app, kvd.gateway.server, kvd.request\n"
        "for module in pkgutil.iter_modules(kvd.request.__path__, 'kvd.request.'):\n"
        "    importlib.import_module(module.name)\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_a_non_loopback_address_needs_allow_remote_and_a_taken_port_is_status_2():
    cmd = [sys.executable, "-m", "kvd.cli", "gateway", "--http", "0.0.0.0:8000"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=60)
    assert result.returncode == 2 and "--allow-remote" in result.stderr and "Traceback" not in result.stderr
    # A unit that restarts on anything but status 2 would restart-loop on a port another program holds.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cmd = [sys.executable, "-m", "kvd.cli", "gateway", "--http", f"127.0.0.1:{port}"]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=60)
    assert result.returncode == 2 and "cannot listen there" in result.stderr, result.stderr


def test_callers_keep_their_connections_within_a_bound(monkeypatch: pytest.MonkeyPatch):
    opened = []

    class Fake:
        in_flight = 0
        closed = False

        def close(self) -> None:
            self.closed = True

    def connect() -> Fake:
        opened.append(Fake())
        return opened[-1]

    clock = [1000.0]
    monkeypatch.setattr(callers.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(callers, "KEEP", 2)
    shared = Fake()
    pool = callers.CallerClients(connect, shared)
    a, b = pool.get("a"), pool.get("b")
    assert pool.get("a") is a and len(opened) == 2
    assert pool.get("c") is shared and len(opened) == 2  # at the bound, nothing idle long enough: shared
    b.in_flight = 1
    clock[0] += callers.IDLE_S
    c = pool.get("c")  # a is idle and old: closed for c; b is old but busy
    assert a.closed and not b.closed and set(pool.clients) == {"b", "c"} and c is opened[-1]
    assert pool.get("d") is shared and not c.closed  # b busy, c recent
    pool.close()
    assert all(x.closed for x in opened) and not shared.closed  # the shared one is the gateway's to close


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the child; PR_SET_PDEATHSIG is Linux's")
def test_the_http_child_is_part_of_the_daemon(tiny_daemon_model: Path, tmp_path: Path):
    # A gateway that dies leaves HTTP clients nothing: the daemon drains and stops, failing (systemd restarts).
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc = start_daemon(tmp_path / "a", "--http", f"127.0.0.1:{free_port()}", model=tiny_daemon_model)
    (gateway,) = _children(proc.proc.pid)
    os.kill(gateway, signal.SIGKILL)
    assert proc.proc.wait(60) == EXIT_GATEWAY_FAILED and "HTTP gateway" in proc.log(), proc.log()
    # A daemon that dies takes its gateway with it: no orphan keeps the port.
    proc = start_daemon(tmp_path / "b", "--http", f"127.0.0.1:{free_port()}", model=tiny_daemon_model)
    (gateway,) = _children(proc.proc.pid)
    proc.proc.kill()
    proc.proc.wait(30)
    deadline = time.monotonic() + 30
    while (
        Path(f"/proc/{gateway}").exists() and "Z" not in Path(f"/proc/{gateway}/stat").read_text().split()[2]
    ):
        assert time.monotonic() < deadline, "the gateway outlived its daemon"
        time.sleep(0.1)

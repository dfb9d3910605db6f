"""The Python client and the CLI: endpoint resolution, timeouts without a daemon, every call against one."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq
from client_parity import run_with_planted_tmp, stale_socket
from daemon_fixtures import (
    REPO,
    DaemonProcess,
    daemon_env,
    free_tcp_port,
    ipv6_loopback_or_refusal,
    start_daemon,
    tcp_daemon,
)

from kvd_client import (
    AsyncClient,
    BadRequestError,
    Client,
    Embeddings,
    EndpointError,
    KvdTimeoutError,
    NoDaemonError,
    TooLargeError,
    ToolCall,
    resolve_endpoint,
)
from kvd_client.endpoint import check_private_dir, parse_endpoint

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}

# Without a daemon.


def test_importing_the_client_and_the_cli_does_not_import_torch():
    code = (
        "import sys, kvd_client, kvd.cli; "
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_default_endpoint_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("KVD_ENDPOINT", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert resolve_endpoint().url == f"ipc://{tmp_path}/kvd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert resolve_endpoint().url == f"ipc:///tmp/kvd-{os.getuid()}/kvd.sock"
    monkeypatch.setenv("KVD_ENDPOINT", "tcp://127.0.0.1:7000")
    assert resolve_endpoint().url == "tcp://127.0.0.1:7000"
    assert resolve_endpoint("ipc:///run/kvd/kvd.sock").path == Path("/run/kvd/kvd.sock")


MALFORMED_ENDPOINTS = ["kvd.sock", "ipc://relative/kvd.sock", "ipc://@abstract", f"ipc:///{'x' * 120}"]
MALFORMED_ENDPOINTS += [
    "tcp://127.0.0.1",
    "tcp://:80",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:http",
    "udp://h:9",
]


@pytest.mark.parametrize("url", MALFORMED_ENDPOINTS)
def test_malformed_endpoints_are_refused(url: str):
    with pytest.raises(EndpointError):
        parse_endpoint(url)


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("ipc:///tmp/x.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.9.1:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://[2001:db8::5]:5555", False),
        ("tcp://*:5555", False),
        ("tcp://192.168.1.4:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_loopback_detection(url: str, loopback: bool):
    assert parse_endpoint(url).is_loopback is loopback


@pytest.mark.parametrize(
    ("url", "ipv6"),
    [
        ("tcp://[::1]:5555", True),
        ("tcp://::1:5555", True),
        ("tcp://[2001:db8::5]:5555", True),
        ("tcp://[fe80::1%eth0]:5555", True),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://localhost:5555", False),  # names resolve to IPv4, as the daemon binds them
        ("tcp://*:5555", False),
        ("tcp://eth0:5555", False),
        ("ipc:///tmp/x.sock", False),
    ],
)
def test_ipv6_detection(url: str, ipv6: bool):
    assert parse_endpoint(url).is_ipv6 is ipv6


def _folder(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    path.chmod(mode)  # mkdir's mode is cut by the umask
    return path


def test_the_tmp_folder_of_the_default_endpoint_must_be_private(tmp_path: Path):
    check_private_dir(_folder(tmp_path / "private"))
    check_private_dir(tmp_path / "missing")  # the daemon creates it
    link = tmp_path / "link"
    link.symlink_to(_folder(tmp_path / "target"))
    file = tmp_path / "file"
    file.write_text("")
    open_to_others = _folder(tmp_path / "open", 0o755)
    refused = [
        (link, "symbolic link"),
        (file, "not a directory"),
        (open_to_others, f"chmod 700 {open_to_others}"),
    ]
    for path, why in refused:
        with pytest.raises(EndpointError, match=re.escape(why)) as e:
            check_private_dir(path)
        assert "KVD_ENDPOINT" in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_tmp_folder_of_another_user_is_refused(tmp_path: Path):
    theirs = _folder(tmp_path / "theirs")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(EndpointError, match=r"belongs to another user \(uid 65534\); remove it"):
        check_private_dir(theirs)


def test_a_planted_tmp_folder_is_refused_before_any_request_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Refused at resolution, and when planted after it (the daemon not started yet) before each request, so
    that whoever listens there never reads one."""
    shared = tmp_path / "kvd-shared"
    monkeypatch.delenv("KVD_ENDPOINT", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("kvd_client.endpoint.default_socket_dir", lambda: shared)
    with Client(timeout=5) as client, zmq.Context.instance().socket(zmq.ROUTER) as planted:
        planted.setsockopt(zmq.LINGER, 0)
        _folder(shared, 0o777)
        planted.bind(f"ipc://{shared}/kvd.sock")
        with pytest.raises(EndpointError, match="open to other users"):
            client.generate("a secret prompt")
        assert not planted.poll(300)
    with pytest.raises(EndpointError, match="open to other users"):
        Client()


def test_the_default_endpoint_refuses_a_tmp_folder_planted_by_another_user():
    proc = run_with_planted_tmp([sys.executable, "-c", "from kvd_client import Client; Client()"])
    assert proc.returncode == 1 and "EndpointError" in proc.stderr, proc.stderr
    assert f"/tmp/kvd-{os.getuid()} belongs to another user (uid 65534)" in proc.stderr


def _assert_times_out(call: Callable[[], object], timeout: float) -> None:
    started = time.monotonic()
    with pytest.raises(KvdTimeoutError, match="is `kvd serve` running"):
        call()
    assert timeout <= time.monotonic() - started < timeout + 1.5


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(timeout: float):
    for make in (Client, AsyncClient):
        with pytest.raises(ValueError, match="timeout"):
            make("ipc:///nonexistent/kvd.sock", timeout=timeout)


def test_sync_calls_time_out_on_a_socket_nobody_answers(tmp_path: Path):
    with Client(stale_socket(tmp_path / "stale.sock"), timeout=0.4) as client:
        _assert_times_out(client.health, 0.4)
        _assert_times_out(lambda: client.generate("hi"), 0.4)
        _assert_times_out(lambda: next(iter(client.stream("hi"))), 0.4)


def test_async_calls_time_out_on_a_socket_nobody_answers(tmp_path: Path):
    async def main() -> None:
        async with AsyncClient(stale_socket(tmp_path / "stale.sock"), timeout=0.4) as client:
            for call in (client.health, lambda: client.generate("hi"), lambda: anext(client.stream("hi"))):
                started = time.monotonic()
                with pytest.raises(KvdTimeoutError):
                    await call()
                assert 0.4 <= time.monotonic() - started < 1.9

    asyncio.run(main())


def test_a_missing_socket_file_fails_at_once_naming_how_to_choose_the_endpoint(tmp_path: Path):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    started = time.monotonic()
    with (
        Client(endpoint, timeout=30) as client,
        pytest.raises(NoDaemonError, match="Client\\(endpoint=") as e,
    ):
        client.generate("hi")
    assert endpoint in str(e.value) and "KVD_ENDPOINT" in str(e.value)

    async def main() -> None:
        async with AsyncClient(endpoint, timeout=30) as client:
            with pytest.raises(NoDaemonError):
                await client.health()
            with pytest.raises(NoDaemonError):
                await anext(client.stream("hi"))

    asyncio.run(main())
    assert time.monotonic() - started < 5  # not the 30 s timeout


def _scripted_daemon(endpoint: str, script: Callable[[zmq.Socket, bytes, dict], None]) -> threading.Thread:
    """A bare ROUTER socket that answers the first request with `script`: the client's side of the protocol,
    with timings a real daemon would not produce on demand."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)

    def run() -> None:
        identity, data = sock.recv_multipart()
        script(sock, identity, msgpack.unpackb(data))
        sock.close(linger=1000)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _send(sock: zmq.Socket, identity: bytes, reply: dict) -> None:
    sock.send_multipart([identity, msgpack.packb(reply)])


def test_heartbeats_keep_a_long_call_alive_and_stray_replies_are_ignored(tmp_path: Path):
    def script(sock: zmq.Socket, identity: bytes, request: dict) -> None:
        for _ in range(6):  # 1.2 s in all: three times the client's timeout
            time.sleep(0.2)
            _send(sock, identity, {"id": None, "type": "heartbeat"})
        _send(sock, identity, {"id": 999, "type": "result", "status": "not yours"})
        _send(sock, identity, {"id": request["id"], "type": "result", "status": "ready"})

    endpoint = f"ipc://{tmp_path}/fake.sock"
    thread = _scripted_daemon(endpoint, script)
    with Client(endpoint, timeout=0.4) as client:
        assert client.health() == {"status": "ready"}
    thread.join(5)


def test_a_daemon_that_falls_silent_mid_stream_is_a_timeout(tmp_path: Path):
    def script(sock: zmq.Socket, identity: bytes, request: dict) -> None:
        _send(sock, identity, {"id": request["id"], "type": "chunk", "text": "a", "token_ids": [1]})
        time.sleep(1.5)

    endpoint = f"ipc://{tmp_path}/fake.sock"
    thread = _scripted_daemon(endpoint, script)
    with Client(endpoint, timeout=0.4) as client:
        stream = client.stream("hi")
        assert next(stream).text == "a"
        _assert_times_out(lambda: next(stream), 0.4)
        assert stream.done
    thread.join(5)


def test_tool_calls_and_prompt_logprobs_are_read_and_history_messages_sent_as_given(tmp_path: Path):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "weather"},
    ]
    seen = {}
    call = {
        "id": "call_2",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
    }
    top = {"token_id": 7, "logprob": -0.5, "top_logprobs": [[7, -0.5], [8, -1.5]]}

    def script(sock: zmq.Socket, identity: bytes, request: dict) -> None:
        seen.update(request)
        final = {
            "id": request["id"],
            "type": "final",
            "text": "",
            "token_ids": [1, 2],
            "finish_reason": "tool_calls",
            "tool_calls": [call],
            "prompt_logprobs": [None, top],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0},
        }
        _send(sock, identity, final)

    endpoint = f"ipc://{tmp_path}/fake.sock"
    thread = _scripted_daemon(endpoint, script)
    with Client(endpoint, timeout=5) as client:
        reply = client.chat(history, tools=[{"type": "function", "function": {"name": "weather"}}])
    thread.join(5)
    assert seen["messages"] == history and seen["tools"][0]["function"]["name"] == "weather"
    assert reply.finish_reason == "tool_calls"
    assert reply.tool_calls == [ToolCall("call_2", "weather", '{"city": "Rome"}')]
    assert reply.tool_calls[0].to_message() == call
    assert reply.prompt_logprobs[0] is None and reply.prompt_logprobs[1].top_logprobs == [
        (7, -0.5),
        (8, -1.5),
    ]


def test_embed_sends_the_inputs_and_reads_the_vectors(tmp_path: Path):
    seen = []

    def script(sock: zmq.Socket, identity: bytes, request: dict) -> None:
        seen.append(request)
        result = {
            "id": request["id"],
            "type": "result",
            "embeddings": [[0.6, 0.8], [1.0, 0.0]],
            "dimensions": 2,
            "pooling": "mean",
            "usage": {"prompt_tokens": 5},
        }
        _send(sock, identity, result)

    endpoint = f"ipc://{tmp_path}/fake.sock"
    thread = _scripted_daemon(endpoint, script)

    async def main() -> Embeddings:
        async with AsyncClient(endpoint, timeout=5) as client:
            return await client.embed([(1, 2, 3), "two"], dimensions=2)

    out = asyncio.run(main())
    thread.join(5)
    assert {k: seen[0][k] for k in ("op", "input", "dimensions")} == {
        "op": "embed",
        "input": [[1, 2, 3], "two"],
        "dimensions": 2,
    }
    assert "cache_salt" not in seen[0]  # left out, so the daemon's default applies
    assert out == Embeddings([[0.6, 0.8], [1.0, 0.0]], 2, "mean", 5)


# Against a real daemon, found through the default endpoint resolution.


@pytest.fixture(scope="module")
def daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory):
    daemon = start_daemon(tmp_path_factory.mktemp("client"), model=tiny_daemon_model, default_endpoint=True)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture
def client(daemon: DaemonProcess):
    with daemon.client() as client:
        yield client


def test_client_finds_the_daemon_at_the_default_endpoint(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("KVD_ENDPOINT", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(Path(daemon.endpoint.removeprefix("ipc://")).parent))
    with Client(timeout=5) as client:
        assert client.health() == {"status": "ready"}


def test_generate_stream_and_tokens_agree(client: Client):
    full = client.generate("The capital of France is", **GREEDY)
    assert (full.finish_reason, full.usage.completion_tokens, len(full.token_ids)) == ("length", 12, 12)
    assert full.usage.prompt_tokens == len(client.tokenize("The capital of France is"))
    assert client.detokenize(full.token_ids) == full.text
    chunks = list(client.stream("The capital of France is", **GREEDY))
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].usage == full.usage or chunks[-1].usage.cached_tokens >= full.usage.cached_tokens
    by_ids = client.generate(client.tokenize("The capital of France is"), **GREEDY)
    assert by_ids.token_ids == full.token_ids


def test_chat_applies_the_template_and_streams(client: Client):
    messages = [{"role": "user", "content": "Say hi"}]
    reply = client.chat(messages, **GREEDY)
    assert (
        reply.usage.prompt_tokens == len(client.tokenize(messages=messages)) > len(client.tokenize("Say hi"))
    )
    streamed = list(client.stream_chat(messages, **GREEDY))
    assert "".join(c.text for c in streamed) == reply.text


def test_tokenize_lists_tools_as_chat_does(client: Client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    reply = client.chat(messages, tools=tools, **GREEDY)
    with_tools = client.tokenize(messages=messages, tools=tools)
    assert reply.usage.prompt_tokens == len(with_tools) > len(client.tokenize(messages=messages))
    with pytest.raises(BadRequestError, match="tools") as e:
        client.tokenize("Weather?", tools=tools)
    assert e.value.field == "tools"
    with pytest.raises(BadRequestError) as e:
        client.tokenize(messages=messages, tools=[{"type": "function"}])
    assert e.value.field.startswith("tools")


def test_the_final_reply_names_the_stop_string_that_ended_it(client: Client):
    free = client.generate("Hello", **GREEDY)
    stop = free.text[3:6]  # a piece of what greedy decoding writes: it stops there
    assert stop and stop not in free.text[:3]
    cut = client.generate("Hello", **GREEDY, stop=["never written", stop])
    assert cut.finish_reason == "stop" and cut.stop_string == stop and cut.text == free.text[:3]
    (final,) = [c for c in client.stream("Hello", **GREEDY, stop=[stop]) if c.finished]
    assert final.stop_string == stop
    assert (
        free.stop_string is None
        and client.generate("Hello", **GREEDY, stop=["never written"]).stop_string is None
    )


def test_logprobs_come_with_each_token(client: Client):
    reply = client.generate("Hello", temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    assert len(reply.logprobs) == 4
    for token_id, lp in zip(reply.token_ids, reply.logprobs, strict=True):
        assert lp.token_id == token_id and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token_id  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top_logprobs[0][1])


def test_cache_salt_keeps_prefix_caches_apart(client: Client):
    prompt = "A long system prompt that several requests share, " * 6  # several full KV blocks
    assert client.generate(prompt, max_tokens=1, cache_salt="tenant-a").usage.cached_tokens == 0
    assert client.generate(prompt, max_tokens=1, cache_salt="tenant-a").usage.cached_tokens >= 16
    assert client.generate(prompt, max_tokens=1, cache_salt="tenant-b").usage.cached_tokens == 0
    assert client.generate(prompt, max_tokens=1).usage.cached_tokens == 0


def test_abort_ends_a_stream_with_reason_abort(client: Client):
    stream = client.stream("Once upon a time", max_tokens=3000, ignore_eos=True)
    first = next(stream)
    assert not first.finished
    assert client.abort(stream.id) is True
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.completion_tokens < 3000
    assert client.abort(stream.id) is False  # no longer in flight
    assert client.stats()["num_running"] == 0


def test_closing_a_stream_early_aborts_it_in_the_daemon(client: Client):
    with client.stream("Once upon a time", max_tokens=3000, ignore_eos=True) as stream:
        next(stream)
    deadline = time.monotonic() + 5
    while client.stats()["kv_cache"]["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats()["kv_cache"]["used_blocks"] == 0


def test_interleaved_streams_on_one_client(client: Client):
    prompts = ["One", "Two", "Three"]
    expected = [client.generate(p, **GREEDY).text for p in prompts]
    streams = [client.stream(p, **GREEDY) for p in prompts]
    texts = ["", "", ""]
    while any(not s.done for s in streams):
        for i, s in enumerate(streams):
            for chunk in s:
                texts[i] += chunk.text
                break
    assert texts == expected


def test_error_replies_raise_typed_exceptions(client: Client):
    with pytest.raises(BadRequestError) as info:
        client.generate("hi", max_tokenz=3)
    assert info.value.field == "max_tokenz"
    with pytest.raises(BadRequestError) as info:
        client.generate("hi", temperature=-1)
    assert info.value.field == "temperature"
    limit = client.info()["limits"]["max_message_bytes"]
    with pytest.raises(TooLargeError):
        client.generate("x" * (limit + 10))
    assert client.health() == {"status": "ready"}  # the client is still connected after errors


def test_info_and_stats(client: Client):
    info = client.info()
    assert info["protocol_version"] == 1 and info["supported_versions"] == [1]
    assert info["dtype"] == "float32" and info["block_size"] == 16 and info["max_model_len"] > 1000
    assert info["limits"]["max_prompt_tokens"] == info["max_model_len"] - 1
    stats = client.stats()
    assert stats["kv_cache"]["total_blocks"] == info["num_blocks"]
    client.generate("count me", max_tokens=1)
    with pytest.raises(BadRequestError):
        client.generate("", max_tokens=1)
    after = client.stats()["daemon"]
    assert after["requests_total"] == stats["daemon"]["requests_total"] + 1
    assert after["requests_rejected"] == stats["daemon"]["requests_rejected"] + 1
    assert after["num_requests"] == 0


def test_embed_tool_calls_and_prompt_logprobs(client: Client):
    out = client.embed(["Hello world", "Bonjour"])
    assert len(out.embeddings) == 2 and out.pooling in ("mean", "last") and out.prompt_tokens > 2
    assert all(abs(sum(v * v for v in e) - 1) < 1e-4 and len(e) == out.dimensions for e in out.embeddings)
    ids = client.tokenize("Hello world")
    assert client.embed([ids]).embeddings[0] == pytest.approx(out.embeddings[0], abs=1e-5)
    assert client.embed(ids).embeddings == client.embed([ids]).embeddings  # one token id list: one input
    assert len(client.embed("Hello world", dimensions=8).embeddings[0]) == 8
    tool = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    params = dict(tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=60, seed=1)
    reply = client.chat([{"role": "user", "content": "Weather?"}], **params)
    (call,) = reply.tool_calls
    assert reply.finish_reason == "tool_calls" and call.name == "weather" and call.id.startswith("call_")
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    *_, last = client.stream_chat([{"role": "user", "content": "Weather?"}], **params)
    assert [(c.name, c.arguments) for c in last.tool_calls] == [(call.name, call.arguments)]  # the same seed
    scored = client.generate("Hello world", max_tokens=1, prompt_logprobs=2)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    assert [lp.token_id for lp in scored.prompt_logprobs[1:]] == ids[1:]
    assert all(len(lp.top_logprobs) == 2 for lp in scored.prompt_logprobs[1:])


def test_async_client_runs_concurrent_requests(client: Client, daemon: DaemonProcess):
    prompts = ["Alpha", "Beta", "Gamma", "Delta"]
    expected = [client.generate(p, **GREEDY).text for p in prompts]

    async def streamed(ac: AsyncClient, prompt: str) -> str:
        return "".join([chunk.text async for chunk in ac.stream(prompt, **GREEDY)])

    async def main() -> tuple[list[str], list[str], dict]:
        async with AsyncClient(daemon.endpoint, timeout=30) as ac:
            whole = await asyncio.gather(*(ac.generate(p, **GREEDY) for p in prompts))
            streams = await asyncio.gather(*(streamed(ac, p) for p in prompts))
            with pytest.raises(BadRequestError):
                await ac.generate("hi", bogus=1)
            return [c.text for c in whole], streams, await ac.health()

    whole, streams, health = asyncio.run(main())
    assert whole == expected and streams == expected and health == {"status": "ready"}


def test_a_daemon_on_ipv6_loopback_serves_both_clients_and_publishes_events(
    client: Client, tiny_daemon_model: Path, tmp_path: Path
):
    ipv6_loopback_or_refusal()
    events = f"tcp://[::1]:{free_tcp_port('[::1]')}"
    with tcp_daemon(tmp_path, tiny_daemon_model, "[::1]", "--events", events) as daemon:
        subscriber = zmq.Context.instance().socket(zmq.SUB)
        subscriber.setsockopt(zmq.IPV6, 1)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"tcp/")
        subscriber.connect(events)
        time.sleep(0.3)  # the subscription reaches the publisher asynchronously
        with daemon.client() as over_ipv6:
            whole = over_ipv6.generate("The capital of France is", **GREEDY)

        async def streamed() -> str:
            async with AsyncClient(daemon.endpoint, timeout=30) as ac:
                return "".join([c.text async for c in ac.stream("The capital of France is", **GREEDY)])

        text = asyncio.run(streamed())
        assert subscriber.poll(10_000), "no event reached a subscriber over IPv6"
        topic, body = subscriber.recv_multipart()
        subscriber.close()
    assert topic.startswith(b"tcp/") and msgpack.unpackb(body)["event"] == "queued"
    assert whole.text == text == client.generate("The capital of France is", **GREEDY).text


def _kvd(daemon: DaemonProcess, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvd.cli", *args, "--endpoint", daemon.endpoint, "--timeout", "20"]
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=60, check=True
    )


def test_cli_generate_tokenize_stats_and_chat(client: Client, daemon: DaemonProcess):
    flags = ["--max-tokens", "12", "--temperature", "0"]
    out = _kvd(daemon, "generate", "The capital of France is", *flags).stdout
    assert out == client.generate("The capital of France is", temperature=0.0, max_tokens=12).text + "\n"
    assert _kvd(daemon, "tokenize", "Hello world").stdout.split() == [
        str(t) for t in client.tokenize("Hello world")
    ]
    stats = _kvd(daemon, "stats").stdout
    assert "KV cache" in stats and "prefix cache" in stats and "tokens/s" in stats
    first = client.chat([{"role": "user", "content": "Hi"}], temperature=0.0, max_tokens=12)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "More"},
    ]
    second = client.chat(history, temperature=0.0, max_tokens=12)
    out = _kvd(daemon, "chat", *flags, stdin="Hi\nMore\n/exit\n").stdout
    assert out == f"> {first.text}\n> {second.text}\n> "  # the second turn saw the first (history)


def test_cli_reports_a_missing_daemon(tmp_path: Path):
    cmd = [
        sys.executable,
        "-m",
        "kvd.cli",
        "stats",
        "--endpoint",
        f"ipc://{tmp_path}/none.sock",
        "--timeout",
        "0.3",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=30)
    assert result.returncode == 1 and "the socket file does not exist" in result.stderr
    assert "--endpoint or $KVD_ENDPOINT" in result.stderr
    cmd[cmd.index("--endpoint") + 1] = stale_socket(tmp_path / "stale.sock")
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=30)
    assert result.returncode == 1 and "is `kvd serve` running" in result.stderr

"""The daemon end to end: real `kvd serve` processes, real sockets, real clients in many processes."""

from __future__ import annotations

import grp
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from daemon_fixtures import REPO, DaemonProcess, daemon_env, raw_socket, recv_reply, start_daemon

from kvd.request.sampling_params import SamplingParams
from kvd.server.config import ServerConfig
from kvd.server.listener import ListenError, check_endpoint
from kvd.server.outbox import Outbox
from kvd.server.sessions import ClientSession, Generation, Sessions
from kvd_client import (
    BadRequestError,
    Client,
    NoDaemonError,
    NotFoundError,
    OverloadedError,
    TooLargeError,
)
from kvd_client.endpoint import parse_endpoint

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "Ünïcödé and emoji 🦊 survive the round trip:",
    "Hello",
]
GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


def wait_until(condition, timeout: float, interval: float = 0.05) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def kv_idle(client: Client) -> bool:
    stats = client.stats()
    return stats["kv_cache"]["used_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def in_process_llm(model: Path | None, kv_cache_memory: int):
    """kvd.LLM with the daemon fixtures' settings (one thread: same float reduction order as the daemon)."""
    from kvd import LLM

    return LLM(str(model) if model else None, dtype="float32", kv_cache_memory=kv_cache_memory, num_threads=1)


@pytest.fixture(scope="module")
def tiny_llm(tiny_daemon_model: Path):
    import torch

    threads = torch.get_num_threads()
    yield in_process_llm(tiny_daemon_model, 64 << 20)
    torch.set_num_threads(threads)  # the engine set it process-wide


# Greedy parity with the in-process engine.


def test_greedy_output_matches_in_process_generate(tiny_daemon: DaemonProcess, tiny_llm):
    expected = tiny_llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    with tiny_daemon.client() as client:
        streams = [client.stream(p, **GREEDY) for p in PROMPTS]  # all in flight at once, batched together
        chunks = [list(s) for s in streams]
    for want, got in zip(expected, chunks, strict=True):
        assert [t for c in got for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in got) == want.text
        assert got[-1].finish_reason == "length"
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    want = tiny_llm.chat([messages], SamplingParams(**GREEDY), use_tqdm=False)[0]
    with tiny_daemon.client() as client:
        got = client.chat(messages, **GREEDY)
    assert (got.token_ids, got.text) == (want.token_ids, want.text)


def test_smollm2_greedy_output_matches_in_process_generate(tmp_path: Path):
    import torch

    prompt = "The capital of France is"
    threads = torch.get_num_threads()
    llm = in_process_llm(None, 128 << 20)
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    del llm
    torch.set_num_threads(threads)
    daemon = start_daemon(tmp_path, kv_cache_memory="128M")
    try:
        with daemon.client() as client:
            got = client.generate(prompt, temperature=0.0, max_tokens=12)
            assert client.info()["model"].startswith("SmolLM2")
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    assert "ready on" in daemon.log() and "SmolLM2" in daemon.log()  # the startup line


# Many clients, many processes.

CLIENT_PROCESS = """
import json, os, sys, time
from kvd_client import Client
endpoint, prompt, go = sys.argv[1:]
while not os.path.exists(go):
    time.sleep(0.002)
with Client(endpoint, timeout=60) as client:
    chunks = list(client.stream(prompt, temperature=0.0, max_tokens=24, ignore_eos=True))
token_ids = [t for c in chunks for t in c.token_ids]
text = "".join(c.text for c in chunks)
print(json.dumps({"token_ids": token_ids, "text": text, "num_chunks": len(chunks),
                  "finish_reason": chunks[-1].finish_reason}))
"""


def test_sixteen_client_processes_stream_at_once(tiny_daemon: DaemonProcess, tmp_path: Path):
    prompts = [f"Request number {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(16)]
    with tiny_daemon.client() as client:
        alone = [client.generate(p, **GREEDY) for p in prompts]  # one at a time: the single-client outputs
        steps_before = client.stats()["num_steps"]
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT_PROCESS, tiny_daemon.endpoint, p, str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in prompts
    ]
    time.sleep(0.5)
    go.touch()  # every process sends at (nearly) the same moment
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for want, got in zip(alone, results, strict=True):
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (want.token_ids, want.text, "length")
        assert got["num_chunks"] > 1
    with tiny_daemon.client() as client:
        steps = client.stats()["num_steps"] - steps_before
        assert kv_idle(client)
    # 16 x 24 tokens one by one would take 384 steps: the clients' requests shared batches.
    assert steps < 16 * 24 // 2


def test_two_clients_may_use_the_same_request_id(tiny_daemon: DaemonProcess):
    with tiny_daemon.client() as client:
        expected = [client.generate(p, **GREEDY).text for p in PROMPTS[:2]]
    socks = [raw_socket(tiny_daemon.endpoint) for _ in range(2)]
    for sock, prompt in zip(socks, PROMPTS, strict=False):
        sock.send(msgpack.packb({"v": 1, "id": 1, "op": "generate", "prompt": prompt, **GREEDY}))
    replies = [recv_reply(s) for s in socks]
    assert [r["text"] for r in replies] == expected and [r["id"] for r in replies] == [1, 1]
    for s in socks:
        s.close()


# Clients that go away.

KILLED_CLIENT = """
import sys, time
from kvd_client import Client
endpoint, stream = sys.argv[1], sys.argv[2] == "stream"
client = Client(endpoint)
if stream:
    next(iter(client.stream("Once upon a time", max_tokens=3000, ignore_eos=True)))
else:
    client._start("generate", {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True})
print("started", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["stream", "generate"])
def test_a_killed_client_has_its_blocks_freed(tiny_daemon: DaemonProcess, mode: str):
    with tiny_daemon.client() as client:
        lost_before = client.stats()["daemon"]["clients_lost"]
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_CLIENT, tiny_daemon.endpoint, mode], stdout=subprocess.PIPE
        )
        assert proc.stdout.readline() == b"started\n"
        wait_until(lambda: client.stats()["num_running"] == 1, timeout=10)
        assert client.stats()["kv_cache"]["used_blocks"] > 0
        proc.kill()
        proc.wait()
        # A 3000-token generation takes far longer: the daemon noticed the client was gone (the stream's next
        # chunk, or for a non-streaming request the next heartbeat, fails with EHOSTUNREACH).
        assert wait_until(lambda: kv_idle(client), timeout=3.0) < 3.0
        assert client.stats()["daemon"]["clients_lost"] == lost_before + 1


def test_outbox_holds_replies_for_a_slow_reader_then_gives_up(tmp_path: Path):
    """The stopped-reader path on real sockets with tiny buffers (a daemon's would take ~10^4 tokens)."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 2)
    router.bind(f"ipc://{tmp_path}/o.sock")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 2)
    dealer.connect(f"ipc://{tmp_path}/o.sock")
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()
    sessions = Sessions()
    session = sessions.open(identity)
    session.requests[1] = Generation(1, stream=True, num_prompt_tokens=1)
    lost: list[str] = []

    def on_lost(session: ClientSession, why: str, timed_out: bool) -> None:
        lost.append(f"{why} (timed out)" if timed_out else why)
        sessions.remove(session)  # as the daemon does, after aborting the session's requests

    outbox = Outbox(router, sessions, client_timeout=0.5, on_lost=on_lost)
    big = {"id": 1, "type": "chunk", "text": "x" * 200_000, "token_ids": []}
    for _ in range(200):
        outbox.send(identity, big)
        if session.backlog:
            break
    assert session.backlog and not lost  # full: held, not dropped
    held = len(session.backlog)
    received = 0
    deadline = time.monotonic() + 10
    while (session.backlog or dealer.poll(100)) and time.monotonic() < deadline:  # the client reads again
        while dealer.poll(0):
            dealer.recv()
            received += 1
        outbox.service()
        time.sleep(0.005)
    assert not session.backlog and not lost and received >= held  # everything held arrived
    while not session.backlog:
        outbox.send(identity, big)
    outbox.send(identity, big)
    # The client stops reading: once the socket buffers are full, nothing moves for 0.5 s, and it is dropped.
    assert wait_until(lambda: (outbox.service(), lost)[1], timeout=5, interval=0.1) >= 0.5
    assert lost == ["read nothing for 0.5 s (timed out)"] and sessions.get(identity) is None
    # A client that closes its socket: the next send finds its routing id gone.
    gone = ctx.socket(zmq.DEALER)
    gone.connect(f"ipc://{tmp_path}/o.sock")
    gone.send(b"hello")
    identity, _ = router.recv_multipart()
    sessions.open(identity).requests[2] = Generation(2, stream=True, num_prompt_tokens=1)
    gone.close(linger=0)
    wait_until(lambda: (outbox.send(identity, {"id": 2, "type": "heartbeat"}), lost[1:])[1], timeout=5)
    assert lost[1] == "disconnected" and sessions.get(identity) is None
    dealer.close(linger=0)
    router.close(linger=0)


def test_health_is_answered_while_a_long_prompt_is_tokenized(tiny_daemon: DaemonProcess):
    """Tokenizing runs beside the loop: health from another client comes back before the long prompt's reply."""
    limit = tiny_daemon.client().info()["limits"]
    text = " ".join(f"w{i}" for i in range(40_000))  # ~270 KB: under the byte bound, far over the token limit
    assert len(text) < limit["max_prompt_bytes"]
    long_sock, health_sock = raw_socket(tiny_daemon.endpoint), raw_socket(tiny_daemon.endpoint)
    try:
        long_sock.send(msgpack.packb({"v": 1, "id": 1, "op": "generate", "prompt": text}))
        time.sleep(0.1)  # the long prompt is in the daemon's hands first
        health_sock.send(msgpack.packb({"v": 1, "id": 2, "op": "health"}))
        assert recv_reply(health_sock)["status"] == "ready"
        assert not long_sock.poll(0), (
            "the long prompt was answered before health: tokenizing blocked the loop"
        )
        reply = recv_reply(long_sock, timeout=30)
        assert reply["code"] == "too_large" and f"limit is {limit['max_prompt_tokens']}" in reply["message"]
    finally:
        long_sock.close()
        health_sock.close()


def test_a_client_that_reads_again_after_its_timeout_learns_its_requests_were_aborted(
    tiny_daemon: DaemonProcess,
):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 2048)
    sock.connect(tiny_daemon.endpoint)
    # Large chunks (20 logprobs each), long generations: the socket's buffers fill within seconds.
    request = {
        "v": 1,
        "op": "generate",
        "prompt": "Go",
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    for rid in range(4):
        sock.send(msgpack.packb({**request, "id": rid, "logprobs": 20}))
    with tiny_daemon.client() as observer:
        lost = observer.stats()["daemon"]["clients_lost"]
        wait_until(lambda: observer.stats()["daemon"]["clients_lost"] > lost, timeout=120, interval=0.5)
    replies = []
    while (reply := recv_reply(sock, timeout=3)) is not None:
        replies.append(reply)
    sock.close()
    ends = [r for r in replies if r["type"] in ("final", "error")]
    assert sorted(r["id"] for r in ends) == [0, 1, 2, 3]
    assert all(r["type"] == "error" and r["code"] == "client_timeout" for r in ends), ends
    assert all(r["type"] == "chunk" for r in replies[: -len(ends)])  # the errors come after every chunk


# Limits and error replies.


@pytest.fixture(scope="module")
def limited(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory):
    group = grp.getgrgid(os.getgid()).gr_name
    args = ["--max-queued-per-client", "3", "--max-queued", "5", "--max-prompt-tokens", "32"]
    args += ["--max-message-bytes", "4096", "--socket-group", group]
    daemon = start_daemon(tmp_path_factory.mktemp("limited"), *args, model=tiny_daemon_model)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def test_socket_files_are_private_or_group_readable(tiny_daemon: DaemonProcess, limited: DaemonProcess):
    private = os.stat(parse_endpoint(tiny_daemon.endpoint).path)
    assert stat.S_ISSOCK(private.st_mode) and stat.S_IMODE(private.st_mode) == 0o600
    shared = os.stat(parse_endpoint(limited.endpoint).path)
    assert stat.S_IMODE(shared.st_mode) == 0o660 and shared.st_gid == os.getgid()


def test_queue_limits_answer_overloaded_at_once(limited: DaemonProcess):
    long = {"max_tokens": 3000, "ignore_eos": True}
    with limited.client() as a, limited.client() as b, limited.client() as c:
        streams = [a.stream("One", **long) for _ in range(3)]
        for s in streams:
            next(s)
        with pytest.raises(OverloadedError, match="max-queued-per-client"):
            a.generate("a fourth")
        more = [b.stream("Two", **long) for _ in range(2)]
        for s in more:
            next(s)
        with pytest.raises(OverloadedError, match="--max-queued"):
            c.generate("a sixth")
        for s in streams + more:
            s.close()
        wait_until(lambda: kv_idle(c), timeout=5)
        assert c.generate("now there is room", max_tokens=2).finish_reason == "length"


def test_size_limits_answer_too_large(limited: DaemonProcess):
    with limited.client() as client:
        with pytest.raises(TooLargeError, match="limit is 32") as info:
            client.generate(" ".join(["word"] * 40))
        assert info.value.field == "prompt"
        with pytest.raises(TooLargeError, match="at most 4096"):
            client.generate("x" * 5000)
        # More bytes than 32 tokens of this vocabulary can cover: refused before tokenizing.
        bound = client.info()["limits"]["max_prompt_bytes"]
        assert 32 * 16 < bound < 4000
        with pytest.raises(TooLargeError, match="bytes") as info:
            client.chat([{"role": "user", "content": "y" * (bound + 1)}])
        assert info.value.field == "messages"
        # An embed request's inputs are prompts each: the byte bound names the one past it.
        with pytest.raises(TooLargeError, match="bytes") as info:
            client.embed(["short", "z" * (bound + 1)])
        assert info.value.field == "input[1]"
        assert client.generate("short", max_tokens=1).usage.completion_tokens == 1
    # Beyond ZMQ_MAXMSGSIZE libzmq drops the message and the connection: no reply, and nobody else notices.
    sock = raw_socket(limited.endpoint)
    sock.send(msgpack.packb({"v": 1, "id": 1, "op": "generate", "prompt": "x" * 100_000}))
    assert recv_reply(sock, timeout=1.0) is None
    sock.close()
    with limited.client() as client:
        assert client.health() == {"status": "ready"}


def test_protocol_errors_are_replies(limited: DaemonProcess):
    sock = raw_socket(limited.endpoint)

    def ask(message: object, *frames: bytes) -> dict:
        sock.send_multipart([*frames, msgpack.packb(message)])
        return recv_reply(sock)

    assert ask({"v": 2, "id": 1, "op": "health"})["code"] == "unsupported_version"
    assert ask({"v": 1, "id": 2, "op": "health"}, b"")["code"] == "bad_request"  # a REQ-style envelope
    reply = ask({"v": 1, "id": 3, "op": "abort", "target": 99})
    assert (reply["id"], reply["code"], reply["field"]) == (3, "not_found", "target")
    assert (
        ask({"v": 1, "id": 4, "op": "generate", "prompt": "Hi", "stream": True, "max_tokens": 3000})["type"]
        == "chunk"
    )
    reply = ask({"v": 1, "id": 4, "op": "generate", "prompt": "again"})
    while reply["id"] == 4 and reply["type"] == "chunk":
        reply = recv_reply(sock)
    assert (reply["id"], reply["code"], reply["field"]) == (4, "bad_request", "id")  # already in flight
    sock.send(msgpack.packb({"v": 1, "id": 5, "op": "abort", "target": 4}))
    replies = []
    while len(replies) < 2:
        reply = recv_reply(sock)
        if reply["type"] != "chunk":
            replies.append(reply)
    assert (replies[0]["id"], replies[0]["finish_reason"]) == (4, "abort")
    assert replies[1] == {"id": 5, "type": "result", "aborted": True}
    sock.close()
    with limited.client() as client:
        with pytest.raises(NotFoundError):
            client._call("abort", {"target": 4})
        with pytest.raises(BadRequestError) as info:
            client.tokenize()
        assert info.value.field == "text"


def test_msgpack_that_strict_reading_refuses_is_answered_with_its_id_and_field(tiny_daemon: DaemonProcess):
    """Python packs {2: -100} with an integer key; a C or JavaScript client can send bytes that are no UTF-8. The
    reply must reach the request that sent it (a reply without its id leaves that client waiting)."""
    sock = raw_socket(tiny_daemon.endpoint)

    def ask(frame: bytes) -> tuple:
        sock.send(frame)
        reply = recv_reply(sock)
        return reply["id"], reply["code"], reply["field"]

    bias = {"v": 1, "id": 1, "op": "generate", "prompt": "Hi", "logit_bias": {2: -100.0}}
    assert ask(msgpack.packb(bias)) == (1, "bad_request", "logit_bias")
    text = {"v": 1, "id": "two", "op": "chat", "messages": [{"role": "user", "content": "XXXX"}]}
    frame = msgpack.packb(text).replace(b"XXXX", b"\xff\xfe\xfd\xfc")
    assert ask(frame) == ("two", "bad_request", "messages[0].content")
    properties = {f"p{i}": {"type": "integer"} for i in range(600)}
    schema = {"v": 1, "id": 3, "op": "generate", "prompt": "Hi", "json_schema": {"properties": properties}}
    assert ask(msgpack.packb(schema)) == (3, "bad_request", "json_schema.properties")
    sock.close()
    with tiny_daemon.client() as client:
        banned = client.generate("Hi", max_tokens=1, temperature=0).token_ids[0]
        # The client sends integer keys as the decimal strings the protocol takes.
        assert client.generate("Hi", max_tokens=1, temperature=0, logit_bias={banned: -100}).token_ids != [
            banned
        ]
        for fields, field in [
            ({"seed": 2**64}, "seed"),
            ({"stop": ["ok", "\ud800"]}, "stop[1]"),
            ({"stop": {"a"}}, "stop"),
        ]:
            with pytest.raises(BadRequestError) as info:
                client.generate("Hi", **fields)
            assert info.value.field == field
        with pytest.raises(BadRequestError) as info:
            client.chat([{"role": "user", "content": "\udc80"}])
        assert info.value.field == "messages[0].content"


def test_nil_content_is_refused_by_chat_and_tokenize_alike(tiny_daemon: DaemonProcess):
    """Nil content only in an assistant turn that calls tools (docs/protocol.md); tokenize renders the prompt chat
    would see, so it refuses what chat refuses instead of rendering nil as empty."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with tiny_daemon.client() as client:
        ops = [lambda m: client.chat(m, max_tokens=1), lambda m: client.tokenize(messages=m)]
        for role, extra in [("system", {}), ("user", {}), ("tool", {"tool_call_id": "c1"})]:
            messages = [{"role": "user", "content": "Hi"}, {"role": role, "content": None, **extra}]
            for op in ops:
                with pytest.raises(BadRequestError) as info:
                    op(messages)
                assert info.value.field == "messages[1].content", (role, info.value)
        history = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        prompt = client.tokenize(messages=history)
        assert len(prompt) == client.chat(history, max_tokens=1).usage.prompt_tokens


# Startup: where the daemon refuses to listen (fast: it checks before loading the model).


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvd.cli", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=60)


def test_startup_refusals(tiny_daemon: DaemonProcess, tmp_path: Path):
    result = _serve("--listen", "tcp://0.0.0.0:47123")
    assert result.returncode == 2 and "--allow-remote" in result.stderr
    result = _serve("--listen", tiny_daemon.endpoint)
    assert result.returncode == 2 and "already listens" in result.stderr
    (tmp_path / "file.sock").write_text("not a socket")
    result = _serve("--listen", f"ipc://{tmp_path}/file.sock")
    assert result.returncode == 2 and "not a socket" in result.stderr
    result = _serve("--listen", "tcp://127.0.0.1:47123", "--socket-group", "root")
    assert result.returncode == 2 and "ipc" in result.stderr
    result = _serve("--listen", f"ipc://{tmp_path}/missing/kvd.sock")
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_stale_sockets_are_replaced_and_the_default_directory_is_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening, then closed: what a killed daemon leaves
    check_endpoint(parse_endpoint(f"ipc://{path}"), ServerConfig())
    assert not path.exists()
    # Without XDG_RUNTIME_DIR the default directory is created 0700, and refused when others can enter it.
    private = tmp_path / "kvd-test"
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("kvd.server.listener.default_socket_dir", lambda: private)
    check_endpoint(parse_endpoint(f"ipc://{private}/kvd.sock"), ServerConfig())
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    os.chmod(private, 0o755)
    with pytest.raises(ListenError, match="chmod 700"):
        check_endpoint(parse_endpoint(f"ipc://{private}/kvd.sock"), ServerConfig())


# Shutdown.


def test_sigterm_drains_then_aborts_what_is_left_and_exits_0(tiny_daemon_model: Path, tmp_path: Path):
    daemon = start_daemon(tmp_path, "--drain-timeout", "3", model=tiny_daemon_model)
    with daemon.client() as client, daemon.client() as other:
        short = client.stream("Short", max_tokens=20, ignore_eos=True)
        endless = client.stream("Endless", max_tokens=4000, ignore_eos=True)
        next(short), next(endless)
        daemon.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: other.health()["status"] == "draining", timeout=5)
        started = time.monotonic()
        with pytest.raises(Exception, match="shutting down") as info:
            other.generate("too late")
        assert info.value.code == "shutting_down"
        assert other.tokenize("still answered")  # only new generations are refused
        assert list(short)[-1].finish_reason == "length"  # finished within the drain
        last = list(endless)[-1]
        assert last.finish_reason == "abort" and last.usage.completion_tokens < 4000
        assert 2.0 < time.monotonic() - started < 6.0
        assert daemon.proc.wait(10) == 0, daemon.log()
        with pytest.raises(NoDaemonError):  # a stopped daemon is an error for the client at once, not a hang
            Client(daemon.endpoint, timeout=30).health()
    assert not parse_endpoint(daemon.endpoint).path.exists()
    assert "draining" in daemon.log()

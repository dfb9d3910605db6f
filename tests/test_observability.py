"""stats per client, the event stream (--events) and `kvd top --once`, on a daemon whose small KV pool forces
preemptions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from daemon_fixtures import REPO, DaemonProcess, daemon_env, start_daemon

from kvd.cli import main

# 32 blocks of 16 tokens: four requests of 210 tokens cannot all hold their KV at once.
SMALL_KV = "256K"
LONG = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}
TENANT = f"uid:{os.getuid()}"


@pytest.fixture(scope="module")
def daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    workdir = tmp_path_factory.mktemp("observed")
    daemon = start_daemon(
        workdir, "--events", f"ipc://{workdir}/events.sock", model=tiny_daemon_model, kv_cache_memory=SMALL_KV
    )
    daemon.events_endpoint = f"ipc://{workdir}/events.sock"
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def subscriber(endpoint: str, topic: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoint)
    return sock


def drain_events(sock: zmq.Socket, until_finished: int, timeout: float = 60) -> list[tuple[str, dict]]:
    events, finished = [], 0
    deadline = time.monotonic() + timeout
    while finished < until_finished:
        assert time.monotonic() < deadline, events
        if sock.poll(1000):
            topic, body = sock.recv_multipart()
            event = msgpack.unpackb(body)
            events.append((topic.decode(), event))
            finished += event["event"] == "finished"
    return events


def test_stats_events_and_top_while_requests_compete_for_kv(daemon: DaemonProcess, capsys):
    mine = subscriber(daemon.events_endpoint, TENANT + "/")
    others = subscriber(daemon.events_endpoint, "tcp/")
    time.sleep(0.3)  # subscriptions reach the publisher asynchronously
    try:
        with daemon.client() as client, daemon.client() as observer:
            streams = [client.stream(f"request {i} says", **LONG) for i in range(4)]
            firsts = [next(iter(s)) for s in streams]  # every request is under way
            stats = observer.stats()
            assert main(["top", "--once", "--endpoint", daemon.endpoint]) == 0
            outputs = [list(s) for s in streams]
        events = drain_events(mine, until_finished=4)
        assert not others.poll(200), "events of uid tenants reached a subscriber of tcp/"
        after = observer_stats(daemon)
    finally:
        mine.close()
        others.close()

    # stats while the four were in flight: one client, its requests, its KV blocks.
    (entry,) = stats["daemon"]["clients"]
    assert entry["tenant"] == TENANT and entry["requests"] == 4
    assert entry["queued"] + entry["in_engine"] == 4 and entry["kv_blocks"] > 0
    assert stats["daemon"]["num_queued"] == entry["queued"]
    assert {"num_preemptions", "generation_tokens_per_s_1m", "kv_cache", "prefix_cache"} <= set(stats)

    screen = capsys.readouterr().out
    assert "KV cache" in screen and "tokens/s" in screen and TENANT in screen

    # Every request: queued, scheduled, (preempted, ...) finished, in that order, under this user's topic.
    assert all(topic.startswith(TENANT + "/") for topic, _ in events)
    ids = {e["id"] for _, e in events}
    assert len(ids) == 4
    for rid in ids:
        kinds = [e["event"] for _, e in events if e["id"] == rid]
        assert kinds[:2] == ["queued", "scheduled"] and kinds[-1] == "finished", kinds
        assert set(kinds[2:-1]) <= {"preempted"}
        final = next(e for _, e in events if e["id"] == rid and e["event"] == "finished")
        assert final["finish_reason"] == "length" and final["completion_tokens"] == LONG["max_tokens"]
        assert final["preemptions"] == kinds.count("preempted")
    preempted = sum(e["event"] == "preempted" for _, e in events)
    assert preempted > 0 and after["num_preemptions"] >= preempted
    lengths = [
        len(f.token_ids) + sum(len(c.token_ids) for c in o) for f, o in zip(firsts, outputs, strict=True)
    ]
    assert lengths == [LONG["max_tokens"]] * 4
    assert after["daemon"]["clients"] == [] and after["daemon"]["num_queued"] == 0
    assert after["generation_tokens_per_s_1m"] > 0


def observer_stats(daemon: DaemonProcess) -> dict:
    with daemon.client() as client:
        return client.stats()


def test_the_example_apps_share_one_daemon(daemon: DaemonProcess):
    env = daemon_env() | {"KVD_ENDPOINT": daemon.endpoint}
    apps = [
        subprocess.Popen(
            [sys.executable, str(REPO / "examples" / script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for script, args in [("batch_worker.py", ("alpha", "4")), ("chat_app.py", ())]
    ]
    outputs = [app.communicate(timeout=120)[0] for app in apps]
    assert [app.returncode for app in apps] == [0, 0], outputs
    assert "[alpha] 4 completions" in outputs[0]
    assert outputs[1].count("first token after") == 3


def test_preemptions_counted_once_each_in_stats_and_events(daemon: DaemonProcess):
    """Sixteen short requests overflow the 32-block pool: victims are often re-admitted within the same step
    (their blocks are still cached), and each such preemption must still be counted everywhere alike."""
    sub = subscriber(daemon.events_endpoint, TENANT + "/")
    time.sleep(0.3)
    try:
        before = observer_stats(daemon)["num_preemptions"]
        with daemon.client() as client:
            params = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
            streams = [
                client.stream(f"Tell me about the city number {i} and its rivers.", **params)
                for i in range(16)
            ]
            for s in streams:
                list(s)
        events = [e for _, e in drain_events(sub, until_finished=16)]
        after = observer_stats(daemon)["num_preemptions"]
    finally:
        sub.close()
    preempted = sum(e["event"] == "preempted" for e in events)
    per_request = sum(e["preemptions"] for e in events if e["event"] == "finished")
    assert preempted > 0
    assert after - before == preempted == per_request

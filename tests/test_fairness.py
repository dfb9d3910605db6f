"""Fair admission and per-client quotas: a flooding client cannot push another client's request back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from daemon_fixtures import DaemonProcess, raw_socket, start_daemon

from kvd.server.daemon import IDLE_POLL_MS
from kvd.server.fairness import FairQueue
from kvd.server.sessions import ClientSession, Generation

MAX_NUM_SEQS = 4
RUNNING_CAP = 3
BLOCK_CAP = 10  # blocks of 16 tokens; the flood's short requests stay far below it
# Long enough that the rounds of a batch are many engine steps apart, so arrival order shows the rounds.
FLOOD = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = start_daemon(
        tmp_path_factory.mktemp("fair"),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-running-per-client",
        str(RUNNING_CAP),
        "--max-blocks-per-client",
        str(BLOCK_CAP),
        model=tiny_daemon_model,
    )
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def send_generate(sock: zmq.Socket, request_id: int, prompt: str) -> None:
    sock.send(msgpack.packb({"v": 1, "id": request_id, "op": "generate", "prompt": prompt, **FLOOD}))


def max_concurrent(events: list[tuple], client: str) -> int:
    """The most requests of `client` between their first chunk and their final at any point."""
    running = most = 0
    for who, kind, *_ in events:
        if who == client:
            running += 1 if kind == "first" else -1
            most = max(most, running)
    return most


def record_events(sockets: dict[str, zmq.Socket], expected_finals: int, timeout: float = 60) -> list[tuple]:
    """(client, "first" or "final", request id, time.monotonic()) in arrival order, until `expected_finals` finals
    came."""
    poller = zmq.Poller()
    for sock in sockets.values():
        poller.register(sock, zmq.POLLIN)
    names = {sock: name for name, sock in sockets.items()}
    events, started, finals = [], set(), 0
    deadline = time.monotonic() + timeout
    while finals < expected_finals:
        assert time.monotonic() < deadline, f"only {finals} of {expected_finals} requests finished: {events}"
        for sock, _ in poller.poll(1000):
            while sock.poll(0):
                reply = msgpack.unpackb(sock.recv())
                key = (names[sock], reply["id"])
                assert reply["type"] in ("chunk", "final", "heartbeat"), reply
                if reply["type"] != "heartbeat" and key not in started:
                    started.add(key)
                    events.append((names[sock], "first", reply["id"], time.monotonic()))
                if reply["type"] == "final":
                    finals += 1
                    events.append((names[sock], "final", reply["id"], time.monotonic()))
    return events


def test_a_flooding_client_does_not_delay_a_single_request_beyond_one_round(daemon: DaemonProcess):
    flood_a, flood_b, single = (raw_socket(daemon.endpoint) for _ in range(3))
    try:
        for i in range(20):
            send_generate(flood_a, i, f"flood a {i}")
        for i in range(20):
            send_generate(flood_b, i, f"flood b {i}")
        with daemon.client() as client:  # both floods are queued in the daemon before the single request
            deadline = time.monotonic() + 30
            while client.stats()["daemon"]["num_requests"] < 40:
                assert time.monotonic() < deadline
        send_generate(single, 0, "just one")
        events = record_events({"a": flood_a, "b": flood_b, "single": single}, expected_finals=41)
    finally:
        for sock in (flood_a, flood_b, single):
            sock.close()
    firsts = [client for client, kind, *_ in events if kind == "first"]
    # One round admits at most MAX_NUM_SEQS requests: the single one starts within the second round, not after
    # the 40 queued before it (first-come-first-served would put it last).
    assert firsts.index("single") < 2 * MAX_NUM_SEQS, firsts
    # The per-client cap held throughout: never more than RUNNING_CAP of one client's requests at once.
    assert max(max_concurrent(events, "a"), max_concurrent(events, "b")) <= RUNNING_CAP, events


def test_a_client_alone_runs_at_most_its_cap_although_the_engine_has_room(daemon: DaemonProcess):
    sock = raw_socket(daemon.endpoint)
    try:
        for i in range(2 * RUNNING_CAP):
            send_generate(sock, i, f"alone {i}")
        events = record_events({"alone": sock}, expected_finals=2 * RUNNING_CAP)
    finally:
        sock.close()
    assert RUNNING_CAP < MAX_NUM_SEQS and max_concurrent(events, "alone") == RUNNING_CAP, events


def test_a_client_at_its_kv_block_cap_waits_for_its_own_requests(daemon: DaemonProcess):
    prompts = [f"long prompt {i}: " + " ".join(f"word{j}" for j in range(35)) for i in range(3)]
    with daemon.client() as client:
        blocks = [-(-len(client.tokenize(p)) // 16) for p in prompts]
    assert all(BLOCK_CAP / 2 < b <= BLOCK_CAP for b in blocks), blocks  # one fits under the cap, two do not
    sock = raw_socket(daemon.endpoint)
    try:
        for i, prompt in enumerate(prompts):
            send_generate(sock, i, prompt)
        events = record_events({"long": sock}, expected_finals=3)
    finally:
        sock.close()
    assert max_concurrent(events, "long") == 1, events
    # Each next request starts in the loop turn that freed its room, not after the daemon's idle poll.
    kinds = [kind for _, kind, *_ in events]
    assert kinds == ["first", "final"] * 3, events
    gaps = [events[i + 1][3] - events[i][3] for i in (1, 3)]
    assert max(gaps) < IDLE_POLL_MS / 1000 / 2, gaps


def test_the_fair_queue_takes_turns_and_skips_clients_at_their_cap():
    def pending(session: ClientSession, i: int) -> Generation:
        generation = Generation(i, False, 1, prompt_token_ids=[1], prompt_field="prompt")
        session.requests[i] = generation
        return generation

    queue = FairQueue()
    flood, single, capped = ClientSession(b"flood"), ClientSession(b"single"), ClientSession(b"capped")
    for i in range(5):
        queue.push(flood, pending(flood, i))
    queue.push(capped, pending(capped, 0))
    queue.push(single, pending(single, 0))
    order = []
    while (turn := queue.pop(lambda s: None if s is capped else s.pending[0])) is not None:
        order.append((turn[0].identity, turn[1].id))
    assert order[:3] == [(b"flood", 0), (b"single", 0), (b"flood", 1)]
    assert [i for who, i in order if who == b"flood"] == [0, 1, 2, 3, 4]
    assert len(queue) == 1 and capped.pending  # waits for its cap, still queued


def test_users_take_turns_whatever_their_number_of_connections():
    queue = FairQueue()
    many = [ClientSession(f"many{i}".encode(), tenant="uid:1") for i in range(4)]
    one = ClientSession(b"one", tenant="uid:2")
    for session in many:
        for i in range(3):
            generation = Generation(i, False, 1, prompt_token_ids=[1], prompt_field="prompt")
            session.requests[i] = generation
            queue.push(session, generation)
    for i in range(3):
        generation = Generation(i, False, 1, prompt_token_ids=[1], prompt_field="prompt")
        one.requests[i] = generation
        queue.push(one, generation)
    order = []
    while (turn := queue.pop(lambda s: s.pending[0])) is not None:
        order.append(turn[0].tenant)
    # Every other admission is the single-connection user's until its queue is empty.
    assert order[:6] == ["uid:1", "uid:2"] * 3
    assert len(queue) == 0 and len(order) == 15

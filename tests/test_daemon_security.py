"""A shared host: no client can crash the daemon through ZeroMQ routing ids, take another client's replies,
see another user's activity, or take more than its user's share by opening connections."""

from __future__ import annotations

import grp
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from daemon_fixtures import NOBODY, DaemonProcess, raw_socket, recv_reply, run_as_nobody, start_daemon

from kvd.server.config import ServerConfig
from kvd.server.listener import ListenError, check_endpoint
from kvd.server.protocol import FAULT_WALK_BUDGET, ProtocolError, decode
from kvd_client import Client
from kvd_client.endpoint import parse_endpoint

IS_ROOT = os.geteuid() == 0
LONG = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def daemon(tiny_daemon_model: Path) -> Iterator[DaemonProcess]:
    # A folder every user can traverse and a socket open to nobody's group, for the other-user tests.
    folder = Path(tempfile.mkdtemp(prefix="kvd-security-"))
    folder.chmod(0o755)
    group = ("--socket-group", grp.getgrgid(NOBODY).gr_name) if IS_ROOT else ()
    daemon = start_daemon(folder, *group, "--max-clients-per-tenant", "3", model=tiny_daemon_model)
    yield daemon
    assert daemon.stop() == 0, daemon.log()
    shutil.rmtree(folder)


def start_long_generation(endpoint: str, request_id: int = 1) -> zmq.Socket:
    """A plain client with a generation in flight (so it shows in stats), its first chunk read."""
    sock = raw_socket(endpoint)
    sock.send(msgpack.packb({"v": 1, "id": request_id, "op": "generate", "prompt": "Hello", **LONG}))
    assert recv_reply(sock)["type"] == "chunk"
    return sock


def following_ids(name: str) -> list[bytes]:
    """The routing ids libzmq would give the next plain connections, if `name` were a connection's id (libzmq
    numbers them 0x00 + a 32-bit counter): what an attacker who reads stats would claim."""
    ident = bytes.fromhex(name)
    counter = int.from_bytes(ident[1:], "big")
    width = max(len(ident) - 1, 1)
    return [ident[:1] + ((counter + k) % (1 << (8 * width))).to_bytes(width, "big") for k in range(1, 4)]


def test_claiming_the_next_routing_id_cannot_crash_the_daemon(daemon: DaemonProcess):
    victim = start_long_generation(daemon.endpoint)
    attackers = []
    try:
        with daemon.client() as client:
            names = [c["client"] for c in client.stats()["daemon"]["clients"]]
        assert names
        for name in names:
            for ident in following_ids(name):
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, ident)
                sock.connect(daemon.endpoint)
                attackers.append(sock)
        time.sleep(0.3)  # the claimed ids are registered at the daemon
        # Plain connections now take the next ids: libzmq aborted the daemon here when they were claimed.
        for _ in range(3):
            with daemon.client(timeout=10) as client:
                assert client.health()["status"] == "ready"
        assert daemon.proc.poll() is None, daemon.log()
    finally:
        victim.close()
        for sock in attackers:
            sock.close()


def test_a_connection_that_chooses_its_routing_id_is_refused(daemon: DaemonProcess):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"my-own-id")
    sock.connect(daemon.endpoint)
    try:
        sock.send(msgpack.packb({"v": 1, "id": 7, "op": "health"}))
        reply = recv_reply(sock)
    finally:
        sock.close()
    assert reply["type"] == "error" and reply["code"] == "bad_request" and reply["field"] == "routing_id", (
        reply
    )


def test_stats_names_connections_without_their_routing_ids(daemon: DaemonProcess):
    sock = start_long_generation(daemon.endpoint)
    try:
        with daemon.client() as client:
            names = [c["client"] for c in client.stats()["daemon"]["clients"]]
    finally:
        sock.close()
    # libzmq's ids are 5 bytes starting with 0; a name is a keyed hash of 8.
    assert names and all(len(bytes.fromhex(n)) == 8 for n in names), names


def in_other_user(daemon: DaemonProcess, work: Callable[[Client], object]) -> object:
    """`work(client)` in a child process running as nobody; its result."""

    def child() -> bytes:
        with Client(daemon.endpoint, timeout=30) as client:
            return msgpack.packb(work(client))

    return msgpack.unpackb(run_as_nobody(child))


@pytest.mark.skipif(not IS_ROOT, reason="a second user needs root to switch to")
def test_another_user_sees_only_its_own_clients_in_stats(daemon: DaemonProcess):
    sock = start_long_generation(daemon.endpoint)
    try:
        with daemon.client() as client:
            owner_view = client.stats()["daemon"]["clients"]
        other_view = in_other_user(daemon, lambda client: client.stats()["daemon"]["clients"])
    finally:
        sock.close()
    assert [c["tenant"] for c in owner_view] == [f"uid:{os.getuid()}"]
    assert other_view == []


def test_a_user_cannot_open_more_clients_than_its_share(daemon: DaemonProcess):
    socks = [start_long_generation(daemon.endpoint, i) for i in range(3)]
    try:
        extra = raw_socket(daemon.endpoint)
        try:
            extra.send(msgpack.packb({"v": 1, "id": 9, "op": "generate", "prompt": "Hi", **LONG}))
            reply = recv_reply(extra)
        finally:
            extra.close()
    finally:
        for sock in socks:
            sock.close()
    assert reply["type"] == "error" and reply["code"] == "overloaded", reply
    assert "--max-clients-per-tenant" in reply["message"]


def test_a_malformed_frame_costs_a_bounded_walk():
    # Half a million small elements with one bad string at the end: the fault search stops at its budget.
    frame = msgpack.packb({"v": 1, "id": 3, "op": "generate", "prompt": [1] * 500_000 + [b"\xff"]})
    frame = frame.replace(b"\xc4\x01\xff", b"\xa1\xff")  # the bytes object as a str with invalid UTF-8
    with pytest.raises(ProtocolError) as caught:
        decode(frame, 1 << 24)
    # The id is still found; the bad string lies past the budget, so the reply names no field.
    assert FAULT_WALK_BUDGET < 500_000
    assert caught.value.request_id == 3 and caught.value.field is None, caught.value


@pytest.mark.parametrize("host", ["[::]", "[2001:db8::5]", "0.0.0.0"])
def test_a_tcp_address_beyond_loopback_needs_allow_remote_in_ipv6_as_in_ipv4(host: str):
    # [::1] needs none: the IPv6 daemons of the client tests listen there without it.
    with pytest.raises(ListenError, match="--allow-remote"):
        check_endpoint(parse_endpoint(f"tcp://{host}:47123"), ServerConfig())

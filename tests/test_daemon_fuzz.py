"""Thousands of malformed messages, interleaved with valid traffic, against a real daemon."""

from __future__ import annotations

import random
import time

import msgpack
import zmq
from daemon_fixtures import DaemonProcess, raw_socket, recv_reply

NUM_MALFORMED = 2400
SEED = 20240611
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "🦊 says"]
VALID = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "stream": True}
DEEP = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
NAN, INF = float("nan"), float("inf")
U64 = 2**64 - 1

# Values each field must refuse; a request with any one of them gets an error reply.
INVALID: dict[str, list[object]] = {
    "v": [0, 2, "1", 1.0, U64, -(2**63), [1], b"\x01"],
    "id": [-1, U64, 1.5, "", "x" * 129, b"id", [1], {"a": 1}, True],
    "op": ["nope", "", 5, ["generate"], b"generate", {"op": 1}],
    "prompt": ["", 5, b"raw bytes", ["a"], DEEP, {"text": "x"}],
    "prompt_token_ids": [[], [-1], [2**31], ["a"], 5, [1.0], [1, 10**9], [True], DEEP],
    "max_tokens": [0, -1, U64, 1.5, "10", True, [], NAN],
    "temperature": [-0.1, 101, NAN, INF, -INF, "hot", [], b"x"],
    "top_p": [0, 1.5, NAN, "x"],
    "top_k": [-2, 1.5, 2**40],  # -1 is off, as in vLLM
    "min_p": [-0.5, 2, INF],
    "seed": [-1, U64, "s", 1.5],
    "stop": [5, [1], [""], ["a"] * 17, ["x" * 257], {"a": 1}, b"bin", DEEP],
    "stop_token_ids": [[-1], "x", [2**40], [True], list(range(1025))],
    "ignore_eos": [1, "yes", 0.0],
    "logprobs": [-1, 21, 1.0, "3"],
    "stream": [1, "true", []],
    "cache_salt": ["", 5, "x" * 300],
    "presence_penalty": [3, -3, NAN],
    "repetition_penalty": [0, 11, -1],
}


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, U64, -(2**63), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, NAN, INF, -INF, 1e308, -0.0])
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 12)))
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 12))
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 7:
        return {f"k{rng.randrange(100)}": random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    return msgpack.ExtType(rng.randrange(128), rng.randbytes(3))


def malformed(rng: random.Random, next_id: int) -> list[bytes]:
    """One malformed request (as frames); every one of them must get exactly one error reply."""
    kind = rng.randrange(10)
    base = {"v": 1, "id": next_id, "op": "generate", "prompt": "Hi", "max_tokens": 2}
    if kind == 0:  # binary junk
        return [rng.randbytes(rng.randrange(0, 64))]
    if kind == 1:  # msgpack, but not a map
        value = random_value(rng)
        while isinstance(value, dict):
            value = random_value(rng)
        return [msgpack.packb(value)]
    if kind == 2:  # a map of random junk
        return [msgpack.packb({f"f{i}": random_value(rng) for i in range(rng.randrange(0, 6))})]
    if kind in (3, 4, 5):  # a valid request with one field made invalid
        field = rng.choice(list(INVALID))
        message = dict(base)
        if field == "prompt_token_ids":
            del message["prompt"]
        message[field] = rng.choice(INVALID[field])
        return [msgpack.packb(message)]
    if kind == 6:  # an unknown field, or a field of another op
        return [msgpack.packb(base | {rng.choice(["n", "echo", "text", "target", "best_of", "user"]): 1})]
    if kind == 7:  # cut short
        data = msgpack.packb(base | {"prompt": "a longer prompt to cut short somewhere"})
        return [data[: rng.randrange(0, len(data) - 1)]]
    if kind == 8:  # more than one frame (a REQ envelope, or stray parts)
        return [b"", msgpack.packb(base)] if rng.random() < 0.5 else [msgpack.packb(base), rng.randbytes(4)]
    # Well-formed, but wrong for this daemon: nothing to abort, ids beyond the vocabulary, two prompt forms.
    return [
        msgpack.packb(
            rng.choice(
                [
                    {"v": 1, "id": next_id, "op": "abort", "target": 10**6 + next_id},
                    {"v": 1, "id": next_id, "op": "detokenize", "token_ids": [10**8]},
                    {"v": 1, "id": next_id, "op": "tokenize", "text": "a", "messages": []},
                    {"v": 1, "id": next_id, "op": "chat", "messages": [{"role": "user"}]},
                    base | {"prompt_token_ids": [1, 2]},
                ]
            )
        )
    ]


def test_malformed_messages_interleaved_with_valid_traffic(tiny_daemon: DaemonProcess):
    with tiny_daemon.client() as client:
        expected = {
            p: client.generate(p, **{k: v for k, v in VALID.items() if k != "stream"}) for p in PROMPTS
        }
        before = client.stats()["daemon"]
        max_bytes = client.info()["limits"]["max_message_bytes"]
    rng = random.Random(SEED)
    clean = raw_socket(tiny_daemon.endpoint)  # valid requests only
    mixed = [raw_socket(tiny_daemon.endpoint) for _ in range(3)]  # malformed and valid on the same sockets
    sockets = [clean, *mixed]
    valid_sent: dict[tuple[int, str], str] = {}  # (socket index, id) -> prompt
    replies: list[tuple[int, dict]] = []
    errors_expected = [0] * len(sockets)

    def drain() -> None:
        for i, sock in enumerate(sockets):
            while True:
                try:
                    reply = msgpack.unpackb(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if reply["type"] != "heartbeat":
                    replies.append((i, reply))

    def send_valid(i: int) -> None:
        rid = f"valid-{len(valid_sent)}"
        prompt = PROMPTS[len(valid_sent) % len(PROMPTS)]
        valid_sent[(i, rid)] = prompt
        sockets[i].send(msgpack.packb({"v": 1, "id": rid, "op": "generate", "prompt": prompt, **VALID}))

    for n in range(NUM_MALFORMED):
        i = 1 + n % len(mixed)
        sockets[i].send_multipart(malformed(rng, n))
        errors_expected[i] += 1
        if n % 40 == 0:
            send_valid(0)
            send_valid(1 + rng.randrange(len(mixed)))
        if n % 300 == 0:  # between the limit and ZMQ_MAXMSGSIZE: a too_large reply
            sockets[i].send(
                msgpack.packb({"v": 1, "id": n, "op": "generate", "prompt": "x" * (max_bytes + 1)})
            )
            errors_expected[i] += 1
        if n % 25 == 0:
            drain()
    # Beyond ZMQ_MAXMSGSIZE: dropped with the connection, by libzmq, on throwaway sockets.
    for _ in range(3):
        junk = raw_socket(tiny_daemon.endpoint)
        junk.send(rng.randbytes(3 * max_bytes))
        assert recv_reply(junk, timeout=0.2) is None
        junk.close()

    def finished() -> bool:
        drain()
        finals = sum(1 for _, r in replies if r["type"] == "final")
        errors = sum(1 for _, r in replies if r["type"] == "error")
        return finals == len(valid_sent) and errors == sum(errors_expected)

    deadline = time.monotonic() + 60
    while not finished():
        assert time.monotonic() < deadline, "replies missing"
        time.sleep(0.02)
    time.sleep(0.3)
    drain()  # nothing beyond one reply per malformed message arrives late

    errors = [(i, r) for i, r in replies if r["type"] == "error"]
    assert [sum(1 for i, _ in errors if i == k) for k in range(len(sockets))] == errors_expected
    assert all(
        r["code"] in ("bad_request", "unsupported_version", "too_large", "not_found") for _, r in errors
    )
    assert {r["code"] for _, r in errors} == {"bad_request", "unsupported_version", "too_large", "not_found"}
    for (i, rid), prompt in valid_sent.items():
        mine = [r for k, r in replies if k == i and r["id"] == rid]
        assert [r["type"] for r in mine] == ["chunk"] * (len(mine) - 1) + ["final"]
        assert [t for r in mine for t in r["token_ids"]] == expected[prompt].token_ids
        assert "".join(r["text"] for r in mine) == expected[prompt].text
    for sock in sockets:
        sock.close()
    with tiny_daemon.client() as client:
        assert client.health() == {"status": "ready"}
        stats = client.stats()
    assert stats["kv_cache"]["used_blocks"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["daemon"]["requests_rejected"] - before["requests_rejected"] == sum(errors_expected)
    assert stats["daemon"]["requests_total"] - before["requests_total"] == len(valid_sent)
    assert tiny_daemon.proc.poll() is None

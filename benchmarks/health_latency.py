"""`health` round trips while another client sends long prompts: the daemon tokenizes prompts beside its loop,
so other clients are answered meanwhile.

    python -m benchmarks.health_latency [--prompt-words 55000] [--prompts 12] [--json]
    python -m benchmarks.health_latency --malformed 2000 [--malformed-kb 500]

One client sends --prompts generate requests of --prompt-words distinct words each (about 6.8 bytes a word),
one after another, each waiting for its reply (a too_large error once tokenized: far more tokens than the
model's context). A second client asks `health` every 5 ms meanwhile. Prompts above the byte bound
(`info.limits.max_prompt_bytes`) are refused without tokenizing; the default size stays under it on the bundled
model, so every prompt is tokenized.

With --malformed N the second client instead sends N malformed requests of about --malformed-kb KB each as
fast as the daemon takes them (a map whose prompt is a long array with a string that is no UTF-8 at its end:
the frame is read leniently to name the field at fault), the protocol fuzz a hostile client can send.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import msgpack
import zmq

from benchmarks import serve
from kvd_client import Client


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-words", type=int, default=55_000)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--malformed", type=int, default=0, help="send this many malformed requests instead")
    p.add_argument("--malformed-kb", type=int, default=500)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    daemon_args = serve.parse_args(["--threads", "1", "--kv-cache-memory", "256M"])
    text = " ".join(f"w{i}" for i in range(args.prompt_words))
    with tempfile.TemporaryDirectory() as workdir:
        endpoint = f"ipc://{workdir}/kvd.sock"
        proc = serve.start_daemon(daemon_args, endpoint)
        try:
            with Client(endpoint, timeout=60) as client:
                bound = client.info()["limits"]["max_prompt_bytes"]
                if args.malformed:
                    flood = _malformed_flood(endpoint, args.malformed, args.malformed_kb)
                else:
                    flood = _prompt_flood(endpoint, text, args.prompts)
                latencies = _health_while(client, flood)
        finally:
            proc.terminate()
            proc.wait()
    latencies.sort()
    report = {
        "prompt_bytes": len(text.encode()),
        "max_prompt_bytes": bound,
        "prompts": args.prompts,
        "malformed": args.malformed,
        "health_count": len(latencies),
        "health_p50_ms": 1e3 * statistics.median(latencies),
        "health_p99_ms": 1e3 * latencies[max(0, int(0.99 * len(latencies)) - 1)],
        "health_max_ms": 1e3 * latencies[-1],
    }
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v:.2f}" for k, v in report.items()))
    return report


def _prompt_flood(endpoint: str, text: str, prompts: int) -> Callable[[], None]:
    def flood() -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        for i in range(prompts):
            sock.send(msgpack.packb({"v": 1, "id": i, "op": "generate", "prompt": text}))
            while msgpack.unpackb(sock.recv())["type"] == "heartbeat":
                pass
        sock.close(linger=0)

    return flood


def _malformed_flood(endpoint: str, count: int, kb: int) -> Callable[[], None]:
    items = kb * 1024 // 2  # a one-byte string is two bytes of msgpack
    frame = msgpack.packb({"v": 1, "id": 1, "op": "generate", "prompt": ["a"] * items + ["\x00"]})
    frame = frame[: -len(b"\xa1\x00")] + b"\xa1\xff"  # the last string: one byte that is no UTF-8

    def flood() -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        replies = 0
        for _ in range(count):
            sock.send(frame)
            while sock.poll(0):
                replies += msgpack.unpackb(sock.recv())["type"] == "error"
        while replies < count:
            replies += msgpack.unpackb(sock.recv())["type"] == "error"
        sock.close(linger=0)

    return flood


def _health_while(client: Client, flood: Callable[[], None]) -> list[float]:
    """health round trips, one every 5 ms, while `flood` runs in a thread."""
    done = threading.Event()
    sender = threading.Thread(target=lambda: (flood(), done.set()))
    sender.start()
    latencies = []
    while not done.is_set():
        started = time.perf_counter()
        client.health()
        latencies.append(time.perf_counter() - started)
        time.sleep(0.005)
    sender.join()
    return latencies


if __name__ == "__main__":
    main()

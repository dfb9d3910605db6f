"""Serving throughput: the throughput workload through the daemon (N client processes) against in-process
`LLM.generate`, plus the round trip of `health` over ipc.

    python -m benchmarks.serve [--model PATH] [--dtype bfloat16] [--num-requests 16] [--clients 4] [--json]

The workload is benchmarks.throughput's (random prompts, ignore_eos, fixed seed), scaled down by default so a
run takes a few minutes on 2 CPU cores; raise --num-requests / --input-len / --output-len to scale up (64,
"64,512" and "32,256" are the throughput benchmark's own sizes).
The daemon runs as a `kvd serve` subprocess with the same engine settings as the in-process LLM; the two sides
alternate (--rounds) so neither runs while the other does. Each client process submits its share of the
requests at once (streaming by default) after a common start signal; daemon throughput is all output tokens
over the time from that signal to the last final reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvd_client import AsyncClient, Client, KvdError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="folder, .gguf or hub id (default: the bundled SmolLM2-135M)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", default="32,128", help="min,max prompt tokens")
    p.add_argument("--output-len", default="16,64", help="min,max output tokens")
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch threads of both sides (default: cores - 1, leaving a core to the client processes)",
    )
    p.add_argument("--clients", type=int, default=4, help="client processes sharing the requests")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (one reply each)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="1G")
    p.add_argument("--health-samples", type=int, default=2000)
    p.add_argument(
        "--rounds", type=int, default=2, help="alternate daemon and in-process runs this many times"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p.parse_args(argv)


def client_worker(endpoint: str, requests: list[tuple[list[int], int]], stream: bool, go: str, out) -> None:
    """One client process: wait for the start signal, send every request at once, count output tokens."""

    async def one(client: AsyncClient, prompt: list[int], max_tokens: int) -> int:
        params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
        if not stream:
            return len((await client.generate(prompt, **params)).token_ids)
        return sum([len(c.token_ids) async for c in client.stream(prompt, **params)])

    async def run() -> int:
        async with AsyncClient(endpoint, timeout=120) as client:
            await client.health()  # connected before the clock starts
            out.put(("ready", 0))
            while not os.path.exists(go):
                await asyncio.sleep(0.001)
            counts = await asyncio.gather(*(one(client, p, n) for p, n in requests))
        return sum(counts)

    out.put(("done", asyncio.run(run())))


def run_daemon(endpoint: str, workload: list[tuple[list[int], int]], clients: int, stream: bool) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        go = str(Path(tmp) / "go")
        shares = [workload[i::clients] for i in range(clients)]
        procs = [ctx.Process(target=client_worker, args=(endpoint, s, stream, go, out)) for s in shares]
        for p in procs:
            p.start()
        _collect(out, procs, "ready")
        started = time.perf_counter()
        Path(go).touch()
        produced = sum(_collect(out, procs, "done"))
        elapsed = time.perf_counter() - started
        for p in procs:
            p.join()
    expected = sum(n for _, n in workload)
    if produced != expected:
        raise RuntimeError(f"the daemon produced {produced} tokens, expected {expected}")
    return produced / elapsed


def _collect(out, procs: list, kind: str) -> list[int]:
    """One `kind` message from each client process; fails at once if one of them died."""
    values = []
    while len(values) < len(procs):
        try:
            got, value = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a client process failed (see its traceback above)") from None
            continue
        if got != kind:
            raise RuntimeError(f"expected {kind!r} from a client process, got {got!r}")
        values.append(value)
    return values


def health_latency_us(endpoint: str, samples: int) -> tuple[float, float]:
    with Client(endpoint) as client:
        for _ in range(100):  # warm the connection
            client.health()
        times = []
        for _ in range(samples):
            started = time.perf_counter_ns()
            client.health()
            times.append((time.perf_counter_ns() - started) / 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def start_daemon(args: argparse.Namespace, endpoint: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen", endpoint, "--dtype", args.dtype]
    cmd += [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    cmd += [
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--threads",
        str(args.threads),
        "--log-level",
        "warning",
    ]
    if args.model:
        cmd += ["--model", args.model]
    return launch_daemon(cmd, endpoint)


def launch_daemon(cmd: list[str], endpoint: str) -> subprocess.Popen:
    """`kvd serve` as `cmd`, once it answers `health` on `endpoint`."""
    proc = subprocess.Popen(cmd)
    with Client(endpoint, timeout=1) as client:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                client.health()
                return proc
            except KvdError:
                time.sleep(0.1)  # no socket file yet: the client says so at once
    proc.kill()
    raise RuntimeError("the daemon did not start")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # Heavy imports here, not at the top: the spawned client processes import this module too.
    from benchmarks.throughput import make_workload, run_kvd
    from kvd import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,  # EngineArgs parses sizes such as 1G
        num_threads=args.threads,
    )
    workload = make_workload(
        args.num_requests, llm.engine.config.vocab_size, args.input_len, args.output_len, args.seed
    )
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as tmp:
        endpoint = f"ipc://{tmp}/kvd.sock"
        daemon = start_daemon(args, endpoint)
        try:
            run_daemon(endpoint, workload[: args.clients], args.clients, not args.no_stream)  # warm-up
            daemon_runs, inprocess_runs = [], []
            for _ in range(args.rounds):
                daemon_runs.append(run_daemon(endpoint, workload, args.clients, not args.no_stream))
                print(f"daemon ({args.clients} clients): {daemon_runs[-1]:8.1f} output tok/s", flush=True)
                inprocess_runs.append(run_kvd(llm, workload))
                print(f"in-process LLM.generate: {inprocess_runs[-1]:8.1f} output tok/s", flush=True)
            p50, p99 = health_latency_us(endpoint, args.health_samples)
            print(f"health round trip over ipc: p50 {p50:.0f} us, p99 {p99:.0f} us", flush=True)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    daemon_tok_s, inprocess_tok_s = statistics.median(daemon_runs), statistics.median(inprocess_runs)
    result = {
        "daemon_tok_s": round(daemon_tok_s, 1),
        "inprocess_tok_s": round(inprocess_tok_s, 1),
        "ratio": round(daemon_tok_s / inprocess_tok_s, 3),
        "health_p50_us": round(p50, 1),
        "health_p99_us": round(p99, 1),
        "clients": args.clients,
        "num_requests": args.num_requests,
        "stream": not args.no_stream,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k:16s} {v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()

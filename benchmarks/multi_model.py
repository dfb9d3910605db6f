"""Several models in one daemon: the time to first token of a request for a model not loaded (its load
included) against one loaded; one model's decode speed with two more loaded beside it against alone; a stream's
longest gap between tokens while another model loads, against its median gap and against the longest gap of the
same stream with no load beside it (the machine's own jitter), alternating, and that load's time. With
$LLAMA_CPP_BIN, llama-server's start to ready on the same file, in the same rounds (what a process per model pays
to bring one up).

    python -m benchmarks.multi_model [--model FILE.gguf] [--rounds 3] [--json]

The daemon serves one file under three names (a, b, c: three engines of the same weights), so every figure
compares like with like. The machine may be shared: compare ratios and medians, not single runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.host import cpu_name
from benchmarks.peers import peer_binary
from benchmarks.serve import launch_daemon
from kvd_client import Client

HI = [{"role": "user", "content": "Tell me about the sea."}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each measure (default 3)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens of a decode measure (default 128)")
    parser.add_argument("--threads", type=int, help="the daemon's threads (default: its own choice)")
    parser.add_argument("--quick", action="store_true", help="one round of few tokens (the tests' run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = 1, 16
    return args


def start_daemon(model: str, folder: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{folder}/kvd.sock"
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen", endpoint, "--log-level", "warning"]
    cmd += ["--kv-cache-memory", "256M", "--keep-alive", "-1", "--max-loaded-models", "3"]
    cmd += [part for name in "abc" for part in ("--model", f"{name}={model}")]
    cmd += ["--threads", str(threads)] if threads else []
    return launch_daemon(cmd, endpoint), endpoint


def first_token_s(client: Client, model: str) -> float:
    started = time.perf_counter()
    with client.stream_chat(HI, model=model, max_tokens=4, temperature=0) as stream:
        for chunk in stream:
            if chunk.token_ids:
                return time.perf_counter() - started
    raise RuntimeError("no token")


def decode_tok_s(client: Client, model: str, tokens: int) -> float:
    times = []
    with client.stream("The sea", model=model, max_tokens=tokens, temperature=0, ignore_eos=True) as stream:
        for chunk in stream:
            times += [time.perf_counter()] * len(chunk.token_ids)
    return (len(times) - 1) / (times[-1] - times[0])


def stream_gaps(endpoint: str, tokens: int, load: bool) -> tuple[float, float, float]:
    """(longest gap, median gap) in seconds between a stream's tokens on a, with b loading from its 8th token
    where `load`, and the seconds that load took (0 without one)."""
    with Client(endpoint, timeout=300) as client:
        client.unload("b")
        arrivals: list[float] = []
        took: list[float] = []
        loader = threading.Thread(target=_load, args=(endpoint, "b", took))
        with client.stream("The sea", model="a", max_tokens=tokens, temperature=0, ignore_eos=True) as stream:
            for chunk in stream:
                arrivals += [time.perf_counter()] * len(chunk.token_ids)
                if load and len(arrivals) == 8:
                    loader.start()
        if load:
            loader.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b > a]  # a chunk's tokens arrive together
    return max(gaps), statistics.median(gaps), sum(took)


def _load(endpoint: str, model: str, took: list[float]) -> None:
    with Client(endpoint, timeout=300) as client:
        started = time.perf_counter()
        client.load(model)
        took.append(time.perf_counter() - started)


def llama_server_ready_s(binary: Path, model: str) -> float:
    """Seconds from llama-server's start (`binary`) to its /health answering 200."""
    port = 18000 + os.getpid() % 1000
    started = time.perf_counter()
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([str(binary), "-m", model, "--port", str(port)], stdout=log, stderr=log)
    try:
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - started
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("llama-server exited")
    finally:
        proc.terminate()
        proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from kvd.model.hub import default_model_path

    model = args.model or str(default_model_path())
    peer = peer_binary()
    figures: dict[str, list[float]] = {k: [] for k in ("warm", "cold", "alone", "beside", "peer_ready")}
    with tempfile.TemporaryDirectory() as folder:
        proc, endpoint = start_daemon(model, Path(folder), args.threads)
        try:
            with Client(endpoint, timeout=300) as client:
                first_token_s(client, "a")  # the warm-up of a first request
                for _ in range(args.rounds):
                    figures["warm"].append(first_token_s(client, "a"))
                    client.unload("b")
                    figures["cold"].append(first_token_s(client, "b"))
                    if peer is not None:
                        figures["peer_ready"].append(llama_server_ready_s(peer, model))
                    client.unload("b")
                    client.unload("c")
                    figures["alone"].append(decode_tok_s(client, "a", args.tokens))
                    client.load("b")
                    client.load("c")
                    figures["beside"].append(decode_tok_s(client, "a", args.tokens))
            for _ in range(args.rounds):  # alternating: the same stream with a load beside it and without
                for load, key in ((True, "gap_loading"), (False, "gap_alone")):
                    longest, median, took = stream_gaps(endpoint, args.tokens * 2, load)
                    figures.setdefault(key, []).append(longest)
                    figures.setdefault("gap_median", []).append(median)
                    if load:
                        figures.setdefault("load_streaming", []).append(took)
        finally:
            proc.terminate()
            proc.wait()
    result = {k: statistics.median(v) for k, v in figures.items() if v}
    result["cpu"] = cpu_name()
    print(f"model {model} (CPU: {result['cpu']})")
    print(f"first token, model loaded:        {1000 * result['warm']:8.1f} ms")
    print(f"first token, model not loaded:    {1000 * result['cold']:8.1f} ms (its load included)")
    if "peer_ready" in result:
        print(f"llama-server start to ready:      {1000 * result['peer_ready']:8.1f} ms")
        print(f"ratio (llama-server / kvd cold):  {result['peer_ready'] / result['cold']:8.2f}")
    print(f"decode alone:                     {result['alone']:8.1f} tok/s")
    print(
        f"decode with 2 more loaded:        {result['beside']:8.1f} tok/s ({result['beside'] / result['alone']:.2f}x)"
    )
    loading, alone, median = result["gap_loading"], result["gap_alone"], result["gap_median"]
    print(
        f"stream gap while b loads:         {1000 * loading:8.1f} ms longest, {1000 * median:.1f} ms median "
        f"({loading / median:.1f}x)"
    )
    print(f"stream gap, no load beside:       {1000 * alone:8.1f} ms longest ({alone / median:.1f}x)")
    print(f"ratio (longest gap, load / none): {loading / alone:8.2f}")
    print(f"b's load beside the stream:       {1000 * result['load_streaming']:8.1f} ms")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

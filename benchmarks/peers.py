"""kvd against llama.cpp's llama-server on the same GGUF file, the two alternating in one run.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python -m benchmarks.peers [--quick] [--json]
        [--model FILE.gguf] [--peer-model FILE.gguf] [--quantization auto] [--dtype auto]

Workloads (token-id prompts, greedy, ignore_eos, so both sides compute the same number of tokens):
- single stream: one prompt of --single-len tokens in, as many out; decode tok/s after the first token, and
  prefill tok/s of the prompt;
- throughput: --concurrency N (8, 16, 64) requests of benchmarks.throughput's workload at once, output tok/s
  (llama-server gets N parallel slots and a context of N x the longest request);
- shared prefix: requests sharing a --prefix-len token system prompt, sent at once; output tok/s (kvd's
  prefix cache; llama-server reuses a slot's cached prompt).
kvd runs in this process; llama-server is started per setting and stopped before kvd's turn, so neither
side runs while the other does. Without $LLAMA_CPP_BIN the peer is skipped (said so) and kvd's figures alone
are printed. `--peer-model` defaults to --model: pass llama.cpp an F16/F32 copy of the file to compare
against its float paths (the peer build script writes both beside its bin folder).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.host import bundled_gguf
from benchmarks.throughput import make_workload
from kvd import LLM
from kvd.engine.engine_args import QUANTIZATIONS
from kvd.request.sampling_params import SamplingParams

Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--peer-model", default=None, help="the .gguf llama-server loads (default: --model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="kvd's KV pool elements"
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both sides")
    p.add_argument("--single-len", type=int, default=128, help="single stream: tokens in and out")
    p.add_argument("--concurrency", default="8,16,64", help="throughput workload: requests at once")
    p.add_argument("--input-len", default="64,512", help="throughput workload: min,max prompt tokens")
    p.add_argument("--output-len", default="32,256", help="throughput workload: min,max output tokens")
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix workload: system prompt tokens")
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="3G", help="kvd's KV pool (the 64-request run needs ~2.3G)")
    p.add_argument("--rounds", type=int, default=2, help="kvd and the peer alternate this many times")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every workload")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args(argv)
    if args.quick:
        args.single_len, args.concurrency, args.input_len, args.output_len = 32, "4", "16,48", "8,16"
        args.prefix_len, args.prefix_requests, args.rounds, args.kv_cache_memory = 64, 4, 1, "256M"
    args.model = args.model or bundled_gguf()
    args.peer_model = args.peer_model or args.model
    return args


@dataclass
class Figures:
    """One side's result of one workload; the unit is tokens per second."""

    decode: float | None = None
    prefill: float | None = None
    output: float | None = None


class KvdSide:
    name = "kvd"

    def __init__(self, args: argparse.Namespace, max_seqs: int) -> None:
        self.llm = LLM(
            args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            num_threads=args.threads,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, max_seqs),
            kv_cache_memory=args.kv_cache_memory,
        )
        # One request before timing, as llama-server runs its own warm-up at start: first-use costs (the KV
        # pool's pages, allocator pools) would otherwise land in whichever figure is taken first.
        self.llm.generate(
            [list(range(100, 100 + args.single_len))], SamplingParams(max_tokens=4), use_tqdm=False
        )

    def run(self, workload: Workload) -> tuple[float, float]:
        """(seconds, output tokens) for the workload submitted at once, from an empty prefix cache."""
        self.llm.engine.block_manager.reset_prefix_cache()
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
        started = time.perf_counter()
        outs = self.llm.generate([p for p, _ in workload], params, use_tqdm=False)
        return time.perf_counter() - started, sum(len(o.token_ids) for o in outs)

    def single(self, prompt: list[int], n: int) -> Figures:
        first, _ = self.run([(prompt, 1)])
        total, produced = self.run([(prompt, n)])
        return Figures(decode=(produced - 1) / (total - first), prefill=len(prompt) / first)


class LlamaServerSide:
    """llama-server on a free port, one HTTP request per thread; started per setting, stopped after."""

    name = "llama.cpp"

    def __init__(
        self, args: argparse.Namespace, binary: Path, slots: int, max_len: int, extra: Sequence[str] = ()
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        command = [str(binary), "-m", args.peer_model, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots)]
        command += ["-c", str(slots * max_len), "-b", "2048", "-ub", "512", "--no-webui", *extra]
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.slots = slots
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"llama-server did not start:\n{self.log.read().decode()[-2000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def complete(self, prompt: list[int], n: int) -> dict:
        return self.request(
            {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True, "cache_prompt": True}
        )

    def request(self, body: dict) -> dict:
        """One /completion request's reply."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3600) as r:
            return json.loads(r.read())

    def run(self, workload: Workload) -> tuple[float, float]:
        started = time.perf_counter()
        with ThreadPoolExecutor(max(1, len(workload))) as pool:
            replies = list(pool.map(lambda w: self.complete(*w), workload))
        return time.perf_counter() - started, sum(r["tokens_predicted"] for r in replies)

    def single(self, prompt: list[int], n: int) -> Figures:
        timings = self.complete(prompt, n)["timings"]
        return Figures(decode=timings["predicted_per_second"], prefill=timings["prompt_per_second"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def alternate(sides: list, rounds: int, measure) -> dict[str, Figures]:
    """Each side's median figures over `rounds` turns, taken in turn (kvd, peer, kvd, peer, ...)."""
    runs: dict[str, list[Figures]] = {side.name: [] for side in sides}
    for _ in range(rounds):
        for side in sides:
            runs[side.name].append(measure(side))
    return {
        name: Figures(
            **{
                key: statistics.median(getattr(f, key) for f in figures)
                for key in ("decode", "prefill", "output")
                if getattr(figures[0], key) is not None
            }
        )
        for name, figures in runs.items()
    }


def throughput(side, workload: Workload) -> Figures:
    seconds, produced = side.run(workload)
    if produced != sum(n for _, n in workload):
        raise RuntimeError(f"{side.name} produced {produced} tokens, expected {sum(n for _, n in workload)}")
    return Figures(output=produced / seconds)


def peer_binary() -> Path | None:
    folder = os.environ.get("LLAMA_CPP_BIN")
    if not folder:
        print(
            "llama.cpp peer skipped: $LLAMA_CPP_BIN is unset; point it at a llama.cpp build's bin folder "
            "(one holding llama-server) to compare; kvd's figures alone follow"
        )
        return None
    binary = Path(folder) / "llama-server"
    if not binary.is_file():
        raise SystemExit(
            f"$LLAMA_CPP_BIN={folder} holds no llama-server; build llama.cpp's llama-server target"
        )
    return binary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    binary = peer_binary()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    max_in, max_out = (max(int(x) for x in r.split(",")) for r in (args.input_len, args.output_len))
    max_len = max(max_in + max_out, 2 * args.single_len, args.prefix_len + 64 + 16) + 16
    kvd = KvdSide(args, max(*concurrency, args.prefix_requests))
    vocab = kvd.llm.engine.config.vocab_size
    info = kvd.llm.engine.info()
    rng = random.Random(0)
    results: dict = {
        "model": args.model,
        "peer_model": args.peer_model if binary else None,
        "kvd_dtype": info["dtype"],
        "kvd_quantization": info["quantization"],
        "kvd_kv_cache_dtype": info["kv_cache_dtype"],
        "threads": args.threads,
        "cpu_bf16": info["dtype_reason"],
        "workloads": {},
    }
    print(
        f"kvd: {info['dtype']}, quantization {info['quantization']} ({info['dtype_reason']}); "
        f"peer: {args.peer_model if binary else 'skipped'}; threads {args.threads}"
    )
    experts = info.get("experts")
    if experts:  # a mixture of experts: what a token reads against all the weights
        results["experts"] = experts
        print(
            f"experts: {experts['top_k']} of {experts['num_experts']} a token in {experts['sparse_layers']} layers; "
            f"a token reads {experts['active_bytes_per_token'] / 1e6:.1f} MB of {info['weight_bytes'] / 1e6:.1f} MB "
            f"(experts' parameters {experts['active_expert_parameters'] / 1e6:.1f} M of "
            f"{experts['expert_parameters'] / 1e6:.1f} M)"
        )

    def record(name: str, figures: dict[str, Figures]) -> None:
        row = {side: {k: v for k, v in vars(f).items() if v is not None} for side, f in figures.items()}
        if binary:
            row["ratio"] = {
                key: round(value / getattr(figures["llama.cpp"], key), 2)
                for key, value in vars(figures["kvd"]).items()
                if value is not None
            }
        results["workloads"][name] = row
        print(
            f"{name:<22}"
            + "  ".join(
                f"{side} {key} {value:8.1f}"
                for side, f in figures.items()
                for key, value in vars(f).items()
                if value is not None
            )
            + (f"  ratio {row['ratio']}" if binary else ""),
            flush=True,
        )

    def compare(name: str, slots: int, measure) -> None:
        peer = LlamaServerSide(args, binary, slots, max_len) if binary else None
        try:
            record(name, alternate([kvd] + ([peer] if peer else []), args.rounds, measure))
        finally:
            if peer:
                peer.close()

    prompt = [rng.randrange(100, vocab) for _ in range(args.single_len)]
    compare("single stream", 1, lambda side: side.single(prompt, args.single_len))
    for n in concurrency:
        workload = make_workload(n, vocab, args.input_len, args.output_len, seed=n)
        compare(f"{n} concurrent", n, lambda side, w=workload: throughput(side, w))
    system = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
    shared = [
        (system + [rng.randrange(100, vocab) for _ in range(32)], 16) for _ in range(args.prefix_requests)
    ]
    compare("shared prefix", args.prefix_requests, lambda side: throughput(side, shared))
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()

"""kvd against vLLM's CPU backend on the same bfloat16 weights, the two alternating in one run.

    VLLM_VENV=DIR python -m benchmarks.vllm_peer [--quick] [--json] [--rounds N] [--kvd bf16,int4]
        [--model FILE.gguf] [--peer-model HF_FOLDER] [--threads N]

vLLM runs in its own virtual environment, $VLLM_VENV, which the vLLM CPU install script makes; that script also
writes the bundled SmolLM2 as a bf16 Hugging Face folder (vLLM's CPU backend does not load GGUF), which
--peer-model defaults to: $VLLM_MODEL, else kvd-bench/smollm2-hf under the user's cache folder. vLLM is one
offline worker (`vllm.LLM`, greedy, its defaults otherwise) in that venv's python, started once, warmed with one
request and kept up across its turns; its start (which compiles the model with Inductor) is timed apart and in
no figure. It gets vLLM's CPU settings: $VLLM_CPU_KVCACHE_SPACE (--vllm-kv-gib), $VLLM_CPU_OMP_THREADS_BIND
(cores 0 to --threads - 1) and, where present, tcmalloc and the venv's Intel OpenMP in $LD_PRELOAD.
kvd runs in this process on the bundled GGUF: `bf16` is `--quantization none --dtype bfloat16`, the weights
vLLM loads; `int4` is `--quantization int4`, the file's Q4_1 blocks in kvd's kernels (its default, auto, runs the
same blocks in quantization gguf, the embedding and output projection in Q4_1 too); `-kv8` adds `--kv-cache-dtype int8` (an 8-bit pool).
Workloads (token-id prompts, greedy, ignore_eos; each side must produce exactly the requested tokens): single
stream (--single-len in and out: decode tok/s after the first token, prefill tok/s), then --concurrency N
requests of benchmarks.throughput's workload at once (output tok/s; 64 is that workload, 16 its first 16).
Sides take turns (kvd, vLLM, kvd, vLLM, ...) --rounds times; medians and kvd/vLLM ratios are printed with the
CPU's name and flags. Without $VLLM_VENV the peer is skipped, said so, and kvd's figures are printed alone.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.host import bundled_gguf, cpu_name
from benchmarks.peers import Figures, KvdSide, Workload, alternate, throughput
from benchmarks.throughput import make_workload
from kvd.model.cpu_dtype import cpu_flags

ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
# name: (quantization, dtype, kv_cache_dtype)
KVD_MODES = {
    "bf16": ("none", "bfloat16", "auto"),
    "int4": ("int4", "auto", "auto"),
    "bf16-kv8": ("none", "bfloat16", "int8"),
    "int4-kv8": ("int4", "auto", "int8"),
}
TARGETS = {
    "kvd bf16": 2.0,
    "kvd int4": 2.5,
    "kvd bf16-kv8": 2.0,
    "kvd int4-kv8": 2.5,
}  # output tok/s over vLLM's on the 64-request workload
PEER = "vLLM"

# Runs in $VLLM_VENV's python: JSON lines in (a workload), JSON lines out (seconds, tokens produced).
WORKER = """
import json, os, sys, time
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # vLLM logs to stdout: into the log with stderr; the replies keep the real stdout
import vllm
from vllm import LLM, SamplingParams, TokensPrompt

def main():
    model, max_seqs, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model, dtype="bfloat16", max_num_seqs=max_seqs, max_model_len=max_len, seed=0)
    print(json.dumps({"version": vllm.__version__}), file=replies, flush=True)
    for line in sys.stdin:
        workload = json.loads(line)
        llm.reset_prefix_cache()  # every run computes its prompts, as kvd's do
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in workload]
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"seconds": seconds, "tokens": tokens}), file=replies, flush=True)

if __name__ == "__main__":
    main()
"""


def fmt(values: dict[str, float]) -> str:
    return "  ".join(f"{key} {value:8.2f}" for key, value in values.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="kvd's .gguf (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument(
        "--peer-model", default=os.environ.get("VLLM_MODEL") or str(cache / "kvd-bench/smollm2-hf")
    )
    p.add_argument("--kvd", default="bf16", help=f"kvd modes, comma separated, of {', '.join(KVD_MODES)}")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both sides")
    p.add_argument("--single-len", type=int, default=128, help="single stream: tokens in and out")
    p.add_argument("--concurrency", default="16,64", help="throughput workload: requests at once")
    p.add_argument("--input-len", default="64,512", help="throughput workload: min,max prompt tokens")
    p.add_argument("--output-len", default="32,256", help="throughput workload: min,max output tokens")
    p.add_argument("--kv-cache-memory", default="3G", help="kvd's KV pool per mode")
    p.add_argument("--vllm-kv-gib", default="3", help="vLLM's KV space ($VLLM_CPU_KVCACHE_SPACE, GiB)")
    p.add_argument("--rounds", type=int, default=2, help="the sides take turns this many times")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every workload")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args(argv)
    if args.quick:
        args.single_len, args.concurrency, args.input_len, args.output_len = 32, "4", "16,48", "8,16"
        args.rounds, args.kv_cache_memory, args.vllm_kv_gib = 1, "256M", "1"
    args.model = args.model or bundled_gguf()
    if unknown := set(args.kvd.split(",")) - set(KVD_MODES):
        p.error(f"--kvd: unknown mode {', '.join(sorted(unknown))}; choose from {', '.join(KVD_MODES)}")
    return args


class VllmSide:
    """The offline worker in $VLLM_VENV, up from construction to close()."""

    name = PEER
    single = KvdSide.single  # the same two timed runs: a 1-token request, then the whole one

    def __init__(self, args: argparse.Namespace, venv: Path, max_seqs: int, max_len: int) -> None:
        env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": args.vllm_kv_gib,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "LD_PRELOAD": ":".join([*preloads(venv), os.environ.get("LD_PRELOAD", "")]).strip(":"),
        }
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(venv / "bin/python"), "-c", WORKER, args.peer_model, str(max_seqs), str(max_len)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.version = self._reply()["version"]
        self.start_s = time.perf_counter() - started
        started = time.perf_counter()
        self.run([(list(range(100, 100 + args.single_len)), 4)])
        self.warmup_s = time.perf_counter() - started

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(60)
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the vLLM worker exited with status {self.proc.returncode}:\n{tail}")
        return json.loads(line)

    def run(self, workload: Workload) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(workload) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return reply["seconds"], reply["tokens"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def preloads(venv: Path) -> list[str]:
    """What vLLM's CPU install guide preloads for speed, where present: tcmalloc and the venv's Intel OpenMP."""
    found = [ctypes.util.find_library("tcmalloc_minimal") or "", str(venv / "lib/libiomp5.so")]
    return [lib for lib in found if lib and (os.sep not in lib or Path(lib).is_file())]


def peer_venv() -> Path | None:
    folder = os.environ.get("VLLM_VENV")
    if not folder:
        print(
            "vLLM peer skipped: $VLLM_VENV is unset; run the vLLM CPU install script and export the "
            "VLLM_VENV it prints to compare; kvd's figures alone follow"
        )
        return None
    if not (Path(folder) / "bin/python").is_file():
        raise SystemExit(f"$VLLM_VENV={folder} is no virtual environment (no bin/python)")
    return Path(folder)


def kvd_side(args: argparse.Namespace, mode: str, max_seqs: int) -> KvdSide:
    quantization, dtype, kv_dtype = KVD_MODES[mode]
    mode_args = {"quantization": quantization, "dtype": dtype, "kv_cache_dtype": kv_dtype}
    side = KvdSide(argparse.Namespace(**{**vars(args), **mode_args}), max_seqs)
    side.name = f"kvd {mode}"
    return side


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    venv = peer_venv()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    max_in, max_out = (max(int(x) for x in r.split(",")) for r in (args.input_len, args.output_len))
    max_len = max(max_in + max_out, 2 * args.single_len) + 16
    flags = cpu_flags()
    results: dict = {
        "cpu": {"model": cpu_name(), "isa": [f for f in ISA if f in flags]},
        "threads": args.threads,
        "model": args.model,
        "peer_model": args.peer_model if venv else None,
        "kvd": {},
        "workloads": {},
    }
    print(f"CPU: {results['cpu']['model']}; flags {' '.join(results['cpu']['isa'])}; threads {args.threads}")
    peer = VllmSide(args, venv, max(concurrency), max_len) if venv else None
    try:
        if peer:
            results["vllm"] = {"version": peer.version, "start_s": peer.start_s, "warmup_s": peer.warmup_s}
            print(
                f"vLLM {peer.version}: started in {peer.start_s:.1f} s, warm-up request {peer.warmup_s:.1f} s"
            )
        sides: list = [kvd_side(args, mode, max(concurrency)) for mode in args.kvd.split(",")]
        for side in sides:
            info = side.llm.engine.info()
            results["kvd"][side.name] = {
                key: info[key] for key in ("dtype", "quantization", "kv_cache_dtype")
            }
            print(
                f"{side.name}: {info['dtype']}, quantization {info['quantization']}, KV {info['kv_cache_dtype']}"
            )
        kvd_names = [side.name for side in sides]
        sides += [peer] if peer else []

        def record(name: str, figures: dict[str, Figures]) -> None:
            row: dict = {
                side: {k: v for k, v in vars(f).items() if v is not None} for side, f in figures.items()
            }
            if peer:
                row["ratio"] = {
                    side: {k: round(v / row[PEER][k], 2) for k, v in row[side].items()} for side in kvd_names
                }
            results["workloads"][name] = row
            lines = [(side, row[side]) for side in figures]
            lines += [(f"{side} / {PEER}", ratio) for side, ratio in row.get("ratio", {}).items()]
            print(name + "".join(f"\n  {label:<22}" + fmt(values) for label, values in lines), flush=True)

        vocab = sides[0].llm.engine.config.vocab_size
        rng = random.Random(0)
        prompt = [rng.randrange(100, vocab) for _ in range(args.single_len)]
        record(
            "single stream", alternate(sides, args.rounds, lambda side: side.single(prompt, args.single_len))
        )
        for n in concurrency:
            workload = make_workload(n, vocab, args.input_len, args.output_len, seed=0)
            record(
                f"{n} concurrent", alternate(sides, args.rounds, lambda side, w=workload: throughput(side, w))
            )
    finally:
        if peer:
            peer.close()
    if peer and "64 concurrent" in results["workloads"]:
        ratios = results["workloads"]["64 concurrent"]["ratio"]
        for side, goal in TARGETS.items():
            if side in ratios:
                got = ratios[side]["output"]
                print(
                    f"target {side} >= {goal}x vLLM on 64 concurrent: {got}x, {'met' if got >= goal else 'not met'}"
                )
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()

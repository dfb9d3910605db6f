"""Memory and load time of a GGUF file: kvd against llama-server, the two alternating in one run.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python -m benchmarks.gguf_memory --model FILE.gguf
        [--rounds 3] [--context 4096] [--quick] [--json]

kvd: a fresh interpreter imports kvd and torch, then loads the file as `kvd serve` does (kvd.LLM, quantization
auto, a KV pool sized for --context tokens of one sequence); it reports its RSS after the imports (what any
Python process with torch holds), after the load, and its peak (VmHWM), and the load's seconds (imports
excluded; the whole start, imports included, beside it). llama-server: started with one slot of --context
tokens, its RSS and peak read from /proc once it answers /health, its start time to that point. The model's
memory is the RSS the load added less the KV pool (kvd) or the RSS less its KV cache (llama.cpp), against the
file's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.host import bundled_gguf, cpu_name, run_options
from benchmarks.peers import LlamaServerSide, peer_binary

_CHILD = """
import json, sys, time
start = time.perf_counter()

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

import torch
from kvd import LLM
base = status()["VmRSS"]
loading = time.perf_counter()
llm = LLM(sys.argv[1], quantization="auto", max_num_seqs=1, kv_cache_memory=int(sys.argv[2]))
done = time.perf_counter()
after = status()
print(json.dumps({"base": base, "rss": after["VmRSS"], "peak": after["VmHWM"], "load_s": done - loading,
                  "start_s": done - start, "quantization": llm.engine.quantization}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=4096, help="KV tokens of both sides' one sequence")
    run_options(p, "one round, a 256-token KV pool")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.context = 1, 256
    return args


def kv_bytes(model: str, context: int, element_bytes: int) -> int:
    """Bytes of K and V for `context` tokens of every layer (element_bytes 2: llama.cpp's f16 cache)."""
    from kvd.model.gguf_loader import GGUFFile

    meta = GGUFFile(model).metadata
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    return 2 * meta[f"{arch}.block_count"] * context * kv_heads * head_dim * element_bytes


def run_kvd(model: str, pool: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model, str(pool)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_peer(args: argparse.Namespace, binary: Path) -> dict:
    started = time.perf_counter()
    side = LlamaServerSide(args, binary, slots=1, max_len=args.context)
    ready = time.perf_counter() - started
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{side.proc.pid}/status").read_text().splitlines()
    )
    side.close()
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "peak": int(fields["VmHWM"].split()[0]) * 1024,
            "start_s": ready}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.model = args.model or bundled_gguf()
    args.peer_model = args.model
    size = Path(args.model).stat().st_size
    pool = kv_bytes(args.model, args.context, 2)
    binary = peer_binary()
    runs: dict[str, list[dict]] = {"kvd": [], "llama.cpp": []}
    for _ in range(args.rounds):
        runs["kvd"].append(run_kvd(args.model, pool))
        if binary is not None:
            runs["llama.cpp"].append(run_peer(args, binary))

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    mib = 2**20
    result = {"cpu": cpu_name(), "model": args.model, "file_mib": size / mib, "kv_mib": pool / mib}
    kvd_model = median("kvd", "rss") - median("kvd", "base") - pool
    result["kvd"] = {
        "quantization": runs["kvd"][0]["quantization"],
        "imports_rss_mib": median("kvd", "base") / mib,
        "rss_mib": median("kvd", "rss") / mib,
        "peak_mib": median("kvd", "peak") / mib,
        "peak_over_rss_mib": (median("kvd", "peak") - median("kvd", "rss")) / mib,
        "model_mib": kvd_model / mib,
        "model_over_file": kvd_model / size,
        "load_s": median("kvd", "load_s"),
        "start_s": median("kvd", "start_s"),
    }
    print(f"{cpu_name()}: {Path(args.model).name}, {size / mib:.1f} MiB; KV pool {pool / mib:.1f} MiB (both)")
    k = result["kvd"]
    print(
        f"kvd ({k['quantization']}): RSS {k['rss_mib']:.0f} MiB (imports {k['imports_rss_mib']:.0f}, peak "
        f"{k['peak_mib']:.0f}); model {k['model_mib']:.1f} MiB = {k['model_over_file']:.2f}x the file; load "
        f"{k['load_s']:.2f} s (start with imports {k['start_s']:.2f} s)"
    )
    if runs["llama.cpp"]:
        peer_model = median("llama.cpp", "rss") - pool
        result["llama.cpp"] = {
            "rss_mib": median("llama.cpp", "rss") / mib,
            "peak_mib": median("llama.cpp", "peak") / mib,
            "model_mib": peer_model / mib,
            "model_over_file": peer_model / size,
            "start_s": median("llama.cpp", "start_s"),
        }
        p = result["llama.cpp"]
        print(
            f"llama.cpp: RSS {p['rss_mib']:.0f} MiB (peak {p['peak_mib']:.0f}); model {p['model_mib']:.1f} MiB "
            f"= {p['model_over_file']:.2f}x the file; start to /health {p['start_s']:.2f} s"
        )
        result["load_ratio"] = k["load_s"] / p["start_s"]
        print(f"kvd's load / llama-server's start: {result['load_ratio']:.2f}")
    else:
        print("llama.cpp: skipped (set LLAMA_CPP_BIN to its build/bin folder)")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

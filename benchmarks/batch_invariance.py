"""What batch invariance costs: the same workloads with it on (the default) and off (--no-batch-invariance),
alternating in one process, for each (dtype, quantization) asked for.

    python -m benchmarks.batch_invariance [--modes auto:auto,float32:none,bfloat16:none] [--rounds 2] [--json]

Workloads on the bundled SmolLM2 (or --model): throughput (random prompts and outputs, as benchmarks.throughput,
all submitted at once), single-stream decode (one 128-token prompt, 128 tokens out) and prefill (one prompt of
--prefill-len tokens, one token out). Each figure is the best of --rounds; the ratio is on / off (1.0 = free).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from benchmarks.throughput import make_workload, run_kvd
from kvd import LLM, SamplingParams
from kvd.model.cpu_dtype import cpu_flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--modes", default="auto:auto,float32:none,bfloat16:none", help="dtype:quantization,...")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", default="64,256", help="min,max prompt tokens of the throughput workload")
    p.add_argument("--output-len", default="16,128", help="min,max output tokens of the throughput workload")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="alternate on and off this many times")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON list last")
    return p.parse_args(argv)


def single_stream(llm: LLM, vocab: int) -> float:
    """Decode tokens/s of one request: 128 prompt tokens, 128 out (the prefill's time taken off)."""
    prompt = [100 + (i * 37) % (vocab - 100) for i in range(128)]
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    return 127 / (time.perf_counter() - started - prefill_s)


def prefill(llm: LLM, vocab: int, length: int) -> float:
    """Prompt tokens/s of one prompt of `length` tokens (nothing cached)."""
    prompt = [100 + (i * 53) % (vocab - 100) for i in range(length)]
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return length / (time.perf_counter() - started)


def measure(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    vocab = llm.engine.config.vocab_size
    workload = make_workload(args.num_requests, vocab, args.input_len, args.output_len, seed=0)
    return {
        "throughput_tok_s": run_kvd(llm, workload),
        "single_stream_tok_s": single_stream(llm, vocab),
        "prefill_tok_s": prefill(llm, vocab, args.prefill_len),
    }


def run_mode(args: argparse.Namespace, dtype: str, quantization: str) -> dict:
    # No prefix cache: the rounds repeat the same prompts, and each must compute them.
    engines = {
        on: LLM(
            args.model,
            dtype=dtype,
            quantization=quantization,
            batch_invariant=on,
            enable_prefix_caching=False,
            kv_cache_memory="512M",
            max_num_seqs=64,
        )
        for on in (True, False)
    }
    for llm in engines.values():  # warm-up: first-use costs stay out of the timings
        llm.generate([[100] * 80], SamplingParams(max_tokens=4), use_tqdm=False)
    best: dict[bool, dict[str, float]] = {True: {}, False: {}}
    for _ in range(args.rounds):
        for on, llm in engines.items():
            for name, value in measure(llm, args).items():
                best[on][name] = max(value, best[on].get(name, 0.0))
    info = engines[True].engine.info()
    row = {"dtype": info["dtype"], "quantization": info["quantization"]}
    for name in best[True]:
        row[name] = {
            "on": round(best[True][name], 1),
            "off": round(best[False][name], 1),
            "ratio": round(best[True][name] / best[False][name], 3),
        }
    del engines
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    print(f"CPU flags: {' '.join(isa)}; threads {torch.get_num_threads()}")
    rows = []
    for mode in args.modes.split(","):
        dtype, quantization = mode.split(":")
        row = run_mode(args, dtype, quantization)
        rows.append(row)
        for name in ("throughput_tok_s", "single_stream_tok_s", "prefill_tok_s"):
            r = row[name]
            print(
                f"{row['dtype']:8s} {row['quantization']:4s} {name:20s} on {r['on']:8.1f}  off {r['off']:8.1f}"
                f"  on/off {r['ratio']:.3f}"
            )
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()

"""Offline throughput: kvd's continuous batching against transformers' static-batch `generate`, same prompts.

    python -m benchmarks.throughput [--model PATH] [--dtype bfloat16] [--num-requests 64] [--json]

A nano-vllm-style workload scaled for a CPU: random prompts of 64-512 tokens and outputs of 32-256 tokens
(ignore_eos), fixed seed. transformers runs the same prompts in static batches of --hf-batch-size (left padded;
each batch generates until its longest output, and only the requested tokens count). Both sides use the same
weights, dtype and threads, in this one process, alternating when --rounds > 1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvd import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="folder, .gguf or hub id (default: the bundled SmolLM2-135M)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", default="64,512", help="min,max prompt tokens")
    p.add_argument("--output-len", default="32,256", help="min,max output tokens")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=1, help="alternate kvd and transformers this many times")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads for both sides (default: all cores)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p.parse_args(argv)


def make_workload(
    n: int, vocab: int, input_len: str, output_len: str, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lo_in, hi_in = map(int, input_len.split(","))
    lo_out, hi_out = map(int, output_len.split(","))
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(lo_in, hi_in))], rng.randint(lo_out, hi_out))
        for _ in range(n)
    ]


def run_kvd(llm: LLM, workload: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    started = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.token_ids) for o in outs)
    if produced != sum(n for _, n in workload):
        raise RuntimeError(f"kvd produced {produced} tokens, expected {sum(n for _, n in workload)}")
    return produced / elapsed


def load_transformers(model: str | None, dtype: torch.dtype):
    """transformers' own load of the same checkpoint (its GGUF path for a .gguf file)."""
    from transformers import AutoModelForCausalLM

    from kvd.model.hub import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@torch.inference_mode()
def run_transformers(model, workload: list[tuple[list[int], int]], batch_size: int) -> float:
    produced = 0
    started = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(n for _, n in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        produced += sum(n for _, n in batch)
    return produced / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=2 * 2**30,
    )
    workload = make_workload(
        args.num_requests, llm.engine.config.vocab_size, args.input_len, args.output_len, args.seed
    )
    hf = None if args.skip_transformers else load_transformers(args.model, llm.engine.dtype)
    kvd_runs, hf_runs = [], []
    for _ in range(args.rounds):
        kvd_runs.append(run_kvd(llm, workload))
        print(f"kvd:          {kvd_runs[-1]:8.1f} output tok/s", flush=True)
        if hf is not None:
            hf_runs.append(run_transformers(hf, workload, args.hf_batch_size))
            print(f"transformers: {hf_runs[-1]:8.1f} output tok/s", flush=True)
    result = {
        "kvd_tok_s": round(statistics.median(kvd_runs), 1),
        "transformers_tok_s": round(statistics.median(hf_runs), 1) if hf_runs else None,
        "ratio": round(statistics.median(kvd_runs) / statistics.median(hf_runs), 2) if hf_runs else None,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "threads": torch.get_num_threads(),
        "step_overhead_fraction": round(llm.engine.metrics.summary()["step_overhead_fraction"], 3),
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k:24s} {v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()

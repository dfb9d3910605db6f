"""Tensor parallel: TP=1 vs TP=2 on this host, decode and prefill steps of the bundled SmolLM2 (or --model).

    python -m benchmarks.tensor_parallel [--model PATH] [--quantization none|auto] [--batch 1 8] [--steps 32]
        [--device cpu|cuda] [--check] [--json]

--check: exit 1 unless TP=2's greedy tokens are TP=1's (benchmarks/gpu_check.sh runs it on two GPUs).

TP=1 runs with every core, TP=2 with half of them per rank (--cpu-binding auto, or none: the OS places them),
so both use the same cores.
On a host whose ranks share one memory bus, TP buys no bandwidth: the figure that matters is what the group
costs per step, rank 0's time inside collectives (step broadcast, two all-reduces per layer, the embedding's,
the logits gather) with their count and bytes, and the weight bytes each rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvd.distributed import comm
from kvd.engine.llm_engine import LLMEngine
from kvd.request.sampling_params import SamplingParams


def measure(
    model: str | None,
    tp: int,
    quantization: str,
    batch: int,
    steps: int,
    prompt_len: int,
    device: str,
    cpu_binding: str,
) -> dict:
    cores = len(os.sched_getaffinity(0))
    engine = LLMEngine(
        model=model,
        device=device,
        cpu_binding=cpu_binding,
        dtype="float32",
        quantization=quantization,
        kv_cache_memory="256M",
        tensor_parallel_size=tp,
        num_threads=max(1, cores // tp),
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request(i, [(7 * i + j) % 1000 + 10 for j in range(prompt_len)], params)
        started = time.perf_counter()
        tokens: dict[int, list[int]] = {i: [] for i in range(batch)}

        def step() -> None:
            for out in engine.step().outputs:
                tokens[out.request_id] += out.new_token_ids

        step()  # the prefill of every prompt, in one step (prompt_len * batch <= the token budget)
        prefill_s = time.perf_counter() - started
        before = comm.CommStats(comm.STATS.calls, comm.STATS.seconds, comm.STATS.bytes)
        started = time.perf_counter()
        for _ in range(steps):
            step()
        decode_s = time.perf_counter() - started
        info = engine.info()
    finally:
        engine.close()
    ranks = info["tensor_parallel"]["ranks"] if info["tensor_parallel"] else [info]
    return {
        "tp": tp,
        "batch": batch,
        "threads_per_rank": [r["threads"] for r in ranks],
        "prefill_ms": prefill_s * 1e3,
        "decode_step_ms": decode_s / steps * 1e3,
        "collectives_per_step": (comm.STATS.calls - before.calls) / steps,
        "comm_ms_per_step": (comm.STATS.seconds - before.seconds) / steps * 1e3,
        "comm_kib_per_step": (comm.STATS.bytes - before.bytes) / steps / 1024,
        "weight_mib_per_rank": [r["weight_bytes"] / 2**20 for r in ranks],
        "tokens": [tokens[i] for i in range(batch)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-binding", default="auto", help="each TP=2 rank's cores (auto: half each)")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [
        measure(
            args.model,
            tp,
            args.quantization,
            batch,
            args.steps,
            args.prompt_len,
            args.device,
            args.cpu_binding,
        )
        for batch in args.batch
        for tp in (1, 2)
    ]
    same = all(rows[i]["tokens"] == rows[i + 1]["tokens"] for i in range(0, len(rows), 2))
    for r in rows:
        del r["tokens"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'TP':>2} {'batch':>5} {'threads':>8} {'prefill ms':>10} {'step ms':>8} {'coll/step':>9} "
          f"{'comm ms/step':>12} {'comm KiB/step':>13}  weights MiB per rank")  # fmt: skip
    for r in rows:
        print(
            f"{r['tp']:>2} {r['batch']:>5} {'+'.join(map(str, r['threads_per_rank'])):>8} "
            f"{r['prefill_ms']:>10.1f} {r['decode_step_ms']:>8.2f} {r['collectives_per_step']:>9.0f} "
            f"{r['comm_ms_per_step']:>12.2f} {r['comm_kib_per_step']:>13.1f}  "
            + " / ".join(f"{w:.1f}" for w in r["weight_mib_per_rank"])
        )
    print(f"greedy tokens TP=2 vs TP=1: {'identical' if same else 'DIFFERENT'}")
    if args.check and not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

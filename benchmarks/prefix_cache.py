"""Prefix caching on a shared system prompt: prefill tokens computed and time to first token, cache on vs off.

    python -m benchmarks.prefix_cache [--model PATH] [--num-requests 32] [--system-tokens 1024] [--json]

Requests share a --system-tokens system prompt and each adds a distinct --question-tokens question. They arrive
one after another, each as soon as the previous one has its first token (earlier ones keep decoding meanwhile),
which is how clients of a daemon trickle in. Two engines on the same weights, cache on and cache off, run the
same arrivals alternately in this one process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvd.engine.llm_engine import LLMEngine
from kvd.request.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p.parse_args(argv)


def workload(vocab: int, n: int, system_tokens: int, question_tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(100, vocab) for _ in range(system_tokens)]
    return [system + [rng.randrange(100, vocab) for _ in range(question_tokens)] for _ in range(n)]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Mean time to first token (s) and prompt tokens computed for one pass of arrivals."""
    engine.block_manager.reset_prefix_cache()
    computed_before = engine.metrics.num_prefill_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts = []
    for i, prompt in enumerate(prompts):
        started = time.perf_counter()
        engine.add_request(i, prompt, params)
        first = False
        while not first:
            first = any(o.request_id == i for o in engine.step().outputs)
        ttfts.append(time.perf_counter() - started)
    while engine.has_unfinished():
        engine.step()
    return statistics.mean(ttfts), engine.metrics.num_prefill_tokens - computed_before


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    common = dict(model=args.model, dtype=args.dtype, kv_cache_memory=2**30, max_num_batched_tokens=2048)
    cached = LLMEngine(enable_prefix_caching=True, **common)
    uncached = LLMEngine(enable_prefix_caching=False, **common)
    prompts = workload(cached.config.vocab_size, args.num_requests, args.system_tokens, args.question_tokens)
    on, off = [], []
    for _ in range(args.rounds):
        on.append(run(cached, prompts, args.max_tokens))
        off.append(run(uncached, prompts, args.max_tokens))
        print(f"cache on:  ttft {on[-1][0] * 1e3:8.1f} ms  prefill tokens {on[-1][1]}", flush=True)
        print(f"cache off: ttft {off[-1][0] * 1e3:8.1f} ms  prefill tokens {off[-1][1]}", flush=True)
    ttft_on = statistics.median(t for t, _ in on)
    ttft_off = statistics.median(t for t, _ in off)
    stats = cached.block_manager.prefix_cache_stats()
    result = {
        "prefill_tokens_ratio": round(on[-1][1] / off[-1][1], 4),
        "ttft_ratio": round(ttft_on / ttft_off, 4),
        "hit_rate": round(stats.hit_rate, 4),
        "ttft_ms_cached": round(ttft_on * 1e3, 1),
        "ttft_ms_uncached": round(ttft_off * 1e3, 1),
        "prefill_tokens_cached": on[-1][1],
        "prefill_tokens_uncached": off[-1][1],
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k:24s} {v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()

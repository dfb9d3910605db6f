"""Prefix caching on a model with linear-attention layers (Qwen3.5): a multi-turn conversation's time to first
token with state checkpoints and without, and what a checkpoint costs per cached token.

    python -m benchmarks.hybrid_prefix --model FILE.gguf|DIR [--turns 6] [--turn-tokens 96] [--first-tokens 512]
        [--answer-tokens 32] [--interval 4] [--threads N] [--quick] [--json]

Each turn sends the whole conversation so far (the previous turns' prompts and answers) and a new user message of
--turn-tokens, as chat clients do; --first-tokens open it. Two engines on the same weights, checkpoints on
(--state-checkpoint-interval blocks) and off (no prefix is read: a recurrent state cannot be rebuilt from K/V),
run each turn alternately in this one process; their answers are checked equal.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.host import cpu_name, run_options
from kvd.engine.llm_engine import LLMEngine
from kvd.model.layers.kv_cache import kv_cache_bytes_per_block
from kvd.request.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Qwen3.5 checkpoint or GGUF file")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-tokens", type=int, default=512)
    p.add_argument("--turn-tokens", type=int, default=96)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--interval", type=int, default=4, help="blocks between checkpoints")
    run_options(p, "3 short turns, a checkpoint every block")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.first_tokens, args.turn_tokens, args.answer_tokens, args.interval = 3, 64, 16, 4, 1
    return args


def _engine(args: argparse.Namespace, checkpoints: int | None) -> LLMEngine:
    return LLMEngine(
        model=args.model,
        kv_cache_memory=2**31,
        max_num_seqs=4,
        state_checkpoints=checkpoints,
        state_checkpoint_interval=args.interval,
    )


def _turn(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> tuple[float, list[int]]:
    """(seconds to the first token, the answer's tokens)."""
    start, first = time.perf_counter(), None
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            tokens += out.new_token_ids
    return first or 0.0, tokens


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {"checkpoints": _engine(args, None), "none": _engine(args, 0)}
    vocab = engines["none"].config.vocab_size
    rng = random.Random(0)

    def message(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    conversation = message(args.first_tokens)
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    for turn in range(args.turns):
        answers = {}
        for name, engine in engines.items():
            seconds, answers[name] = _turn(engine, conversation, params, f"{name}-{turn}")
            ttft[name].append(seconds)
        if answers["checkpoints"] != answers["none"]:
            raise SystemExit(f"turn {turn}: the answers differ with and without checkpoints")
        conversation = conversation + answers["none"] + message(args.turn_tokens)
    info = engines["checkpoints"].info()
    state = info["recurrent_state"]
    engine = engines["checkpoints"]
    per_block = kv_cache_bytes_per_block(engine.runner.model.config, info["block_size"], engine.kv_dtype)
    kv_bytes_per_token = per_block / info["block_size"]
    later = {name: statistics.mean(times[1:]) for name, times in ttft.items()}  # turn 0 has nothing cached
    result = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "model": info["model"],
        "turns": args.turns,
        "ttft_s": {name: [round(t, 4) for t in times] for name, times in ttft.items()},
        "ttft_later_turns_s": later,
        "speedup": later["none"] / later["checkpoints"],
        "hit_tokens": engines["checkpoints"].stats()["prefix_cache"]["hit_tokens"],
        "checkpoint_bytes": state["bytes_per_slot"],
        "checkpoint_interval_tokens": state["checkpoint_interval_tokens"],
        "checkpoint_bytes_per_cached_token": state["bytes_per_slot"] / state["checkpoint_interval_tokens"],
        "kv_bytes_per_token": kv_bytes_per_token,
    }
    print(f"{result['cpu']}, {args.threads} threads, {info['model']}")
    print(
        f"TTFT of turns 2..{args.turns}: {later['checkpoints'] * 1e3:.0f} ms with checkpoints, "
        f"{later['none'] * 1e3:.0f} ms without ({result['speedup']:.2f}x); {result['hit_tokens']} tokens hit"
    )
    print(
        f"a checkpoint: {state['bytes_per_slot'] / 2**20:.1f} MiB every {state['checkpoint_interval_tokens']} "
        f"tokens = {result['checkpoint_bytes_per_cached_token'] / 1024:.1f} KiB per cached token "
        f"(K/V: {kv_bytes_per_token / 1024:.1f} KiB per token)"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

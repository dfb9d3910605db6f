"""Speculative decoding: single-stream decode on input-grounded prompts and on free prose, kvd with n-gram
drafts against kvd without, and against llama-server with its n-gram speculation on the same GGUF, in one run.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python -m benchmarks.speculative [--model FILE.gguf]
        [--rounds 3] [--max-tokens 300] [--concurrency 16] [--sweep 1,2,4,8] [--quick] [--json]

Each prompt (benchmarks.grounded_prompts: edit a function, answer from a passage, rewrite a paragraph; free
prose) is a chat, greedy, until the model stops or --max-tokens. Sides, alternating per round: kvd drafting,
kvd not drafting (the same engine, the request's `speculative: false`), llama-server with `--spec-type
ngram-simple` (its n-gram drafts, its defaults) and llama-server plain; llama-server is started for its turn
and stopped after, so nothing else runs while a side is timed. Figures: decode tok/s after the first token
(kvd: the whole request less a one-token request's time; llama-server: its own `predicted_per_second`), the
medians over the rounds, and kvd's drafted output checked equal to its plain output token for token.

Then --concurrency requests (the four prompts in turn) at once, kvd drafting against kvd not: output tok/s
(above --speculative-max-seqs decodes a step drafts nothing, so this shows what that costs); and --sweep: the
same with drafts at every batch size, which is where the default of --speculative-max-seqs comes from.
Without $LLAMA_CPP_BIN the peer is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.grounded_prompts import GROUNDED, PROMPTS
from benchmarks.host import bundled_gguf, cpu_name, run_options
from benchmarks.peers import LlamaServerSide, peer_binary
from kvd import LLM
from kvd.request.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument(
        "--speculative-tokens", type=int, default=None, help="kvd's draft length (default: its own)"
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sweep", default="1,2,4,8", help="batch sizes drafted at regardless of the default")
    run_options(p, "one round, 48 tokens, concurrency 4, sweep 1,2")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens, args.concurrency, args.sweep = 1, 48, 4, "1,2"
    args.model = args.model or bundled_gguf()
    return args


class KvdSide:
    """One engine drafting; a request's `speculative` field picks the side."""

    def __init__(self, args: argparse.Namespace) -> None:
        extra = {} if args.speculative_tokens is None else {"speculative_tokens": args.speculative_tokens}
        self.llm = LLM(
            args.model, speculative="ngram", num_threads=args.threads, kv_cache_memory="1G", **extra
        )
        self.engine = self.llm.engine

    def params(self, n: int, speculative: bool) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, speculative=speculative)

    def run(self, prompts: list[list[int]], n: int, speculative: bool) -> tuple[float, list[list[int]]]:
        """(seconds, each output's tokens) for the prompts submitted at once, from an empty prefix cache."""
        self.engine.block_manager.reset_prefix_cache()
        started = time.perf_counter()
        outs = self.llm.generate(prompts, self.params(n, speculative), use_tqdm=False)
        return time.perf_counter() - started, [o.token_ids for o in outs]

    def decode_rate(self, prompt: list[int], n: int, speculative: bool) -> tuple[float, list[int]]:
        first, _ = self.run([prompt], 1, speculative)
        total, (tokens,) = self.run([prompt], n, speculative)
        return (len(tokens) - 1) / (total - first), tokens


def llama_rate(args: argparse.Namespace, binary, prompt: list[int], spec: bool) -> tuple[float, int]:
    """llama-server's decode tok/s and output length for one greedy request, started for it and stopped."""
    extra = ["--spec-type", "ngram-simple"] if spec else []
    server = LlamaServerSide(args, binary, 1, len(prompt) + args.max_tokens + 16, extra)
    try:
        body = server.request({"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0.0})
    finally:
        server.close()
    return body["timings"]["predicted_per_second"], body["tokens_predicted"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.peer_model = args.model
    binary = peer_binary()
    kvd = KvdSide(args)
    info = kvd.engine.info()
    print(f"CPU: {cpu_name()}; threads {args.threads}; kvd {info['dtype']} {info['quantization']}")
    print(
        f"kvd speculative: {info['speculative']}; peer: {'llama-server ngram-simple' if binary else 'skipped'}"
    )
    chats = {
        name: kvd.engine.apply_chat_template([{"role": "user", "content": text}])
        for name, text in PROMPTS.items()
    }
    kvd.run([chats["free prose"]], 4, True)  # warm-up: first-use costs land in no figure
    results: dict = {"cpu": cpu_name(), "threads": args.threads, "model": args.model, "prompts": {}}
    for name, prompt in chats.items():
        runs: dict[str, list[float]] = {"kvd": [], "kvd plain": [], "llama.cpp": [], "llama.cpp plain": []}
        lengths: dict[str, int] = {}
        for _ in range(args.rounds):
            rate, drafted = kvd.decode_rate(prompt, args.max_tokens, True)
            runs["kvd"].append(rate)
            rate, plain = kvd.decode_rate(prompt, args.max_tokens, False)
            runs["kvd plain"].append(rate)
            if drafted != plain:
                raise RuntimeError(f"{name}: kvd's output with drafts differs from its output without")
            lengths["kvd"] = len(plain)
            if binary:
                for side, spec in (("llama.cpp", True), ("llama.cpp plain", False)):
                    rate, lengths[side] = llama_rate(args, binary, prompt, spec)
                    runs[side].append(rate)
        row = {side: round(statistics.median(r), 1) for side, r in runs.items() if r}
        row["tokens"] = lengths
        row["speedup"] = round(row["kvd"] / row["kvd plain"], 2)
        if binary:
            row["vs llama.cpp ngram"] = round(row["kvd"] / row["llama.cpp"], 2)
            row["llama.cpp speedup"] = round(row["llama.cpp"] / row["llama.cpp plain"], 2)
        row["grounded"] = name in GROUNDED
        results["prompts"][name] = row
        print(f"{name:<22} {json.dumps(row)}", flush=True)
    prompts = list(chats.values())
    for n in sorted({args.concurrency, *(int(c) for c in args.sweep.split(","))}):
        batch = [prompts[i % len(prompts)] for i in range(n)]
        default = kvd.engine.scheduler.max_drafting_seqs
        if n != args.concurrency:  # the sweep: drafts at this batch size whatever the default says
            kvd.engine.scheduler.max_drafting_seqs = n
        rates: dict[str, list[float]] = {"drafting": [], "plain": []}
        for _ in range(args.rounds):
            for side, spec in (("drafting", True), ("plain", False)):
                seconds, outs = kvd.run(batch, args.max_tokens, spec)
                rates[side].append(sum(map(len, outs)) / seconds)
        kvd.engine.scheduler.max_drafting_seqs = default
        row = {side: round(statistics.median(r), 1) for side, r in rates.items()}
        row["ratio"] = round(row["drafting"] / row["plain"], 2)
        key = f"{n} concurrent" + ("" if n == args.concurrency else " (drafting forced)")
        results[key] = row
        print(f"{key:<34} output tok/s {json.dumps(row)}", flush=True)
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()

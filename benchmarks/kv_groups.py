"""The KV pool a long conversation holds: a sliding-window model's layers in KV groups against every layer full.

    python -m benchmarks.kv_groups [--model FILE.gguf] [--tokens 8192] [--quick] [--json]

One conversation of --tokens tokens (chat turns, as a client sends them) prefilled in chunks and decoded for 32
tokens on the Gemma 3 270M file (default; five sliding layers of window 512 to every full one). After every
step the engine's stats give the blocks each KV group holds; the figure is the most the pool held, in bytes and
in bytes a token, against what the same tokens cost with every layer keeping every token (the pool without
groups: one block per block_size tokens, each holding all the layers).
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.host import cpu_name, run_options
from benchmarks.real_models import GEMMA3_270M, model_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or folder (default: the Gemma 3 270M file)")
    p.add_argument("--tokens", type=int, default=8192, help="the conversation's length in tokens")
    run_options(p, "a 1024-token conversation")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = 1024
    args.model = args.model or str(model_path(GEMMA3_270M))
    return args


def conversation(llm, num_tokens: int) -> list[int]:
    """Chat turns until the rendered conversation reaches num_tokens tokens (then cut to that many)."""
    messages: list[dict] = []
    turn = 0
    while True:
        turn += 1
        messages += [
            {"role": "user", "content": f"Question {turn}: how do paged KV caches share prefixes? " * 4},
            {
                "role": "assistant",
                "content": f"Answer {turn}: by reference-counted blocks keyed by content. " * 6,
            },
        ]
        tokens = llm.engine.apply_chat_template(messages)
        if len(tokens) >= num_tokens:
            return tokens[:num_tokens]


def measure(args: argparse.Namespace) -> dict:
    import torch

    from kvd import LLM, SamplingParams
    from kvd.model.layers.kv_cache import kv_cache_bytes_per_block

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, quantization="auto", max_num_seqs=1, max_model_len=args.tokens + 64)
    engine = llm.engine
    prompt = conversation(llm, args.tokens)
    engine.add_request(
        "conversation", prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    )
    peak, held = 0, []
    while engine.has_unfinished():
        engine.step()
        groups = [g["used_blocks"] for g in engine.stats()["kv_cache"]["groups"]]
        if sum(groups) > peak:
            peak, held = sum(groups), groups
    model = engine.runner.model
    block_bytes = kv_cache_bytes_per_block(model.config, engine.args.block_size, engine.kv_dtype)
    tokens = len(prompt) + 32
    # Without groups every block holds all the layers: num_groups group-blocks' bytes a block of tokens.
    full_bytes = -(-tokens // engine.args.block_size) * block_bytes * model.kv_groups.num_groups
    return {
        "cpu": cpu_name(),
        "model": os.path.basename(args.model),
        "tokens": tokens,
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "groups": engine.info()["kv_groups"],
        "blocks_held": held,
        "grouped_mib": peak * block_bytes / 2**20,
        "all_full_mib": full_bytes / 2**20,
        "grouped_bytes_per_token": peak * block_bytes / tokens,
        "all_full_bytes_per_token": full_bytes / tokens,
        "saving": full_bytes / (peak * block_bytes),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = measure(args)
    print(
        f"{result['cpu']}: {result['model']}, a {result['tokens']}-token conversation, {result['kv_cache_dtype']}"
    )
    print(f"  KV groups: {result['groups']}; blocks held at the peak, per group: {result['blocks_held']}")
    print(
        f"  in groups     {result['grouped_mib']:8.1f} MiB  {result['grouped_bytes_per_token']:8.0f} bytes a token"
    )
    print(
        f"  all full      {result['all_full_mib']:8.1f} MiB  {result['all_full_bytes_per_token']:8.0f} bytes a token"
    )
    print(f"  all full / in groups: {result['saving']:.2f}x")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

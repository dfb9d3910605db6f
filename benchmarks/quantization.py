"""What each --quantization costs and keeps on one GGUF file: weight memory, single-stream speed, and how long
greedy output stays equal to the dequantized float model's.

    python -m benchmarks.quantization [--model FILE.gguf] [--tokens 48] [--threads N] [--dtype auto] [--json]

Each mode loads the model anew and generates --tokens greedy tokens (ignore_eos) for four prompts, one at a
time; tok/s is decode speed after each prompt's first token. "agree" counts, per prompt, the tokens equal to
the `none` run's before the first difference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from benchmarks.gpu_bench import shared_prefix
from benchmarks.host import bundled_gguf
from kvd import LLM
from kvd.model.layers.quantized_linear import linear_weight_bytes
from kvd.request.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "List three uses of a paperclip:",
]
MODES = ("none", "int8", "int4")


def run_mode(model: str, mode: str, tokens: int, threads: int, dtype: str) -> dict:
    llm = LLM(model, dtype=dtype, quantization=mode, num_threads=threads, kv_cache_memory="256M")
    mib = linear_weight_bytes(llm.engine.runner.model) / 2**20
    llm_dtype = llm.engine.dtype
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    outputs, decode_seconds = [], 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        decode_seconds += time.perf_counter() - start - first
    del llm
    gc.collect()
    tok_s = len(PROMPTS) * (tokens - 1) / decode_seconds
    return {
        "quantization": mode,
        "dtype": str(llm_dtype).removeprefix("torch."),
        "linear_weights_mib": round(mib, 1),
        "tok_s": round(tok_s, 1),
        "tokens": outputs,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", default="auto", help="activations and unquantized weights (%(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON list last")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        run_mode(args.model or bundled_gguf(), mode, args.tokens, args.threads, args.dtype) for mode in MODES
    ]
    reference = rows[0]["tokens"]
    for row in rows:
        row["agree"] = [shared_prefix(t, r) for t, r in zip(row.pop("tokens"), reference, strict=True)]
        print(
            f"{row['quantization']:5s} linear weights {row['linear_weights_mib']:6.1f} MiB  "
            f"{row['tok_s']:6.1f} tok/s  greedy tokens equal to none: {row['agree']}"
        )
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()

"""Forward-pass throughput: kvd's CausalLM over the paged pool vs transformers with DynamicCache, same weights.

    python -m benchmarks.forward [--dtype float32|bfloat16] [--quantization none|int8|int4] [--model PATH]
        [--threads N] [--json] [--quick]

Prefill: B prompts of L tokens in one batch, logits for the last token of each (tokens/s = B*L / time).
Decode: one step for B sequences that each hold C tokens of context (tokens/s = B / time); both sides start
from a KV cache filled with random values, since attention cost does not depend on them.
The two sides run alternately, shape by shape, in this one process; the machine may be shared, so compare
the ratio rather than absolute figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from kvd.model.config import ModelConfig
from kvd.model.decoder import CausalLM
from kvd.model.layers.attention import build_attention_metadata
from kvd.model.layers.attention.selector import select_attention_backend
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.layers.quantized_linear import quantize_model

# SmolLM2-135M's architecture, with random weights (nothing to download).
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
PREFILL_SHAPES = [(1, 128), (4, 256), (1, 1024)]
DECODE_BATCHES = [1, 8, 32, 128]
DECODE_CONTEXTS = [128, 512, 1024]
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--model", help="checkpoint folder or .gguf (default: random SmolLM2-135M-shaped model)"
    )
    parser.add_argument(
        "--quantization",
        choices=["none", "int8", "int4"],
        default="none",
        help="kvd's decoder weights (and an int8 output projection), as `kvd serve --quantization`",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape and side (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes: a smoke run")
    return parser.parse_args(argv)


def build_models(args: argparse.Namespace, dtype: torch.dtype):
    """(kvd model, transformers model) holding the same weights."""
    import transformers

    if args.model:
        from kvd.model.loader import load_model

        loaded = load_model(args.model, dtype=dtype, attention_backend="auto")
        folder, gguf = (os.path.dirname(args.model), os.path.basename(args.model))
        if args.model.endswith(".gguf"):
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype)
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        return loaded.model, hf.eval()
    hf_config = transformers.LlamaConfig(**(TINY if args.quick else SMOLLM2_135M))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # kvd's own pick for this host (auto: the native backend on a CPU that built its kernels).
    backend = select_attention_backend("auto", "cpu", dtype).backend
    ours = CausalLM(ModelConfig.from_hf_dict(hf_config.to_dict()), backend)
    ours.load_weights(hf.state_dict().items())
    return ours.to(dtype).eval(), hf.to(dtype).eval()


def alternate(ours: Callable[[], object], hf: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of each side, timed turn about so that load from other processes hits both alike."""
    ours()  # warm-up
    hf()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, acc in zip((ours, hf), times, strict=True):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


class PagedBatch:
    """B sequences of equal context in a fresh pool, blocks scattered as after a while of serving."""

    def __init__(self, model: CausalLM, batch: int, context: int, extra_tokens: int) -> None:
        blocks_per_seq = -(-(context + extra_tokens) // BLOCK_SIZE)
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_cache(model.config, batch * blocks_per_seq, BLOCK_SIZE, dtype, "cpu")
        model.bind_kv_cache(self.kv_caches)
        self.model = model
        self.tables = torch.randperm(batch * blocks_per_seq).view(batch, blocks_per_seq).tolist()
        self.lens = [0] * batch

    def reset(self, context: int = 0) -> None:
        """Make every sequence hold `context` tokens (random K/V stand in for a real prompt's)."""
        if context:
            for cache in self.kv_caches:
                cache.normal_()
        self.lens = [context] * len(self.lens)

    def release(self) -> None:
        """Drop the pool (the model keeps a one-block placeholder) so the other side gets the memory."""
        model = self.model
        model.bind_kv_cache(allocate_kv_cache(model.config, 1, BLOCK_SIZE, self.kv_caches[0].dtype, "cpu"))
        self.kv_caches = []
        gc.collect()

    def step(self, tokens_per_seq: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each sequence's last new token; `ids` [batch, tokens_per_seq] or random ones."""
        batch = len(self.lens)
        if ids is None:
            ids = torch.randint(0, self.model.config.vocab_size, (batch, tokens_per_seq))
        ids = ids.reshape(-1)
        positions = torch.cat([torch.arange(n, n + tokens_per_seq) for n in self.lens])
        self.lens = [n + tokens_per_seq for n in self.lens]
        attn = build_attention_metadata(
            self.tables, self.lens, [tokens_per_seq] * batch, BLOCK_SIZE, "cpu", self.model.attention_backend
        )
        hidden = self.model(ids, positions, attn)
        last_rows = torch.arange(tokens_per_seq - 1, batch * tokens_per_seq, tokens_per_seq)
        return self.model.compute_logits(hidden[last_rows])


def bench_prefill(ours: CausalLM, hf, batch: int, length: int, repeats: int) -> tuple[float, float, float]:
    """Tokens/s of each side for `batch` fresh prompts of `length` tokens, and the largest difference of
    their last-token logits (the two sides must compute the same thing for the ratio to mean anything)."""
    paged = PagedBatch(ours, batch, length, 0)
    ids = torch.randint(0, ours.config.vocab_size, (batch, length))

    def run_ours() -> torch.Tensor:
        paged.reset()
        return paged.step(length, ids)

    def run_hf() -> torch.Tensor:
        return hf(ids, use_cache=True, logits_to_keep=1).logits[:, -1].float()

    ours_t, hf_t = alternate(run_ours, run_hf, repeats)
    logit_diff = (run_ours() - run_hf()).abs().max().item()
    paged.release()
    return batch * length / ours_t, batch * length / hf_t, logit_diff


def bench_decode(ours: CausalLM, hf, batch: int, context: int, repeats: int) -> tuple[float, float, None]:
    """Tokens/s of each side for one decode step of `batch` sequences holding `context` tokens each."""
    from transformers import DynamicCache

    paged = PagedBatch(ours, batch, context, repeats + 2)
    paged.reset(context)
    config = ours.config
    dtype = next(hf.parameters()).dtype
    cache = DynamicCache(config=hf.config)
    shape = (batch, config.num_key_value_heads, context, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    ids = torch.randint(0, config.vocab_size, (batch, 1))
    ours_t, hf_t = alternate(lambda: paged.step(1), lambda: hf(ids, cache=cache, use_cache=True), repeats)
    paged.release()
    return batch / ours_t, batch / hf_t, None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ours, hf = build_models(args, dtype)
    quantize_model(ours, args.quantization)
    prefill_shapes = [(1, 16), (2, 24)] if args.quick else PREFILL_SHAPES
    decode_shapes = [
        (b, c)
        for b in ([1, 4] if args.quick else DECODE_BATCHES)
        for c in ([32] if args.quick else DECODE_CONTEXTS)
    ]
    repeats = min(args.repeats, 3) if args.quick else args.repeats
    result: dict = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "threads": args.threads,
        "model": args.model or "random SmolLM2-135M",
    }
    if args.quick:
        result["model"] = "random tiny llama"
    print(
        f"model: {result['model']}  dtype: {args.dtype}  quantization: {args.quantization}  "
        f"threads: {args.threads}"
    )
    print(f"{'phase':<8}{'shape':>14}{'kvd tok/s':>14}{'hf tok/s':>14}{'ratio':>9}")
    with torch.inference_mode():
        for phase, shapes, fn in (
            ("prefill", prefill_shapes, bench_prefill),
            ("decode", decode_shapes, bench_decode),
        ):
            rows = []
            for batch, length in shapes:
                ours_tps, hf_tps, logit_diff = fn(ours, hf, batch, length, repeats)
                row = {"batch": batch, "length": length, "kvd_tok_s": ours_tps, "hf_tok_s": hf_tps}
                row["ratio"] = ours_tps / hf_tps
                if logit_diff is not None:
                    row["max_logit_diff"] = logit_diff
                rows.append(row)
                shape = f"{batch}x{length}"
                print(
                    f"{phase:<8}{shape:>14}{ours_tps:>14.1f}{hf_tps:>14.1f}{ours_tps / hf_tps:>8.2f}x",
                    flush=True,
                )
            result[phase] = rows
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""A mixture-of-experts GGUF with the shapes of a real small one, from random weights, for speed comparisons.

    python -m benchmarks.moe_model OUT_DIR [--layers 12] [--experts 16] [--top-k 2] [--hidden 1024]
        [--expert-width 768] [--types Q4_K_M]

A tiny random MoE says nothing about speed: its experts fit in the caches. This writes a Qwen3-MoE file
(qwen3moe, as llama.cpp's converter writes one) whose sizes are those of the small MoE models people run on a
CPU: 16 experts of which 2 a token, hidden 1024, 12 layers, the bundled SmolLM2's tokenizer and vocabulary
(49152, untied output). Weights are seeded random numbers of unit-variance layers; the router's are wider, so
that tokens spread over the experts as trained routers spread them. The file is written in F32, then quantized
with llama.cpp's llama-quantize (from $LLAMA_CPP_BIN) into each of --types (Q4_K_M: Q4_K experts and attention,
Q6_K down and output; MXFP4_MOE: MXFP4 experts). Prints the files' paths; run benchmarks.peers --model on them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from benchmarks.random_gguf import finish, matrices, tokenizer_writer, write_and_quantize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder for the files")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--expert-width", type=int, default=768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--types", default="Q4_K_M", help="comma-separated llama-quantize types")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_f32(args: argparse.Namespace, path: Path) -> None:
    writer, vocab = tokenizer_writer(path, "qwen3moe")
    head_dim = args.hidden // args.heads
    writer.add_name(f"random-moe-{args.experts}x{args.top_k}")
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.expert_width)
    writer.add_expert_feed_forward_length(args.expert_width)
    writer.add_expert_count(args.experts)
    writer.add_expert_used_count(args.top_k)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    matrix = matrices(args.seed)
    ones = np.ones(args.hidden, np.float32)
    q, kv, h, w, e = (
        args.heads * head_dim,
        args.kv_heads * head_dim,
        args.hidden,
        args.expert_width,
        args.experts,
    )
    writer.add_tensor("token_embd.weight", matrix(vocab, h, scale=np.sqrt(h)))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(vocab, h))
    for i in tqdm(range(args.layers), desc="random layers", unit="layer"):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(q, h))
        writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv, h))
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv, h))
        writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(h, q))
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", matrix(e, h, scale=4.0))
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", matrix(e, w, h))
        writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", matrix(e, w, h))
        writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", matrix(e, h, w))
    finish(writer)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_and_quantize(args.out, "random-moe", args.types, lambda path: write_f32(args, path))


if __name__ == "__main__":
    main()

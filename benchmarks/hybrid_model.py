"""A Qwen3.5-shaped GGUF (Gated DeltaNet layers beside gated full attention) from random weights, for speed
comparisons with llama.cpp on the same file.

    python -m benchmarks.hybrid_model OUT_DIR [--layers 24] [--hidden 1024] [--types Q4_K_M]

Writes a qwen35 file as llama.cpp's converter writes Qwen3.5-0.8B's: 24 layers of which every fourth is full
attention (8 heads, 2 KV heads of 256, a quarter rotated, the query projection doubled by its output gate), the
others Gated DeltaNet (16 key and 16 value heads of 128, a convolution of 4), an MLP of 3584, with the bundled
SmolLM2's tokenizer and vocabulary (49152, untied output). Norms are stored with their 1 added and ssm_a as
-exp(A_log), as the converter stores them. The file is written in F32, then quantized with llama.cpp's
llama-quantize into each of --types. Prints the files' paths; run benchmarks.peers --model on them.
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
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3584)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--key-heads", type=int, default=16, help="Gated DeltaNet key heads")
    p.add_argument("--value-heads", type=int, default=16, help="Gated DeltaNet value heads")
    p.add_argument("--linear-head-dim", type=int, default=128)
    p.add_argument("--types", default="Q4_K_M", help="comma-separated llama-quantize types")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write_f32(args: argparse.Namespace, path: Path) -> None:
    writer, vocab = tokenizer_writer(path, "qwen35")
    h, d, lin = args.hidden, args.head_dim, args.linear_head_dim
    key_dim, value_dim = args.key_heads * lin, args.value_heads * lin
    conv_dim, kernel = 2 * key_dim + value_dim, 4
    writer.add_name("random-qwen35")
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(1e7)
    writer.add_rope_dimension_count(d // 4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_state_size(lin)
    writer.add_ssm_group_count(args.key_heads)
    writer.add_ssm_time_step_rank(args.value_heads)
    writer.add_ssm_inner_size(value_dim)
    writer.add_full_attention_interval(4)
    matrix = matrices(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    ones = np.ones(h, np.float32)  # a (1 + weight) norm of weight 0, as the converter stores it
    writer.add_tensor("token_embd.weight", matrix(vocab, h, scale=np.sqrt(h)))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(vocab, h))
    for i in tqdm(range(args.layers), desc="random layers", unit="layer"):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.post_attention_norm.weight", ones)
        if (i + 1) % 4:  # Gated DeltaNet
            writer.add_tensor(f"blk.{i}.attn_qkv.weight", matrix(conv_dim, h))
            writer.add_tensor(f"blk.{i}.attn_gate.weight", matrix(value_dim, h))
            writer.add_tensor(f"blk.{i}.ssm_beta.weight", matrix(args.value_heads, h))
            writer.add_tensor(f"blk.{i}.ssm_alpha.weight", matrix(args.value_heads, h))
            writer.add_tensor(f"blk.{i}.ssm_conv1d.weight", matrix(conv_dim, kernel))
            writer.add_tensor(f"blk.{i}.ssm_dt.bias", np.ones(args.value_heads, np.float32))
            a = -rng.uniform(1.0, 16.0, args.value_heads).astype(np.float32)  # -exp(A_log)
            writer.add_tensor(f"blk.{i}.ssm_a", a)
            writer.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones(lin, np.float32))
            writer.add_tensor(f"blk.{i}.ssm_out.weight", matrix(h, value_dim))
        else:  # gated full attention
            writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(2 * args.heads * d, h))
            writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(args.kv_heads * d, h))
            writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(args.kv_heads * d, h))
            writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(h, args.heads * d))
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(d, np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(d, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(args.intermediate, h))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(args.intermediate, h))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(h, args.intermediate))
    finish(writer)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_and_quantize(args.out, "random-qwen35", args.types, lambda path: write_f32(args, path))


if __name__ == "__main__":
    main()

"""GGUF super-block linears packed at load (kvd_super_pack) against the file's layout, alternating in one process.

    python -m benchmarks.super_blocks [--rows 1,2,4,8,128] [--rounds 5] [--threads N] [--quick] [--json]

Each case is one matrix of random Q4_K or Q6_K super-blocks (the shapes of a small MoE's experts, a 4096-wide
dense layer and a 49,152-token output projection) multiplied by bf16 activation rows through cpu_native.linear,
once from the file's bytes and once from the same bytes packed (the same output bits, which the script checks),
the two in turn round after round. Figures: the best round's microseconds a call, the weight's GB/s, and file /
packed (above 1: packing is faster). A build that packs nothing (no AVX-512 VNNI) says so and times nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.host import cpu_name
from kvd.kernels import cpu_native

BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
SHAPES = [("Q4_K", 768, 1024), ("Q4_K", 1024, 768), ("Q4_K", 4096, 4096), ("Q6_K", 49152, 1024)]
QUICK_SHAPES = [("Q4_K", 64, 512), ("Q6_K", 48, 256)]


def random_weight(name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random super-blocks with small finite fp16 multipliers (d, dmin; Q6_K's d at byte 208, its int8 scales)."""
    size, blocks = BLOCK_BYTES[name], k // cpu_native.SUPER_BLOCK
    raw = rng.integers(0, 256, size=(n, blocks, size), dtype=np.uint8)
    halves = np.full((n, blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(n, blocks, 2)
    for at in (208,) if name == "Q6_K" else (0, 2):
        raw[:, :, at : at + 2] = halves
    return torch.from_numpy(raw.reshape(n, -1))


def call_us(x: torch.Tensor, weight: cpu_native.LinearWeight, calls: int) -> float:
    """Microseconds a call, over `calls` calls in a row."""
    start = time.perf_counter()
    for _ in range(calls):
        cpu_native.linear(x, weight)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="two small matrices, 1 and 5 rows, 2 rounds")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object last")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [1, 5] if args.quick else [int(r) for r in args.rows.split(",")]
    rounds = 2 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "packs": None, "cases": {}}
    print(f"{result['cpu']}, {result['threads']} threads, bf16 activations")
    for name, n, k in QUICK_SHAPES if args.quick else SHAPES:
        ggml = cpu_native.SUPER_TYPES[name]
        file = random_weight(name, n, k, rng)
        packed = file.clone()
        result["packs"] = cpu_native.pack_super(ggml, packed, k)
        if not result["packs"]:
            print("this build packs no super-blocks (it needs AVX-512 VNNI): nothing to compare")
            break
        weights = {
            "file": cpu_native.super_weight(ggml, file, k),
            "packed": cpu_native.super_weight(ggml, packed, k, packed=True),
        }
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            outs = {side: cpu_native.linear(x, w) for side, w in weights.items()}
            assert torch.equal(outs["file"], outs["packed"]), (
                f"{name} {n}x{k} rows {m}: packing changed the bits"
            )
            calls = max(3, int(3e7 / file.numel() / max(1, m // 8)))
            us = {side: [] for side in weights}
            for r in range(rounds):  # the sides in turn, the first alternating
                for side in ("file", "packed") if r % 2 == 0 else ("packed", "file"):
                    us[side].append(call_us(x, weights[side], calls))
            case = {side: min(v) for side, v in us.items()}
            case["ratio"] = case["file"] / case["packed"]
            result["cases"][f"{name} {n}x{k} rows {m}"] = case
            gbs = file.numel() / case["packed"] / 1e3
            print(
                f"{name} {n:>6} x {k:<5} rows {m:>4}: file {case['file']:9.1f} us  packed {case['packed']:9.1f} us "
                f"({gbs:5.1f} GB/s)  file/packed {case['ratio']:.2f}"
            )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

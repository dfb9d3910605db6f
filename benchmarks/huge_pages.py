"""Weights in 2 MiB pages against ordinary ones: one decoder's linears, both placements alternating in one process.

    python -m benchmarks.huge_pages [--modes int4,int8,bf16] [--rows 1,4,16,64] [--rounds 12] [--json]

Builds SmolLM2-135M's 30 layers of linears (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536:
more than the caches hold) twice from the same random weights, moves one copy into 2 MiB pages as the loader does
(kvd.model.huge_pages.pack_weights), and times a sweep of every linear at each row count on each copy in turn,
round after round (the first of a round alternating): separate processes on a VM differ more than the placements.
Figures: the best sweep in milliseconds and ordinary / huge (above 1: huge pages are faster). bf16 weights are
in their kernel's tile order, where the CPU has AMX tiles or AVX-512 BF16 (else that mode is skipped).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from benchmarks.host import cpu_name
from kvd.kernels import cpu_native
from kvd.model.batch_invariance import set_batch_invariant
from kvd.model.huge_pages import pack_weights
from kvd.model.layers.linear import Linear
from kvd.model.layers.quantized_linear import linear_class

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def decoder_linears(mode: str, seed: int) -> nn.ModuleList:
    """Every linear of LAYERS layers, in the order a decode step runs them; bf16 ones as a batch-invariant model
    keeps them (kvd.model.batch_invariance: in their kernel's tile order)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(LAYERS) for n, k in SHAPES]
    if mode != "bf16":
        return nn.ModuleList(linear_class(mode)(w) for w in weights)
    linears = nn.ModuleList(Linear(w.shape[1], w.shape[0], bias=False) for w in weights)
    for linear, w in zip(linears, weights, strict=True):
        linear.weight.data = w.to(torch.bfloat16)
    set_batch_invariant(linears, True)
    return linears


def sweep_seconds(linears: nn.ModuleList, rows: int) -> float:
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
    start = time.perf_counter()
    for linear, (_, k) in zip(linears, SHAPES * LAYERS, strict=True):
        linear(inputs[k])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="int4,int8,bf16")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one row count, 2 rounds")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = "4", 2
    torch.set_num_threads(args.threads)
    result: dict = {"cpu": cpu_name(), "threads": args.threads, "cases": {}, "skipped": [], "moved_bytes": {}}
    print(f"CPU: {result['cpu']}; {args.threads} threads")
    print(f"{'case':24s} {'ordinary ms':>12s} {'huge ms':>9s} {'ordinary/huge':>14s}")
    for mode in args.modes.split(","):
        if mode == "bf16" and not cpu_native.bf16_kernel_order():
            print("bf16: skipped (its tile order needs AMX tiles or AVX-512 BF16)")
            result["skipped"].append(mode)
            continue
        ordinary, huge = decoder_linears(mode, 0), decoder_linears(mode, 0)
        result["moved_bytes"][mode] = pack_weights(huge)
        x = torch.randn(4, 576, dtype=torch.bfloat16)
        if not torch.equal(ordinary[0](x), huge[0](x)):
            raise SystemExit(f"{mode}: the two placements computed different outputs")
        for rows in map(int, args.rows.split(",")):
            best = {"ordinary": float("inf"), "huge": float("inf")}
            for r in range(args.rounds):
                turn = (("ordinary", ordinary), ("huge", huge))
                for name, linears in turn if r % 2 == 0 else turn[::-1]:
                    best[name] = min(best[name], sweep_seconds(linears, rows))
            case = f"{mode} rows {rows}"
            ratio = best["ordinary"] / best["huge"]
            result["cases"][case] = {
                "ordinary_ms": best["ordinary"] * 1e3,
                "huge_ms": best["huge"] * 1e3,
                "ratio": ratio,
            }
            print(
                f"{case:24s} {best['ordinary'] * 1e3:12.2f} {best['huge'] * 1e3:9.2f} {ratio:14.3f}",
                flush=True,
            )
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

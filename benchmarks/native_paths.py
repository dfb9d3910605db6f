"""Two builds of the native CPU kernels, alternating: quantized linears by row count and decode attention.

    python -m benchmarks.native_paths --cflags=-mno-amx-int8 [--rounds 4] [--rows 4,16,64,256,2048] [--json]

The host's build ("host") runs against one built with extra compiler flags ("alt": KVD_NATIVE_CFLAGS, in its own
cache folder), e.g. `-mno-amx-int8` (the quantized linears on AVX-512 VNNI instead of AMX int8 tiles) or
`-mno-avx512f` (AVX2). Each round runs each build once in a fresh process, in turn (the first of a round
alternating), so the machine's drift falls on both; the figures are the best of the rounds in microseconds, with alt / host (above 1: the host's is faster).
Shapes are SmolLM2-135M's gate_up (3072 x 576) and down (576 x 1536) projections, bf16 activations; attention
is one decode step of 64 sequences x 384 tokens over shuffled 16-token blocks, each of 30 layers' blocks
distinct (so no cache holds a sweep). With `--cflags ""` both sides are the host's build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

SHAPES = ((3072, 576), (576, 1536))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cflags", required=True, help='the alternative build\'s extra compiler flags, as --cflags="-m..."'
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rows", default="4,16,64,256,2048", help="activation rows of each linear")
    p.add_argument("--modes", default="int4,int8", help="quantizations to time")
    p.add_argument(
        "--attention-tokens", type=int, default=384, help="context of each of the 64 sequences (0: none)"
    )
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="one round, small sizes (a smoke run)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: time one build in this process
    return p.parse_args(argv)


def best_seconds(fn: Callable[[], object], reps: int, tries: int = 5) -> float:
    """The best of `tries` averages over `reps` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - started) / reps)
    return best


def time_side(args: argparse.Namespace) -> dict:
    """Microseconds per call of every case, in this process's build."""
    import torch

    from kvd.kernels import cpu_native
    from kvd.kernels.native_build import native_isa
    from kvd.model.layers.quantized_linear import linear_class

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not cpu_native.available():
        raise SystemExit("the native kernels cannot be built here (see KVD_NATIVE_CFLAGS and the compiler)")
    out: dict = {"isa": native_isa()}
    for mode in args.modes.split(","):
        for n, k in SHAPES:
            layer = linear_class(mode)(torch.randn(n, k) * 0.05)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                reps = max(2, min(3 if args.quick else 100, int(3e8 / (m * n * k))))
                out[f"{mode} {n}x{k} rows {m}"] = best_seconds(lambda layer=layer, x=x: layer(x), reps) * 1e6
    tokens = args.attention_tokens
    if tokens:
        seqs, heads, kv_heads, dim, block, layers = 64, 9, 3, 64, 16, 30
        per_seq = tokens // block
        pool = torch.randn(2, seqs * per_seq * layers, block, kv_heads, dim).to(torch.bfloat16)
        tables = torch.randperm(pool.shape[1]).to(torch.int32).view(layers, seqs, per_seq)
        q = torch.randn(seqs, heads, dim).to(torch.bfloat16)
        lens = torch.full((seqs,), tokens, dtype=torch.int32)

        def step() -> None:
            for layer in range(layers):
                cpu_native.paged_attention(q, pool, tables[layer].contiguous(), lens, dim**-0.5)

        out[f"attention 64x{tokens} a layer"] = best_seconds(step, 1, tries=3) * 1e6 / layers
    return out


def run_side(argv: list[str], side: str, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.native_paths", *argv, "--side", side],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"the {side} build failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.rows, args.attention_tokens = 1, "4,16", 64
        argv = [*argv, "--rows", args.rows, "--attention-tokens", "64"]
    if args.side:
        print(json.dumps(time_side(args)))
        return {}
    from benchmarks.host import cpu_name

    with tempfile.TemporaryDirectory(prefix="kvd-native-alt-") as cache:
        envs = {"host": dict(os.environ), "alt": dict(os.environ)}
        if args.cflags:  # its own cache folder: a build per flag set
            envs["alt"] |= {"KVD_NATIVE_CFLAGS": args.cflags, "KVD_CACHE_DIR": cache}
        runs: dict[str, list[dict]] = {"host": [], "alt": []}
        for round_ in range(args.rounds):
            for side in (
                ("host", "alt") if round_ % 2 == 0 else ("alt", "host")
            ):  # ABBA: neither always goes first
                runs[side].append(run_side(argv, side, envs[side]))
    isa = {side: runs[side][0].pop("isa") for side in runs}
    for side in runs:
        for run in runs[side][1:]:
            run.pop("isa")
    best = {side: {key: min(r[key] for r in runs[side]) for key in runs[side][0]} for side in runs}
    print(f"CPU: {cpu_name()}; host build {isa['host']}, alt build {isa['alt']} (flags {args.cflags!r})")
    print(f"{'case':<32} {'host us':>10} {'alt us':>10} {'alt/host':>9}")
    cases = {}
    for key, host in best["host"].items():
        alt = best["alt"][key]
        cases[key] = {"host_us": round(host, 1), "alt_us": round(alt, 1), "ratio": round(alt / host, 3)}
        print(f"{key:<32} {host:>10.1f} {alt:>10.1f} {alt / host:>9.2f}")
    result = {"cpu": cpu_name(), "isa": isa, "cflags": args.cflags, "rounds": args.rounds, "cases": cases}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

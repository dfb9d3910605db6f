"""Two builds of the native CPU kernels in one process, alternating: linears by rows, decode and prefill attention.

    python -m benchmarks.native_paths --cflags=-mno-amx-int8 [--rounds 6] [--rows 4,16,64,256,2048] [--json]
    python -m benchmarks.native_paths --alt-commit HEAD~1 --modes bf16,int4 [--cflags=...]
    python -m benchmarks.native_paths --alt-commit HEAD~1 --engine int4 [--engine-requests 64 | --engine-prompt-tokens 2048]

The host's build ("host") runs against one built with extra compiler flags ("alt": KVD_NATIVE_CFLAGS, compiled
into its own cache folder), e.g. `-mno-amx-int8` (the 8-bit linears on AVX-512 VNNI instead of AMX int8 tiles) or
`-mno-avx512f` (AVX2), or against the kernels' source at another commit (--alt-commit: a change's before and
after; its C ABI must be this one's). Modes: int4 and int8 weights, and bf16 (a bf16 weight in tile order: AMX
tiles or AVX-512 BF16 pairs, where the CPU has either). Both libraries are loaded into this process and every
case runs on each in turn, round after round (the first of a round alternating), on the same tensors: separate
processes on a VM differ by up to 1.6x in the same code, one process does not. Figures: the best round in
microseconds, and alt / host (above 1: the host's build is faster). Shapes are SmolLM2-135M's gate_up (3072 x
576), down (576 x 1536) and int8 output projection (49152 x 576), bf16 activations; attention is one decode
step of 64 sequences over shuffled 16-token blocks, each of 30 layers' blocks distinct (so no cache holds a
sweep); prefill attention is 4 prompts' rows over their causal contexts, in a bf16 and an 8-bit pool. --engine
adds benchmarks.throughput's workload through one engine (bundled SmolLM2, one of benchmarks.vllm_peer's kvd
modes) run on each build in turn: its output tok/s and how many requests got the same tokens on both;
--engine-prompt-tokens N times a prefill instead (4 prompts of N tokens, one output token each: prompt tok/s).
With `--cflags=` both sides are the host's build (the noise floor).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.host import cpu_name
from kvd.kernels import cpu_native
from kvd.kernels.native_build import HEADER, compile_sources, ffi, isa, library_path
from kvd.model.huge_pages import pool_zeros
from kvd.model.layers.quantized_linear import linear_class

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "int4": ((3072, 576), (576, 1536)),
    "int8": ((3072, 576), (576, 1536), (49152, 576)),
    "bf16": ((3072, 576), (576, 1536)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cflags", default="", help="the alternative build's extra flags, as --cflags=-m...")
    p.add_argument(
        "--alt-commit", default=None, help="the alternative build from the kernels at this git commit"
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--rows", default="4,16,64,256,2048", help="activation rows of each linear")
    p.add_argument("--modes", default="int4,int8", help=f"weights to time, of {', '.join(SHAPES)}")
    p.add_argument(
        "--attention-tokens", type=int, default=384, help="context of each of the 64 sequences (0: none)"
    )
    p.add_argument(
        "--prefill-tokens", type=int, default=512, help="rows of each of the 4 prompts' attention (0: none)"
    )
    p.add_argument(
        "--engine",
        default=None,
        help="also the throughput workload through one engine on the bundled model, in a kvd mode of "
        "benchmarks.vllm_peer (bf16, int4, bf16-kv8, int4-kv8): output tokens a second on each build",
    )
    p.add_argument("--engine-requests", type=int, default=64, help="requests of the engine's workload")
    p.add_argument(
        "--engine-prompt-tokens",
        type=int,
        default=0,
        help="instead of the throughput workload, 4 prompts of this many tokens and one output token each "
        "(prefill): prompt tokens a second on each build",
    )
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="two rounds, small sizes (a smoke run)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p.parse_args(argv)


def _git(commit: str, *args: str) -> str:
    """A git command's output in this repository; SystemExit naming --alt-commit when git refuses it."""
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"--alt-commit {commit}: {proc.stderr.strip()}")
    return proc.stdout


def commit_sources(commit: str) -> dict[str, str]:
    """The kernels' C files and headers at `commit` by name: every .c and .h file of the folder that holds its
    cpu_kernels.h, kvd/kernels/ (or kernels/, where the kernels lay before they moved). One cpu_kernels.c at
    older commits, a file per concern at newer ones: either way all of them make the library."""
    for folder in ("kvd/kernels", "kernels"):
        paths = _git(commit, "ls-tree", "--name-only", commit, f"{folder}/").split()
        if f"{folder}/cpu_kernels.h" in paths:
            return {
                Path(path).name: _git(commit, "show", f"{commit}:{path}")
                for path in paths
                if path.endswith((".c", ".h"))
            }
    raise SystemExit(f"--alt-commit {commit}: no cpu_kernels.h in kvd/kernels/ or kernels/")


def commit_library(commit: str, cflags: str, folder: str) -> str:
    """The path of the kernels at `commit` built with kvd's flags and the extra ones, in `folder`: its C files
    compiled together, as native_build compiles the working tree's."""
    files = commit_sources(commit)
    for name, text in files.items():
        (Path(folder) / name).write_text(text)
    sources = [Path(folder) / name for name in sorted(files) if name.endswith(".c")]
    target = Path(folder) / "alt.so"
    try:
        compile_sources(os.environ.get("CC", "cc"), sources, target, shlex.split(cflags))
    except OSError as exc:
        raise SystemExit(f"the build of {commit}'s kernels failed:\n{exc}") from exc
    if files["cpu_kernels.h"] != HEADER.read_text():
        print(f"note: {commit}'s cpu_kernels.h differs from this one's; its C ABI must be the same")
    return str(target)


def alt_library(cflags: str, cache: str) -> str:
    """The path of the build with the extra flags (compiled in a child process, whose environment carries them)."""
    env = os.environ | {"KVD_NATIVE_CFLAGS": cflags, "KVD_CACHE_DIR": cache}
    code = "from kvd.kernels.native_build import library_path; print(library_path())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "None"
    if proc.returncode or path == "None":
        raise SystemExit(f"the build with {cflags!r} failed:\n{proc.stderr[-3000:]}")
    return path


@contextmanager
def using(lib: object) -> Iterator[None]:
    """cpu_native's calls go to `lib` inside the block (the module looks its library up at every call)."""
    loaded = cpu_native.library
    cpu_native.library = lambda: lib
    try:
        yield
    finally:
        cpu_native.library = loaded


def mean_seconds(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    """(seconds a call, averaged over reps calls; the last call's result)."""
    started = time.perf_counter()
    for _ in range(reps):
        result = fn()
    return (time.perf_counter() - started) / reps, result


def bf16_linear(n: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ W^T for a random bf16 weight [n, k] in the tile order its kernel reads."""
    tiles = cpu_native.pack((torch.randn(n, k) * 0.05).to(torch.bfloat16))
    weight = cpu_native.linear_weight(16, tiles, tiles=True)

    # The weight holds only the tiles' address: the default argument keeps them alive.
    def call(x: torch.Tensor, tiles: torch.Tensor = tiles) -> torch.Tensor:
        return cpu_native.linear(x, weight)

    return call


def cases(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], object], int]]:
    """(name, call, calls a timing) for every case."""
    for mode in args.modes.split(","):
        for n, k in SHAPES[mode]:
            call = bf16_linear(n, k) if mode == "bf16" else linear_class(mode)(torch.randn(n, k) * 0.05)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                reps = max(1, min(3 if args.quick else 50, int(1e8 / (m * n * k))))
                yield f"{mode} {n}x{k} rows {m}", lambda call=call, x=x: call(x), reps
    tokens = args.attention_tokens
    if tokens:
        seqs, heads, kv_heads, dim, block, layers = 64, 9, 3, 64, 16, 30
        per_seq = tokens // block
        # Allocated as the engine's pool is (2 MiB pages where Linux grants them), then filled.
        pool = pool_zeros(
            (2, seqs * per_seq * layers, block, kv_heads, dim), torch.bfloat16, torch.device("cpu")
        )
        pool.copy_(torch.randn(pool.shape))
        tables = torch.randperm(pool.shape[1]).to(torch.int32).view(layers, seqs, per_seq)
        q = torch.randn(seqs, heads, dim).to(torch.bfloat16)
        lens = torch.full((seqs,), tokens, dtype=torch.int32)
        order = itertools.cycle(range(layers))  # a call per layer: each call's blocks come from DRAM
        yield (
            f"attention 64x{tokens} a layer",
            lambda: cpu_native.paged_attention(q, pool, tables[next(order)], lens, dim**-0.5),
            layers,
        )
    if args.prefill_tokens:
        yield from prefill_cases(args.prefill_tokens)
    if args.engine:
        # --quick: prompts of 16-64 tokens and outputs of 8-32, enough to compare the builds' tokens
        inputs, outputs = ("16,64", "8,32") if args.quick else ("64,512", "32,256")
        yield engine_case(args.engine, args.engine_requests, args.engine_prompt_tokens, inputs, outputs)


def engine_case(
    mode: str, requests: int, prompt_tokens: int = 0, inputs: str = "64,512", outputs: str = "32,256"
) -> tuple[str, Callable[[], object], int]:
    """benchmarks.throughput's workload (`inputs` and `outputs` tokens: 64-512 and 32-256), or 4 prompts of prompt_tokens with one
    output token each, through one engine, from an empty prefix cache each time; the call returns the token ids
    (which the two builds print as equal or not) and the count of tokens its speed is reported in."""
    from benchmarks.host import bundled_gguf
    from benchmarks.throughput import make_workload
    from benchmarks.vllm_peer import KVD_MODES
    from kvd import LLM, SamplingParams

    quantization, dtype, kv_cache_dtype = KVD_MODES[mode]
    llm = LLM(
        bundled_gguf(),
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=64,
        max_model_len=max(2048, prompt_tokens + 1),
    )
    vocab = llm.engine.config.vocab_size
    if prompt_tokens:
        workload = make_workload(4, vocab, f"{prompt_tokens},{prompt_tokens}", "1,1", 0)
        name, counted = f"engine {mode} prefill 4x{prompt_tokens}", 4 * prompt_tokens
    else:
        workload = make_workload(requests, vocab, inputs, outputs, 0)
        name, counted = f"engine {mode} {requests} requests", sum(n for _, n in workload)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]

    def call() -> tuple[list[list[int]], int]:
        llm.engine.block_manager.reset_prefix_cache()
        outs = llm.generate([prompt for prompt, _ in workload], params, use_tqdm=False)
        return [out.token_ids for out in outs], counted

    return name, call, 1


def prefill_cases(rows: int) -> Iterator[tuple[str, Callable[[], object], int]]:
    """A prefill's attention: 4 prompts of `rows` rows, each row over its causal context, bf16 and 8-bit pools."""
    prompts, heads, kv_heads, dim, block = 4, 9, 3, 64, 16
    per_prompt = (rows + block - 1) // block
    tables = torch.randperm(prompts * per_prompt).to(torch.int32).view(prompts, per_prompt)
    row_tables = tables.repeat_interleave(rows, dim=0)
    lens = torch.arange(1, rows + 1, dtype=torch.int32).repeat(prompts)
    slots = (tables[:, :, None].long() * block + torch.arange(block)).flatten(1)[:, :rows].flatten()
    q = torch.randn(prompts * rows, heads, dim).to(torch.bfloat16)
    k, v = (torch.randn(prompts * rows, kv_heads, dim).to(torch.bfloat16) for _ in range(2))
    for dtype, row in ((torch.bfloat16, dim), (torch.int8, cpu_native.kv8_row_bytes(dim))):
        pool = torch.zeros(2, prompts * per_prompt, block, kv_heads, row, dtype=dtype)
        cpu_native.store_kv(k, v, pool, slots)
        name = f"prefill attention {prompts}x{rows} {'kv8' if dtype == torch.int8 else 'bf16'}"
        yield name, lambda pool=pool: cpu_native.paged_attention(q, pool, row_tables, lens, dim**-0.5), 3


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.rows, args.attention_tokens, args.prefill_tokens = 2, "4,16", 64, 40
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if library_path() is None:
        raise SystemExit("the native kernels cannot be built here (see KVD_NATIVE_CFLAGS and the compiler)")
    unknown = set(args.modes.split(",")) - set(SHAPES)
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SHAPES)}")
    if "bf16" in args.modes.split(",") and not cpu_native.bf16_kernel_order():
        raise SystemExit("--modes bf16: this CPU has neither AMX tiles (that Linux grants) nor AVX-512 BF16")
    with tempfile.TemporaryDirectory(prefix="kvd-native-alt-") as cache:
        paths = {"host": str(library_path()), "alt": str(library_path())}
        if args.alt_commit:
            paths["alt"] = commit_library(args.alt_commit, args.cflags, cache)
        elif args.cflags:
            paths["alt"] = alt_library(args.cflags, cache)
        libs = {side: ffi.dlopen(path) for side, path in paths.items()}
    paths_isa = {side: isa(lib) for side, lib in libs.items()}
    print(
        f"CPU: {cpu_name()}; host build {paths_isa['host']}, alt build {paths_isa['alt']} (flags {args.cflags!r}"
        + (f", kernels at {args.alt_commit})" if args.alt_commit else ")")
    )
    print(f"{'case':<34} {'host us':>10} {'alt us':>10} {'alt/host':>9}")
    results = {}
    for name, call, reps in cases(args):
        best = {"host": float("inf"), "alt": float("inf")}
        outputs = {}
        for round_ in range(args.rounds + 1):  # round 0 warms both up
            for side in ("host", "alt") if round_ % 2 == 0 else ("alt", "host"):
                with using(libs[side]):
                    seconds, outputs[side] = mean_seconds(call, reps)
                if round_:
                    best[side] = min(best[side], seconds)
        host, alt = best["host"] * 1e6, best["alt"] * 1e6
        results[name] = {"host_us": round(host, 1), "alt_us": round(alt, 1), "ratio": round(alt / host, 3)}
        print(f"{name:<34} {host:>10.1f} {alt:>10.1f} {alt / host:>9.2f}", flush=True)
        if name.startswith("engine"):  # the calls' results: every request's token ids, the tokens counted
            (host_ids, tokens), (alt_ids, _) = outputs["host"], outputs["alt"]
            same = sum(a == b for a, b in zip(host_ids, alt_ids, strict=True))
            results[name] |= {
                "host_tok_s": round(tokens / best["host"], 1),
                "alt_tok_s": round(tokens / best["alt"], 1),
                "same_requests": same,
            }
            print(
                f"  {'prompt' if 'prefill' in name else 'output'} tok/s: host {tokens / best['host']:.1f}, "
                f"alt {tokens / best['alt']:.1f}; {same} of {len(host_ids)} requests the same tokens on both builds",
                flush=True,
            )
    result = {
        "cpu": cpu_name(),
        "isa": paths_isa,
        "cflags": args.cflags,
        "alt_commit": args.alt_commit,
        "rounds": args.rounds,
        "cases": results,
    }
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

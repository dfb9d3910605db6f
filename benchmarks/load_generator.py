"""One streaming load-generator run against kvd's OpenAI-compatible gateway: guidellm 0.8.1, chat completions.

    python -m benchmarks.load_generator [--json] [--streams 4] [--rate R] [--duration 60] [--requests N]
        [--prompt-tokens 64] [--output-tokens 32] [--model FILE.gguf] [--venv DIR]

guidellm lives in its own virtual environment (default: kvd-bench/guidellm-venv under the user's cache folder,
$XDG_CACHE_HOME or ~/.cache), installed on the first run from the package registry, never into
kvd's environment and before anything is timed; where it cannot be installed the benchmark says so and skips.
The daemon runs as `kvd serve --listen ipc://... --http 127.0.0.1:PORT` on the bundled model (a free loopback
port, a private ipc endpoint). guidellm sends a synthetic dataset (--prompt-tokens in, --output-tokens out,
`ignore_eos`), streaming, with a fixed profile: --streams concurrent streams for --duration seconds, or
--rate requests per second (a constant rate) instead; --requests N stops it after N requests as well.
Its tokenizer is the model's own, written from the GGUF file into a scratch folder.
Printed: requests completed and errored (the goal is none errored), output tokens/s, time to first token and
inter-token latency percentiles as guidellm reports them (read from its JSON report), and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.host import bundled_gguf, cpu_name
from kvd.model.cpu_dtype import cpu_flags

GUIDELLM = "guidellm==0.8.1"
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
PERCENTILES = ("p50", "p90", "p95", "p99")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams (the default profile)")
    p.add_argument("--rate", type=float, default=None, help="requests per second instead of --streams")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--requests", type=int, default=None, help="also stop after this many requests")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="the daemon's torch threads (default: its own)")
    p.add_argument("--kv-cache-memory", default="512M")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--venv", default=None, help="guidellm's virtual environment (created when missing)")
    p.add_argument("--save-report", default=None, help="keep guidellm's JSON report in this file")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args(argv)
    args.model = args.model or bundled_gguf()
    if args.venv is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        args.venv = str(cache / "kvd-bench" / "guidellm-venv")
    return args


def ensure_guidellm(venv: Path) -> Path | None:
    """guidellm's command in its own venv, installing it there when missing; None where that fails."""
    exe = venv / "bin" / "guidellm"
    if exe.exists():
        found = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.split()[-1:] == [GUIDELLM.split("==")[1]]:
            return exe
    print(f"installing {GUIDELLM} into its own environment (once; a few minutes)", flush=True)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
    steps.append([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", GUIDELLM])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            print(f"skipped: {GUIDELLM} could not be installed ({' / '.join(tail) or done.returncode})")
            return None
    return exe


def write_tokenizer(gguf: str, folder: Path) -> None:
    """The model's tokenizer as a Hugging Face folder, which guidellm's synthetic data needs to count tokens."""
    from transformers import AutoTokenizer

    path = Path(gguf)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(folder))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def start_daemon(args: argparse.Namespace, endpoint: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen", endpoint, "--http", f"127.0.0.1:{port}"]
    cmd += ["--model", args.model, "--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning"]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            get_json(f"http://127.0.0.1:{port}/health")
            return proc
        except (OSError, urllib.error.HTTPError, ValueError):
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the daemon's gateway did not start")


def guidellm_command(exe: Path, args: argparse.Namespace, target: str, model: str, tok: Path, out: Path):
    if args.rate is not None:
        profile = f"kind=constant,rate={args.rate}"
    else:
        profile = f"kind=concurrent,streams={args.streams}"
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={target},model={model}"]
    cmd += ["--profile", profile, "--data", data, "--tokenizer", f"kind=huggingface_auto,model={tok}"]
    cmd += ["--constraint", f"kind=max_duration,seconds={args.duration}"]
    if args.requests is not None:
        cmd += ["--constraint", f"kind=max_requests,count={args.requests}"]
    cmd += ["--seed", f"kind=static,value={args.seed}", "--output", f"kind=json,path={out}"]
    return [*cmd, "--disable-console-interactive"]


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    flags = cpu_flags()
    cpu = {"model": cpu_name(), "isa": [f for f in ISA if f in flags], "cores": os.cpu_count()}
    print(
        f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {' '.join(cpu['isa']) or 'none of ' + str(ISA)}"
    )
    exe = ensure_guidellm(Path(args.venv))
    if exe is None:
        return None
    with tempfile.TemporaryDirectory(prefix="kvd-load-") as tmp:
        scratch = Path(tmp)
        write_tokenizer(args.model, scratch / "tokenizer")
        port = free_port()
        target = f"http://127.0.0.1:{port}"
        daemon = start_daemon(args, f"ipc://{scratch}/kvd.sock", port)
        try:
            model = get_json(f"{target}/v1/models")["data"][0]["id"]
            report = scratch / "guidellm.json"
            cmd = guidellm_command(exe, args, target, model, scratch / "tokenizer", report)
            env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            with open(scratch / "guidellm.log", "w") as log:
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
            if done.returncode != 0 or not report.exists():
                tail = (scratch / "guidellm.log").read_text().strip().splitlines()[-30:]
                raise SystemExit(f"guidellm failed (exit {done.returncode}):\n" + "\n".join(tail))
            if args.save_report:
                shutil.copy(report, args.save_report)
            result = summarize(json.loads(report.read_text()))
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    result.update(
        cpu=cpu,
        model=Path(args.model).name,
        profile=f"rate {args.rate}/s" if args.rate is not None else f"{args.streams} concurrent streams",
        duration_s=args.duration,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
    )
    print_result(result)
    if args.json:
        print(json.dumps(result))
    return result


def summarize(report: dict) -> dict:
    """The figures of guidellm's one benchmark: request counts, output tok/s, TTFT and ITL percentiles."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def spread(name: str) -> dict[str, float]:
        dist = metrics[name]["successful"]
        row = {"mean": dist["mean"]} | {q: dist["percentiles"][q] for q in PERCENTILES}
        return {k: round(v, 2) for k, v in row.items()}

    errors = [r.get("info", {}).get("error") for r in bench.get("requests", {}).get("errored", [])]
    sched = bench["scheduler_metrics"]
    return {
        "requests": dict(metrics["request_totals"]),
        "first_errors": sorted({e for e in errors if e})[:3],
        "measured_s": round(sched["measure_end_time"] - sched["measure_start_time"], 1),
        "output_tok_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
        "output_tokens_total": int(metrics["output_token_count"]["successful"]["total_sum"]),
        "requests_per_s": round(metrics["requests_per_second"]["successful"]["mean"], 3),
        "ttft_ms": spread("time_to_first_token_ms"),
        "itl_ms": spread("inter_token_latency_ms"),
    }


def print_result(result: dict) -> None:
    req = result["requests"]
    print(
        f"guidellm {GUIDELLM.split('==')[1]}, {result['profile']}, {result['duration_s']:g} s, "
        f"{result['prompt_tokens']} prompt / {result['output_tokens']} output tokens, streaming chat completions"
    )
    print(
        f"requests: {req['successful']} completed, {req['errored']} errored, {req['incomplete']} incomplete "
        f"(of {req['total']}) over {result['measured_s']} s"
    )
    for error in result["first_errors"]:
        print(f"  error: {error}")
    print(
        f"output: {result['output_tok_s']} tok/s ({result['output_tokens_total']} tokens), "
        f"{result['requests_per_s']} requests/s"
    )
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        row = result[key]
        cells = ", ".join(f"{q} {row[q]:.1f}" for q in ("mean", *PERCENTILES))
        print(f"{label} (ms): {cells}")


if __name__ == "__main__":
    main()

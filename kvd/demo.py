"""`make demo`: start the daemon on the bundled model (or `--model`'s), chat with it through the client, stop it
cleanly."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time

from kvd_client import Client, KvdError

QUESTIONS = ["What is the capital of France? Answer in one sentence.", "And what is the capital of Italy?"]
READY_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvd.demo", description=__doc__)
    parser.add_argument("--model", help="what `kvd serve --model` takes (default: the bundled SmolLM2)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvd-demo-") as workdir:
        # A private endpoint, so the demo never collides with a daemon the user already runs.
        endpoint = f"ipc://{workdir}/kvd.sock"
        print(f"Starting `kvd serve` on {args.model or 'the bundled SmolLM2-135M-Instruct'} ...", flush=True)
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen", endpoint, "--kv-cache-memory", "256M"]
        if args.model:
            cmd += ["--model", args.model]
        daemon = subprocess.Popen(cmd)
        try:
            if not _wait_ready(daemon, endpoint):
                return 1
            with Client(endpoint) as client:
                _chat(client)
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(60)
        print(f"Daemon stopped with SIGTERM (exit status {code}).")
        return code


def _wait_ready(daemon: subprocess.Popen, endpoint: str) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with Client(endpoint, timeout=1.0) as client:
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                print(
                    f"The daemon exited with status {daemon.returncode} before it was ready.", file=sys.stderr
                )
                return False
            try:
                if client.health()["status"] == "ready":
                    return True
            except KvdError:
                time.sleep(0.2)  # the socket appears once the model is loaded and warmed up
    print(f"The daemon was not ready within {READY_TIMEOUT_S:g} s.", file=sys.stderr)
    return False


def _chat(client: Client) -> None:
    info = client.info()
    pool = f"{info['num_blocks']} KV blocks of {info['block_size']} tokens"
    quantization = info.get("quantization", "none")
    numbers = (
        info["dtype"] if quantization == "none" else f"{quantization} weights, {info['dtype']} activations"
    )
    print(f"\nConnected: {info['model']} ({numbers}), {pool}")
    history: list[dict[str, str]] = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        print(f"\nuser: {question}\nassistant: ", end="", flush=True)
        reply = []
        for chunk in client.stream_chat(history, max_tokens=64, temperature=0.0):
            print(chunk.text, end="", flush=True)
            reply.append(chunk.text)
        usage = chunk.usage
        print(
            f"\n  [{usage.completion_tokens} tokens ({chunk.finish_reason}); prompt of {usage.prompt_tokens} "
            f"tokens, {usage.cached_tokens} of them from the prefix cache]"
        )
        history.append({"role": "assistant", "content": "".join(reply)})
    stats = client.stats()
    hit_rate = 100 * stats["prefix_cache"]["hit_rate"]
    print(
        f"\nstats: prefix-cache hit rate {hit_rate:.0f} %, KV blocks in use {stats['kv_cache']['used_blocks']}\n"
    )


if __name__ == "__main__":
    sys.exit(main())

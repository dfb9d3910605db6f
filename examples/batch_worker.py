"""An app process that completes a batch of prompts concurrently on the shared daemon.

    python examples/batch_worker.py NAME [COUNT]

All COUNT requests are in flight at once on one connection; the daemon batches them with every other
client's, and admits them fairly (one per client per round), so a big batch does not hold up other apps."""

from __future__ import annotations

import sys
import time

from kvd_client import Client


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "worker"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    started = time.monotonic()
    with Client() as client:
        streams = [
            client.stream(f"Fact {i} about the sea:", max_tokens=32, temperature=0.0) for i in range(count)
        ]
        for i, stream in enumerate(streams):
            text = "".join(chunk.text for chunk in stream)
            print(f"[{name} {i}] {text.strip()[:60]!r}")
    print(f"[{name}] {count} completions in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()

"""An interactive-style app process: a scripted conversation, streamed token by token.

    python examples/chat_app.py

Its requests are short and latency-sensitive; run it next to batch_worker.py to see that the batch does not
delay its replies by more than one scheduling round."""

from __future__ import annotations

import time

from kvd_client import Client

QUESTIONS = ["What is a kernel?", "And a daemon?", "Say goodbye in three words."]


def main() -> None:
    history: list[dict[str, str]] = []
    with Client() as client:
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            sent = time.monotonic()
            parts, first = [], None
            with client.stream_chat(history, max_tokens=48, temperature=0.0) as stream:
                for chunk in stream:
                    first = first or time.monotonic() - sent
                    parts.append(chunk.text)
            answer = "".join(parts)
            history.append({"role": "assistant", "content": answer})
            print(f"> {question}\n{answer.strip()}\n(first token after {1000 * (first or 0):.0f} ms)\n")


if __name__ == "__main__":
    main()

"""Prompts become token ids on a worker thread, and grammars matchers: tokenizing a long prompt or compiling a
large schema must not silence the loop that answers every other client (both release the GIL while they work)."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from kvd.server.protocol import INTERNAL, EmbedMessage, GenerateMessage, ProtocolError, TokenizeMessage
from kvd.server.sessions import Generation

if TYPE_CHECKING:
    from kvd.server.models import ServedModel

logger = logging.getLogger("kvd.server")

PromptMessage = GenerateMessage | TokenizeMessage | EmbedMessage


@dataclass
class PromptJob:
    identity: bytes
    tenant: str
    message: PromptMessage
    model: ServedModel  # whose tokenizer and engine prepare it
    generation: Generation | None = None  # generate, chat, embed: the record reserved in its client's session


@dataclass
class PromptResult:
    """What the worker made of a job; the handler's `prepare` fills the job's generation too (its matcher,
    tool-call parser or embed inputs)."""

    job: PromptJob
    field: str = ""  # the request field the prompt came from, for error replies
    token_ids: list[int] | None = None
    error: ProtocolError | None = None


class PromptWorker:
    """One thread that runs `prepare` on each submitted job in order; the loop polls `wakeup` and collects."""

    def __init__(self, prepare: Callable[[PromptJob], PromptResult]) -> None:
        self._prepare = prepare
        self._jobs: queue.SimpleQueue[PromptJob | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[PromptResult] = queue.SimpleQueue()
        self.wakeup, self._notify = socket.socketpair()
        self.wakeup.setblocking(False)
        self._notify.setblocking(False)
        self.num_pending = 0
        self._thread = threading.Thread(target=self._run, name="kvd-prompts", daemon=True)
        self._thread.start()

    def submit(self, job: PromptJob) -> None:
        self.num_pending += 1
        self._jobs.put(job)

    def results(self) -> list[PromptResult]:
        """The jobs finished so far, in submission order."""
        with contextlib.suppress(BlockingIOError):
            while self.wakeup.recv(4096):
                pass
        done = []
        while not self._results.empty():
            done.append(self._results.get())
        self.num_pending -= len(done)
        return done

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.wakeup.close()
        self._notify.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result = self._prepare(job)
            except ProtocolError as e:
                result = PromptResult(job, error=e)
            except Exception:
                logger.exception("tokenizing request %r failed", job.message.id)
                result = PromptResult(
                    job, error=ProtocolError(INTERNAL, "internal error; see the daemon log")
                )
            self._results.put(result)
            # A full wakeup socket is readable already: the byte is not needed.
            with contextlib.suppress(BlockingIOError):
                self._notify.send(b"\0")


def max_prompt_bytes(tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int) -> int | None:
    """A prompt longer than this many UTF-8 bytes has more than `max_prompt_tokens` tokens, so it can be
    refused without tokenizing it. Known for byte-level BPE without a normalizer, where every token stands for
    at most its own length in bytes; None (no bound) for other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or backend.normalizer is not None
        or not isinstance(backend.decoder, decoders.ByteLevel)
    ):
        return None
    # A byte-level token's characters map one to one onto bytes; added tokens match their literal text.
    longest = max(len(t) for t in backend.get_vocab(with_added_tokens=False))
    longest_added = max((len(t.encode()) for t in tokenizer.get_added_vocab()), default=0)
    return max_prompt_tokens * max(longest, longest_added)


def prompt_bytes(message: PromptMessage) -> tuple[int, str]:
    """UTF-8 bytes of the text a prompt's tokens must cover (0 for token ids), and the field that holds it: an
    embed request's longest input (each is a prompt of its own, input[i])."""
    if isinstance(message, EmbedMessage):
        sizes = [len(i.encode()) if isinstance(i, str) else 0 for i in message.inputs]
        longest = sizes.index(max(sizes))
        return sizes[longest], f"input[{longest}]"
    if message.messages is not None:
        return sum(len((m["content"] or "").encode()) for m in message.messages), "messages"
    if isinstance(message, GenerateMessage):
        return len((message.prompt or "").encode()), "prompt"
    return len((message.text or "").encode()), "text"

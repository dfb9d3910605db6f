"""Prompts become token ids on a worker thread, and grammars matchers: tokenizing a long prompt or compiling a
large schema must not silence the loop that answers every other client (both release the GIL while they work)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from kvd.server.protocol import INTERNAL, EmbedMessage, GenerateMessage, ProtocolError, TokenizeMessage
from kvd.server.sessions import Generation
from kvd.server.worker import Worker

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


class PromptWorker(Worker[PromptJob, PromptResult]):
    """The thread that tokenizes prompts and compiles grammars (`prepare`, the handler's)."""

    def __init__(self, prepare: Callable[[PromptJob], PromptResult]) -> None:
        super().__init__(lambda job: _prepared(prepare, job), "kvd-prompts")


def _prepared(prepare: Callable[[PromptJob], PromptResult], job: PromptJob) -> PromptResult:
    try:
        return prepare(job)
    except ProtocolError as e:
        return PromptResult(job, error=e)
    except Exception:
        logger.exception("tokenizing request %r failed", job.message.id)
        return PromptResult(job, error=ProtocolError(INTERNAL, "internal error; see the daemon log"))


def max_prompt_bytes(tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int) -> int | None:
    """A prompt longer than this many UTF-8 bytes has more than `max_prompt_tokens` tokens, so it can be
    refused without tokenizing it. Known for byte-level BPE without a normalizer, where every token stands for
    at most its own length in bytes; None (no bound) for other tokenizers."""
    longest = longest_token_bytes(tokenizer)
    return None if longest is None else max_prompt_tokens * longest


# Per tokenizer: reading its vocabulary holds the interpreter's lock ~40 ms (50k tokens), so a model loaded on demand
# reads it on the loading thread, not the serving loop's (kvd.server.model_loading).
_LONGEST: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, int | None] = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most UTF-8 bytes one token stands for (max_prompt_bytes), once per tokenizer."""
    if tokenizer not in _LONGEST:
        _LONGEST[tokenizer] = _longest_token_bytes(tokenizer)
    return _LONGEST[tokenizer]


def _longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
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
    return max(longest, longest_added)


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

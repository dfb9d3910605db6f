"""Response bodies of /v1/completions and /v1/chat/completions, whole and as stream chunks."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.gateway.choices import Choice
from kvd.gateway.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from kvd_client import Chunk, Usage


def usage_body(usages: Sequence[Usage]) -> dict:
    """The prompt is counted once (every choice has the same one); completions add up."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


@dataclass
class Reply:
    """The identity every body of one HTTP reply shares, and per-choice streaming state."""

    model: str
    chat: bool
    want_logprobs: bool
    texts: TokenTexts
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # completions: each choice's text length so far
    started: set[int] = field(default_factory=set)  # chat: choices whose first delta (the role) went out

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{secrets.token_hex(12)}"

    def whole(self, choices: Sequence[Choice]) -> dict:
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [self._choice(c) for c in choices],
            "usage": usage_body([c.usage for c in choices]),
        }

    def chunk(self, index: int, chunk: Chunk) -> dict:
        if self.chat:
            delta = {"content": chunk.text}
            if index not in self.started:
                self.started.add(index)
                delta = {"role": "assistant", **delta}
            body = {"index": index, "delta": delta, "logprobs": self._logprobs(chunk.logprobs, index)}
        else:
            body = {"index": index, "text": chunk.text, "logprobs": self._logprobs(chunk.logprobs, index)}
            self.offsets[index] = self.offsets.get(index, 0) + len(chunk.text)
        body["finish_reason"] = chunk.finish_reason
        return {**self._head(self._chunk_object), "choices": [body]}

    def usage_chunk(self, usages: Sequence[Usage]) -> dict:
        """stream_options.include_usage: one last chunk with no choices and the whole request's usage."""
        return {**self._head(self._chunk_object), "choices": [], "usage": usage_body(usages)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _choice(self, choice: Choice) -> dict:
        logprobs = self._logprobs(choice.logprobs, choice.index)
        if self.chat:
            message = {"role": "assistant", "content": choice.text}
            return {
                "index": choice.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    def _logprobs(self, logprobs: Sequence | None, index: int) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(logprobs or [], self.texts)
        return completion_logprobs(logprobs or [], self.texts, self.offsets.get(index, 0))

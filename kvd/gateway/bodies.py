"""Response bodies of /v1/completions and /v1/chat/completions, whole and as stream chunks."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.gateway.choices import Choice
from kvd.gateway.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from kvd_client import Chunk, TokenLogprob, ToolCall, Usage


@dataclass
class EchoedPrompt:
    """A completions prompt that `echo` puts before its choices' text."""

    text: str
    token_ids: list[int]


def returned_usage(usage: Usage, num_tokens: int) -> Usage:
    """The daemon's usage with `completion_tokens` the count of the tokens returned, as OpenAI and vLLM report
    it: the daemon counts every token sampled, those of a stop string that cut the text too."""
    return dataclasses.replace(usage, completion_tokens=num_tokens)


def usage_body(usages: Sequence[Usage], n: int = 1) -> dict:
    """Choices k*n .. k*n+n-1 share prompt k, so each prompt is counted once; completions add up."""
    prompt = sum(u.prompt_tokens for i, u in enumerate(usages) if i % n == 0)
    cached = sum(u.cached_tokens for i, u in enumerate(usages) if i % n == 0)
    completion = sum(u.completion_tokens for u in usages)
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    details = {}
    drafted = sum(u.draft_tokens for u in usages)
    if drafted:  # OpenAI's names for predicted outputs, which n-gram drafts are
        accepted = sum(u.accepted_draft_tokens for u in usages)
        details = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}
    reasoning = sum(u.reasoning_tokens for u in usages)
    if reasoning:
        details["reasoning_tokens"] = reasoning
    if details:
        body["completion_tokens_details"] = details
    return body


def tool_call_body(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class Reply:
    """The identity every body of one HTTP reply shares, and per-choice streaming state."""

    model: str
    chat: bool
    want_logprobs: bool
    texts: TokenTexts
    n: int = 1  # choices per prompt
    echo: list[EchoedPrompt] | None = None
    # stream_options.continuous_usage_stats: each prompt's token count (None: usage only in the last chunk).
    prompt_counts: list[int] | None = None
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)  # completions: each choice's token texts so far
    started: set[int] = field(default_factory=set)  # chat: choices whose first delta (the role) went out
    generated: dict[int, int] = field(default_factory=dict)  # tokens of each choice so far
    finals: dict[int, Usage] = field(default_factory=dict)  # streamed: each finished choice's returned_usage

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{secrets.token_hex(12)}"

    def whole(self, choices: Sequence[Choice]) -> dict:
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [self._choice(c) for c in choices],
            "usage": usage_body([returned_usage(c.usage, len(c.token_ids)) for c in choices], self.n),
        }

    def chunks(self, index: int, chunk: Chunk) -> list[dict]:
        """The stream bodies for one daemon chunk: one, or with tool calls a delta for them and the finish."""
        self.generated[index] = self.generated.get(index, 0) + len(chunk.token_ids)
        if chunk.finished:
            self.finals[index] = returned_usage(chunk.usage, self.generated[index])
        if not (chunk.text or chunk.reasoning or chunk.logprobs or chunk.finished) and (
            index in self.started or not self.chat
        ):
            return []  # tokens whose text the daemon holds back (a possible stop string or tool call)
        usage = self._running_usage(index, chunk)
        logprobs = self._logprobs(chunk.logprobs, index)
        if not self.chat:
            body = {"index": index, "text": chunk.text, "logprobs": logprobs}
            # A token goes out once its text starts, so a chunk's text may begin inside an earlier token's:
            # offsets follow the tokens' texts, as the whole reply's do.
            added = sum(len(self.texts[lp.token_id]) for lp in chunk.logprobs or [])
            self.offsets[index] = self.offsets.get(index, 0) + added
            return [self._chunk_body(index, body, chunk.finish_reason, usage)]
        delta = self._delta(index, chunk.text, logprobs, chunk.reasoning)
        if not chunk.tool_calls:
            return [self._chunk_body(index, delta, chunk.finish_reason, usage)]
        bodies = []
        if chunk.text or chunk.reasoning or logprobs:
            bodies.append(self._chunk_body(index, delta, None, usage))
        calls = [{"index": k, **tool_call_body(c)} for k, c in enumerate(chunk.tool_calls)]
        delta = self._delta(index, None, None)
        bodies.append(
            self._chunk_body(index, {**delta, "delta": {**delta["delta"], "tool_calls": calls}}, None, usage)
        )
        bodies.append(
            self._chunk_body(
                index, {"index": index, "delta": {}, "logprobs": None}, chunk.finish_reason, usage
            )
        )
        return bodies

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: one last chunk with no choices and the whole request's usage."""
        usages = [self.finals[i] for i in sorted(self.finals)]
        return {**self._head(self._chunk_object), "choices": [], "usage": usage_body(usages, self.n)}

    def _delta(self, index: int, content: str | None, logprobs: dict | None, reasoning: str = "") -> dict:
        # A reasoning model's thinking as vLLM and DeepSeek send it: reasoning_content beside the content.
        delta: dict = (
            {"reasoning_content": reasoning, "content": content or None}
            if reasoning
            else {"content": content}
        )
        if index not in self.started:
            self.started.add(index)
            delta = {"role": "assistant", **delta}
        elif content is None:
            delta = {}
        return {"index": index, "delta": delta, "logprobs": logprobs}

    def _chunk_body(self, index: int, choice: dict, finish_reason: str | None, usage: dict | None) -> dict:
        body = {**self._head(self._chunk_object), "choices": [{**choice, "finish_reason": finish_reason}]}
        if usage is not None:
            body["usage"] = usage
        return body

    def _running_usage(self, index: int, chunk: Chunk) -> dict | None:
        if self.prompt_counts is None:
            return None
        if chunk.finished:
            return usage_body([self.finals[index]])
        prompt = self.prompt_counts[index // self.n]
        completion = self.generated[index]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _choice(self, choice: Choice) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": choice.text}
            if choice.reasoning:
                message["reasoning_content"] = choice.reasoning
            if choice.tool_calls:
                message["content"] = choice.text or None
                message["tool_calls"] = [tool_call_body(c) for c in choice.tool_calls]
            return {
                "index": choice.index,
                "message": message,
                "logprobs": self._logprobs(choice.logprobs, choice.index),
                "finish_reason": choice.finish_reason,
            }
        text, logprobs = choice.text, self._logprobs(choice.logprobs, choice.index)
        if self.echo is not None:
            prompt = self.echo[choice.index // self.n]
            text = prompt.text + text
            if self.want_logprobs:
                entries = choice.prompt_logprobs or [None] * len(prompt.token_ids)
                tokens = [*zip(prompt.token_ids, entries, strict=True)]
                tokens += [(lp.token_id, lp) for lp in choice.logprobs]
                logprobs = completion_logprobs(tokens, self.texts, 0)
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None, index: int) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(logprobs or [], self.texts)
        tokens = [(lp.token_id, lp) for lp in logprobs or []]
        return completion_logprobs(tokens, self.texts, self.offsets.get(index, 0))

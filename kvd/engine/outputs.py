"""What the engine hands back: each step's output, per-request increments and whole completions."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from kvd.engine.sampler import SampledToken
from kvd.request.tool_parse import ToolCall


@dataclass
class RequestOutput:
    """One step's increment of one request."""

    request_id: Hashable
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished
    logprobs: list[SampledToken] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # With the first token of a request that asked for them: one entry per prompt token, None for the first.
    prompt_logprobs: list[SampledToken | None] | None = None
    embedding: list[float] | None = None  # an embed request's vector, in its only output
    # Speculative decoding: the request's draft tokens so far, and those its own tokens confirmed.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    stop_string: str | None = None  # on the last increment: the stop string that ended the text, if one did

    def then(self, later: RequestOutput) -> RequestOutput:
        """This increment followed by a later one of the same request, as one (a step's verified tokens go out
        together)."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass
class EngineStepOutput:
    """Everything one `LLMEngine.step` produced: the increments (finished requests included) and preemptions."""

    outputs: list[RequestOutput]
    # One id per preemption (a running request's blocks freed so that another's decode could grow; it is
    # requeued at the front and recomputed), the same events `stats()["num_preemptions"]` counts: a request may
    # repeat, and a victim re-admitted within the step is listed too.
    preempted: list[Hashable]


@dataclass
class CompletionOutput:
    """A whole generated completion (the offline API's result)."""

    prompt: str | list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[SampledToken] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[SampledToken | None] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat with tools: the calls, not in `text`
    reasoning: str = ""  # a reasoning model's chat: its thinking section, not in `text`

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens

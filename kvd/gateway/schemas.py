"""The OpenAI request bodies the gateway accepts, and their translation into kvd sampling fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI's documented default for /v1/completions; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are rejected, as the daemon rejects them: a setting the
    gateway silently ignored would give results the caller did not ask for."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility; kvd does not use it
    # Extensions (vLLM's names), passed through to the daemon: extra_body={"top_k": 20} in the openai client.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_fields(self, max_tokens: int, choice: int) -> dict[str, Any]:
        """The daemon's sampling fields for choice number `choice` of this request."""
        fields = self.model_dump(
            include={
                "stop",
                "temperature",
                "top_p",
                "presence_penalty",
                "frequency_penalty",
                "top_k",
                "min_p",
                "repetition_penalty",
                "ignore_eos",
                "stop_token_ids",
                "cache_salt",
            },
            exclude_none=True,
        )
        fields["max_tokens"] = max_tokens
        fields["logprobs"] = self.num_logprobs
        if self.seed is not None:
            # n choices with one seed would be n copies of the same text.
            fields["seed"] = self.seed + choice
        return fields

    @property
    def num_logprobs(self) -> int | None:
        raise NotImplementedError


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: Literal[False] = False  # echoing the prompt is not supported
    suffix: None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ValueError(
                    "one prompt per request: send several requests (or use n) instead of a batch"
                )
            self.prompt = self.prompt[0]
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The message's text; content parts must all be text (kvd serves text models)."""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        for message in self.messages:
            message.text()
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

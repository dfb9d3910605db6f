"""The OpenAI request bodies the gateway accepts, and their translation into kvd request fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvd.request.sampling_params import MAX_SEED

# OpenAI's documented default for /v1/completions; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is n daemon requests)

# Fields the daemon takes under the same name, when set.
_PASSED_THROUGH = {
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
    "regex",
    "grammar",
    "speculative",
}


class Strict(BaseModel):
    """Unknown fields are rejected, as the daemon rejects them: a setting silently ignored would give results
    the caller did not ask for. A field sent as null takes its default, as OpenAI's API reads it (its clients
    send null for what they leave unset)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JsonSchemaFormat(Strict):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # The output always matches the schema (kvd's grammar is strict); the description only informs a model.
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self

    def daemon_fields(self) -> dict[str, Any]:
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema.schema_ is None):
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json_schema": self.json_schema.schema_}
        return {}


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _Request(Strict):
    """Fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as decimal strings, as OpenAI and the daemon take
    # None of these changes the output. `user` and `safety_identifier` name the end user: the caller whose fair
    # share of the daemon the request takes (kvd.gateway.callers). `store` and `metadata` are for OpenAI's
    # stored completions, `service_tier` picks a latency tier, and `prompt_cache_key` is a cache-routing hint
    # (kvd's prefix cache needs none; `cache_salt` is the isolating key): accepted and ignored.
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # Extensions (vLLM's names), passed through to the daemon: extra_body={"top_k": 20} in the openai client.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # Checked here as the daemon checks its own: the daemon sees the caller's salt derived from it
    # (kvd.gateway.salts), not this one.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    regex: str | None = None
    grammar: str | None = None
    speculative: bool | None = (
        None  # false: no speculative drafts for this request (never changes its tokens)
    )
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def daemon_fields(self, max_tokens: int, choice: int) -> dict[str, Any]:
        """The daemon's fields (all but the prompt) for choice number `choice` of this request."""
        fields = self.model_dump(include=_PASSED_THROUGH, exclude_none=True)
        fields["max_tokens"] = max_tokens
        fields["logprobs"] = self.num_logprobs
        if self.logit_bias:
            fields["logit_bias"] = self.logit_bias
        if self.seed is not None:
            # n choices with one seed would be n copies of the same text.
            fields["seed"] = self.seed + choice
        if self.response_format is not None:
            fields.update(self.response_format.daemon_fields())
        return fields

    def refusals(self) -> list[tuple[str, str]]:
        """(param, reason) for each field whose value the gateway cannot honour."""
        refused = []
        if self.requested_max_tokens == 0:
            refused.append((self.max_tokens_param, "must be at least 1 (0 only with echo)"))
        if self.stream_options is not None and not self.stream:
            refused.append(("stream_options", "only with stream: true"))
        if self.seed is not None and self.seed <= MAX_SEED < self.seed + self.n - 1:
            refused.append(
                (
                    "seed",
                    f"choice j takes seed + j: with n = {self.n}, seed must be at most {MAX_SEED - self.n + 1}",
                )
            )
        return refused

    def param_names(self) -> dict[str, str]:
        """The request's name for each daemon field whose name differs, for the daemon's errors."""
        return {
            "max_tokens": self.max_tokens_param,
            "prompt_token_ids": "prompt",
            "input": "prompt",
            "json_schema": "response_format.json_schema.schema",
            "json_object": "response_format",
        }

    def choice_field(self, choice: int, field: str) -> str:
        """The field of choice `choice`'s daemon request, as that request's errors should name it."""
        return field

    @property
    def num_logprobs(self) -> int | None:
        raise NotImplementedError


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None  # accepted when it equals n: then it changes nothing
    suffix: None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def has_prompt_list(self) -> bool:
        """Whether `prompt` is a list of prompts, not one prompt (a text or a token id list)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str | list)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token id list, or a list of them."""
        return list(self.prompt) if self.has_prompt_list else [self.prompt]

    def choice_field(self, choice: int, field: str) -> str:
        # Each prompt of a list is n daemon requests of its own, whose prompt the daemon names without an index.
        if self.has_prompt_list and field in ("prompt", "prompt_token_ids"):
            return f"{field}[{choice // self.n}]"
        return field

    def refusals(self) -> list[tuple[str, str]]:
        # With echo, max_tokens 0 scores the prompt alone: the one refusal echo lifts.
        refused = [r for r in super().refusals() if not (self.echo and r[0] == self.max_tokens_param)]
        if not 1 <= len(self.prompts()) <= MAX_PROMPTS:
            refused.append(("prompt", f"between 1 and {MAX_PROMPTS} prompts per request"))
        if self.echo and self.stream:
            refused.append(("echo", "echo is not supported with stream: send it without stream"))
        if self.best_of is not None and self.best_of != self.n:
            refused.append(("best_of", "only best_of equal to n (or unset) is supported"))
        return refused


class ToolCallFunction(Strict):
    name: str
    arguments: str


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# OpenAI's efforts as the daemon's (which has low, medium and high).
EFFORTS = {"minimal": "low", "xhigh": "high", "max": "high"}


class ChatMessage(Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None  # the openai client sends back what a reply had; kvd's replies have no refusal
    # An earlier reply's thinking, sent back by clients: left out of the prompt, as reasoning templates drop it.
    reasoning_content: str | None = None

    def text(self) -> str | None:
        """The message's text; content parts must all be text (kvd serves text models)."""
        if not isinstance(self.content, list):
            return self.content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        return "".join(part["text"] for part in self.content)

    def daemon_message(self) -> dict[str, Any]:
        message = self.model_dump(include={"role", "name", "tool_call_id", "tool_calls"}, exclude_none=True)
        # The role and template conversions (developer, tool calls) are the daemon's.
        return {**message, "content": self.text()}


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # without tools it changes nothing
    # Predicted outputs only speed OpenAI's generation up; the output is the same without them.
    prediction: dict[str, Any] | None = None
    # Reasoning models: OpenAI's effort ("none" turns thinking off), vLLM's template switch
    # ({"enable_thinking": false}) and kvd's token budget for the thinking section.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_budget: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.daemon_message() for m in self.messages]

    def daemon_fields(self, max_tokens: int, choice: int) -> dict[str, Any]:
        fields = super().daemon_fields(max_tokens, choice)
        if self.tools:
            fields["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            fields["parallel_tool_calls"] = self.parallel_tool_calls
            if isinstance(self.tool_choice, BaseModel):
                fields["tool_choice"] = self.tool_choice.model_dump()
            else:
                fields["tool_choice"] = self.tool_choice
        return {**fields, **self.reasoning_fields()}

    def reasoning_fields(self) -> dict[str, Any]:
        """The daemon's think / reasoning_effort / reasoning_budget."""
        fields: dict[str, Any] = {}
        if self.reasoning_budget is not None:
            fields["reasoning_budget"] = self.reasoning_budget
        think = (self.chat_template_kwargs or {}).get("enable_thinking")
        if think is not None:
            fields["think"] = think
        if self.reasoning_effort == "none":
            fields["think"] = False
        elif self.reasoning_effort is not None:
            fields["reasoning_effort"] = EFFORTS.get(self.reasoning_effort, self.reasoning_effort)
        return fields

    def refusals(self) -> list[tuple[str, str]]:
        refused = super().refusals()
        if self.top_logprobs is not None and not self.logprobs:
            refused.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.tool_choice not in (None, "none") and not self.tools:
            refused.append(("tool_choice", "tool_choice needs tools"))
        for key in self.chat_template_kwargs or {}:
            if key != "enable_thinking":
                refused.append((f"chat_template_kwargs.{key}", "kvd passes enable_thinking only"))
        for i, message in enumerate(self.messages):
            try:
                message.text()
            except ValueError as e:
                refused.append((f"messages[{i}].content", str(e)))
        return refused

    def param_names(self) -> dict[str, str]:
        thinking = (
            "reasoning_effort"
            if self.reasoning_effort is not None
            else "chat_template_kwargs.enable_thinking"
        )
        return {**super().param_names(), "logprobs": "top_logprobs", "think": thinking}

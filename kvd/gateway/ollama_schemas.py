"""Ollama's request bodies (/api/chat, /api/generate, /api/embed) and their translation into kvd fields."""

from __future__ import annotations

import json
from typing import Any, Literal

from kvd.gateway.schemas import Strict, ToolDef

# Ollama option -> the daemon's field, where the names differ.
_OPTION_FIELDS = {"repeat_penalty": "repetition_penalty", "num_predict": "max_tokens"}
# The daemon's fields named as an Ollama request names them, for the daemon's errors.
PARAM_NAMES = {
    "reasoning_effort": "think",
    **{f: f"options.{f}" for f in ("temperature", "top_k", "top_p", "min_p", "seed", "stop")},
    **{f: f"options.{f}" for f in ("presence_penalty", "frequency_penalty")},
    **{daemon: f"options.{option}" for option, daemon in _OPTION_FIELDS.items()},
    "json_schema": "format",
    "json_object": "format",
    "logprobs": "top_logprobs",
}


class Options(Strict):
    """The options that change sampling, mapped onto the daemon's fields; others are refused (Ollama would
    ignore them silently), except the runner's load-time settings, which change no output."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    num_predict: int | None = None  # -1 (infinite) and -2 (fill the context): up to the context's end
    seed: int | None = None  # -1: a random one, as Ollama reads it
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Load-time settings of Ollama's runner; kvd's daemon fixes its own at start.
    numa: bool | None = None
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: int | None = None

    def daemon_fields(self, max_model_len: int) -> dict[str, Any]:
        sampling = self.model_dump(
            include={"temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty"}
            | {"presence_penalty", "frequency_penalty"},
            exclude_none=True,
        )
        fields = {_OPTION_FIELDS.get(k, k): v for k, v in sampling.items()}
        if self.seed == -1:
            del fields["seed"]
        predict = self.num_predict
        fields["max_tokens"] = max_model_len if predict is None or predict in (-1, -2) else predict
        return fields


class _Request(Strict):
    model: str
    stream: bool = True  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None  # how long the model stays loaded idle after this request
    think: bool | Literal["low", "medium", "high"] | None = (
        None  # a reasoning model's thinking, or its effort
    )
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def daemon_fields(self, max_model_len: int) -> dict[str, Any]:
        fields = (self.options or Options()).daemon_fields(max_model_len)
        if self.format == "json":
            fields["json_object"] = True
        elif isinstance(self.format, dict):
            fields["json_schema"] = self.format
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        if self.keep_alive is not None:
            fields["keep_alive"] = self.keep_alive
        return fields

    def reasoning_fields(self) -> dict[str, Any]:
        """The daemon's chat fields for `think`: on or off, or an effort (the daemon's reasoning_effort)."""
        if isinstance(self.think, bool):
            return {"think": self.think}
        return {} if self.think is None else {"reasoning_effort": self.think}

    def refusals(self) -> list[tuple[str, str]]:
        refused = []
        if self.top_logprobs and not self.logprobs:
            refused.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        return refused


class ToolCallFunction(Strict):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(Strict):
    role: str
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class ChatRequest(_Request):
    messages: list[Message] | None = None
    tools: list[ToolDef] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The daemon's messages: arguments as JSON text, and each tool result tied to its call by id (Ollama
        ties them by order: the k-th tool message after a turn with calls answers its k-th call)."""
        out: list[dict[str, Any]] = []
        calls: list[str] = []  # ids of the last assistant turn's calls not yet answered
        for i, m in enumerate(self.messages or []):
            message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                ids = [c.id or f"call_{i}_{k}" for k, c in enumerate(m.tool_calls)]
                message["tool_calls"] = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)},
                    }
                    for call_id, c in zip(ids, m.tool_calls, strict=True)
                ]
                calls = ids
            if m.role == "tool":
                if m.tool_name:
                    message["name"] = m.tool_name
                if calls:
                    message["tool_call_id"] = calls.pop(0)
            out.append(message)
        return out

    def daemon_fields(self, max_model_len: int) -> dict[str, Any]:
        fields = super().daemon_fields(max_model_len)
        if self.tools:
            fields["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return fields

    def refusals(self) -> list[tuple[str, str]]:
        refused = super().refusals()
        for i, m in enumerate(self.messages or []):
            if m.images:
                refused.append((f"messages[{i}].images", "kvd serves text models: no images"))
        return refused


class GenerateRequest(_Request):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        """Not raw: the prompt as a user turn (after the system prompt), in the model's chat template."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.prompt}]

    def refusals(self) -> list[tuple[str, str]]:
        refused = super().refusals()
        unsupported = {
            "suffix": "fill-in-the-middle is not supported",
            "template": "the model's own chat template applies; send raw: true with a formatted prompt instead",
            "context": "kvd returns no context; send the history with /api/chat",
            "images": "kvd serves text models: no images",
            "width": "kvd generates no images",
            "height": "kvd generates no images",
            "steps": "kvd generates no images",
        }
        refused += [(name, why) for name, why in unsupported.items() if getattr(self, name)]
        if self.raw and self.system:
            refused.append(("system", "a raw prompt has no system prompt: put it in the prompt"))
        if self.raw and self.think is not None:
            refused.append(
                ("think", "a raw prompt has no template to think in: write the section in the prompt")
            )
        return refused


class EmbedRequest(Strict):
    model: str
    input: str | list[str]
    # Ollama truncates over-long inputs by default; kvd refuses them (400 naming input[i]) either way.
    truncate: bool | None = None
    options: Options | None = None  # sampling options do not change an embedding
    keep_alive: float | str | None = None
    dimensions: int | None = None


class EmbeddingsRequest(Strict):
    """The older /api/embeddings: one prompt, one vector."""

    model: str
    prompt: str
    options: Options | None = None
    keep_alive: float | str | None = None

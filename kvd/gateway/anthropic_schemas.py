"""Anthropic's Messages API request bodies (/v1/messages, /v1/messages/count_tokens) and their translation into
the daemon's chat: system prompt, content blocks, tool use and tool results, sampling fields."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from kvd.gateway.schemas import Strict

# The daemon's fields named as a Messages request names them, for the daemon's errors.
PARAM_NAMES = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "json_schema": "output_config.format",
    "think": "thinking",
    "reasoning_budget": "thinking.budget_tokens",
    "reasoning_effort": "output_config.effort",
}


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: str | None = None  # kvd's prefix cache keeps whatever fits, with no marks needed


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(Strict):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(Strict):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict):
    """A thinking block of an earlier assistant turn, sent back as the client received it."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolDef(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # kvd's calls follow the schema whenever a grammar forces them
    eager_input_streaming: bool | None = None  # a call's input is sent whole once it is parsed

    def daemon_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def daemon_choice(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Diagnostics(Strict):
    previous_message_id: str | None = None  # kvd reports no cache diagnostics


class Metadata(Strict):
    user_id: str | None = None


class _Prompt(Strict):
    """What both routes read: the conversation and the tools it may call."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # kvd's prefix cache keeps whatever fits, with no marks needed

    def conversation(self) -> list[dict[str, Any]]:
        """The daemon's messages: the system prompt first; a user turn's tool results as tool messages (before
        its text, as the API orders them), an assistant turn's tool uses as its tool calls; earlier turns'
        thinking dropped (the API drops them from the context too)."""
        out: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        if system:
            out.append({"role": "system", "content": system})
        for m in self.messages:
            blocks = m.blocks()
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)})
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            if calls:
                out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": m.role, "content": text})
        return out

    def reasoning_fields(self) -> dict[str, Any]:
        """The daemon's think / reasoning_budget / reasoning_effort: thinking enabled with its budget, disabled,
        or (adaptive) as the model's template decides; the effort as the daemon's three."""
        fields: dict[str, Any] = {}
        if self.thinking is not None and self.thinking.type in ("enabled", "disabled"):
            fields["think"] = self.thinking.type == "enabled"
            if self.thinking.budget_tokens is not None and fields["think"]:
                fields["reasoning_budget"] = self.thinking.budget_tokens
        effort = self.output_config.effort if self.output_config is not None else None
        if effort is not None:
            fields["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(effort, effort)
        return fields

    def daemon_tools(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = [t.daemon_tool() for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.daemon_choice()
            if self.tool_choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    def refusals(self) -> list[tuple[str, str]]:
        refused = []
        if not self.messages:
            refused.append(("messages", "at least one message"))
        elif self.messages[-1].role == "assistant":  # Anthropic's prefill: the reply would go on from it
            where = f"messages[{len(self.messages) - 1}]"
            refused.append(
                (where, "kvd does not continue an assistant's prefilled reply yet: end with a user turn")
            )
        if (
            self.thinking is not None
            and self.thinking.type == "enabled"
            and self.thinking.budget_tokens is None
        ):
            refused.append(("thinking.budget_tokens", 'thinking of type "enabled" gives budget_tokens'))
        if self.tool_choice is not None:
            if self.tool_choice.type == "tool" and not self.tool_choice.name:
                refused.append(("tool_choice.name", 'tool_choice of type "tool" names the tool'))
            if self.tool_choice.type in ("any", "tool") and not self.tools:
                refused.append(("tool_choice", f'tool_choice of type "{self.tool_choice.type}" needs tools'))
        for i, tool in enumerate(self.tools or []):
            forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
            if tool.strict and not forced:  # only a forced call is held to its schema by a grammar
                refused.append(
                    (f"tools[{i}].strict", 'strict tools need tool_choice "any" or "tool" with kvd')
                )
        uses: set[str] = set()  # the ids of the previous assistant turn's tool uses
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and not m.content:
                refused.append((f"messages[{i}].content", "at least one content block"))
            for j, b in enumerate(m.blocks()):
                if isinstance(b, ToolResultBlock) and b.tool_use_id not in uses:
                    why = "answers no tool_use of the assistant's turn before it"
                    refused.append((f"messages[{i}].content[{j}].tool_use_id", why))
                where = f"messages[{i}].content[{j}]"
                if isinstance(b, ImageBlock | DocumentBlock):
                    refused.append((where, f"kvd serves text models: no {b.type} blocks"))
                elif isinstance(b, ToolResultBlock) and any(
                    isinstance(c, ImageBlock) for c in b.content or []
                ):
                    refused.append((f"{where}.content", "kvd serves text models: no image blocks"))
                if isinstance(b, ToolUseBlock) and m.role != "assistant":
                    refused.append((where, "tool_use blocks are the assistant's"))
                if isinstance(b, ToolResultBlock) and m.role != "user":
                    refused.append((where, "tool_result blocks are the user's"))
            if m.role == "assistant":
                uses = {b.id for b in m.blocks() if isinstance(b, ToolUseBlock)}
        return refused


def _result_text(block: ToolResultBlock) -> str:
    content = block.content or ""
    text = content if isinstance(content, str) else "".join(c.text for c in content)
    # The chat templates have no field for a failed call: the model reads that it failed.
    return f"Error: {text}" if block.is_error else text


class MessagesRequest(_Prompt):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    # What changes where or how fast Anthropic serves a request, not what it answers: kvd has one tier, one
    # speed, one place, no workspaces.
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    workspace_id: str | None = None
    user_profile_id: str | None = None
    diagnostics: Diagnostics | None = None
    seed: int | None = None  # kvd's: a sampled reply drawn the same way each time (extra_body with the SDKs)

    def daemon_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            **self.daemon_tools(),
            **self.reasoning_fields(),
        }
        sampling = ("temperature", "top_p", "top_k", "seed")
        for name, value in ((name, getattr(self, name)) for name in sampling):
            if value is not None:
                fields[name] = value
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.output_config is not None and self.output_config.format is not None:
            fields["json_schema"] = self.output_config.format.schema_
        return fields

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata else None

    def refusals(self) -> list[tuple[str, str]]:
        refused = super().refusals()
        if self.max_tokens < 1:
            refused.append(("max_tokens", "at least 1"))
        return refused


class CountTokensRequest(_Prompt):
    pass

"""OpenAI's Responses API request body (/v1/responses) and its translation into the daemon's chat: input items
(messages, function calls and their outputs, reasoning sent back), instructions, function tools, text.format,
reasoning effort, sampling fields."""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from kvd.gateway.schemas import EFFORTS, Strict

# The daemon's fields named as a Responses request names them, for the daemon's errors.
PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "json_schema": "text.format.schema",
    "json_object": "text.format",
    "think": "reasoning.effort",
    "reasoning_effort": "reasoning.effort",
}
TEXT_PARTS = ("input_text", "output_text")


class MessageItem(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return (
            self.output if isinstance(self.output, str) else "".join(p.get("text", "") for p in self.output)
        )


class ReasoningItem(Strict):
    """An earlier reply's reasoning sent back: left out of the prompt, as reasoning templates drop it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(union_mode="left_to_right")
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # a forced call follows its schema (kvd's grammars are strict)

    def daemon_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None  # function tools; others are refused by name
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool = True
    # What changes where or how OpenAI serves a request, or what it records, not what it answers.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    # kvd's extensions (extra_body), as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    reasoning_budget: int | None = None

    def function_tools(self) -> list[FunctionTool]:
        """The function tools that are well formed (refusals() names the others)."""
        tools = []
        for tool in self.tools or []:
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError:
                continue
        return tools

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return self.input

    def turns(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation without the instructions (which a next response does not inherit): `history` (the
        previous response's turns), then each item: consecutive function calls as one assistant turn's calls,
        each function output as a tool message."""
        out = copy.deepcopy(history)
        for item in self.items():
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # its text, or calls before this one
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def conversation(self, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The daemon's messages: the instructions as the system prompt, then `turns`."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return [*system, *turns]

    def daemon_fields(self, max_tokens: int) -> dict[str, Any]:
        fields: dict[str, Any] = {"max_tokens": self.max_output_tokens or max_tokens}
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "reasoning_budget"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        tools = self.function_tools()
        if tools:
            fields["tools"] = [t.daemon_tool() for t in tools]
            if self.parallel_tool_calls is not None:
                fields["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema":
            fields["json_schema"] = text_format.schema_
        elif text_format is not None and text_format.type == "json_object":
            fields["json_object"] = True
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort == "none":
            fields["think"] = False
        elif effort is not None:
            fields["reasoning_effort"] = EFFORTS.get(effort, effort)
        return fields

    def refusals(self) -> list[tuple[str, str]]:
        refused = []
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            refused.append(("input", "at least one item"))
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                refused.append((f"tools[{i}].type", "kvd calls function tools only"))
                continue
            try:
                FunctionTool.model_validate(tool)
            except ValidationError as e:
                error = e.errors()[0]
                refused.append((".".join(map(str, (f"tools[{i}]", *error["loc"]))), error["msg"]))
        if self.tool_choice not in (None, "none") and not self.function_tools():
            refused.append(("tool_choice", "tool_choice needs tools"))
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_schema" and text_format.schema_ is None:
            refused.append(("text.format.schema", "a json_schema format gives its schema"))
        if self.background:
            refused.append(("background", "kvd answers in the foreground: leave background unset"))
        for i, item in enumerate(self.items()):
            parts, where = [], f"input[{i}]"
            if isinstance(item, MessageItem) and isinstance(item.content, list):
                parts, where = item.content, f"input[{i}].content"
            elif isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list):
                parts, where = item.output, f"input[{i}].output"
            for j, part in enumerate(parts):
                if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                    refused.append((f"{where}[{j}]", "kvd serves text models: text parts only"))
        return refused

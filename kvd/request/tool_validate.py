"""Tool calling's request side: validate the tools, the tool_choice and the tool-call history of a chat request.

Pure Python (no torch): the protocol layer and `kvd.LLM.chat` refuse bad tools here, naming the field at fault.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

import jsonschema

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """Bad tools / tool_choice / tool-call history; `field` names the request field (e.g. "tools[2].function.parameters",
    "messages[3].tool_call_id", "tool_choice")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str | None
    parameters: dict  # a JSON schema ({"type": "object", "properties": {}} when absent)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"


def parse_tools(value: object) -> list[Tool]:
    """The tools of an OpenAI-style list [{"type": "function", "function": {...}}]; None (absent) is no tools."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolError("tools", "must be a list of tools")
    if len(value) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools, got {len(value)}")
    tools: list[Tool] = []
    seen: set[str] = set()
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolError(where, "must be an object")
        _known_keys(entry, ("type", "function"), where)
        if entry.get("type") != "function":
            raise ToolError(f"{where}.type", f'must be "function", got {entry.get("type")!r}')
        function = entry.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function", "must be an object")
        tool = _parse_function(function, f"{where}.function")
        if tool.name in seen:
            raise ToolError(f"{where}.function.name", f"duplicate tool name {tool.name!r}")
        seen.add(tool.name)
        tools.append(tool)
    return tools


def _parse_function(function: dict, where: str) -> Tool:
    _known_keys(function, ("name", "description", "parameters", "strict"), where)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(
            f"{where}.name", f"must be 1 to 64 characters of A-Z, a-z, 0-9, _ and -, got {name!r}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description", "must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.strict", "must be a boolean")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = copy.deepcopy(_EMPTY_PARAMETERS)
    _check_parameters(parameters, f"{where}.parameters")
    return Tool(name, description, parameters)


def _check_parameters(schema: object, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolError(where, "must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(str(part) for part in e.path)
        raise ToolError(where, f"not a valid JSON schema{f' at {at}' if at else ''}: {e.message}") from None
    # Arguments are always a JSON object: a schema of another type could never be satisfied.
    if "type" in schema and schema["type"] != "object":
        raise ToolError(where, f'must describe an object ("type": "object"), got "type": {schema["type"]!r}')


def parse_tool_choice(value: object, tools: list[Tool]) -> ToolChoice:
    """The request's tool_choice; absent means "auto" with tools and "none" without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ToolError("tool_choice", '"required" needs tools')
        return ToolChoice(str(value))
    if isinstance(value, dict):
        function = value.get("function")
        if value.get("type") != "function" or not isinstance(function, dict):
            raise ToolError("tool_choice", 'must be {"type": "function", "function": {"name": ...}}')
        _known_keys(value, ("type", "function"), "tool_choice")
        _known_keys(function, ("name",), "tool_choice.function")
        name = function.get("name")
        if not tools:
            raise ToolError("tool_choice", "names a function but the request has no tools")
        if name not in {tool.name for tool in tools}:
            raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools")
        return ToolChoice("named", name)
    raise ToolError("tool_choice", f'must be "none", "auto", "required" or a named function, got {value!r}')


def check_history(messages: list[dict]) -> None:
    """Refuse tool calls and tool results that do not fit together (see ToolError for the field named)."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        content = message.get("content")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ToolError(f"{where}.tool_calls", "only an assistant message may carry tool calls")
            if not isinstance(calls, list):
                raise ToolError(f"{where}.tool_calls", "must be a list")
            for j, call in enumerate(calls):
                call_id = _check_call(call, f"{where}.tool_calls[{j}]")
                if call_id in call_ids:
                    raise ToolError(f"{where}.tool_calls[{j}].id", f"duplicate tool call id {call_id!r}")
                call_ids.add(call_id)
        if content is None:
            if role != "assistant" or not calls:
                raise ToolError(
                    f"{where}.content", "may be null only in an assistant message with tool_calls"
                )
        elif not isinstance(content, str):
            raise ToolError(f"{where}.content", "must be a string")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ToolError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
            if call_id not in call_ids:
                raise ToolError(f"{where}.tool_call_id", f"{call_id!r} is not the id of an earlier tool call")


def _check_call(call: object, where: str) -> str:
    """The id of a valid history tool call."""
    if not isinstance(call, dict):
        raise ToolError(where, "must be an object")
    _known_keys(call, ("id", "type", "function"), where)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolError(f"{where}.id", "must be a non-empty string")
    if call.get("type", "function") != "function":
        raise ToolError(f"{where}.type", f'must be "function", got {call.get("type")!r}')
    function = call.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function", "must be an object")
    _known_keys(function, ("name", "arguments"), f"{where}.function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError(f"{where}.function.name", "must be a non-empty string")
    arguments_object(function.get("arguments"), f"{where}.function.arguments")
    return call_id


def _known_keys(value: dict, known: tuple[str, ...], where: str) -> None:
    """Unknown fields are refused, never ignored (as everywhere in the protocol)."""
    for key in value:
        if key not in known:
            raise ToolError(f"{where}.{key}", f"not a supported field (one of: {', '.join(known)})")


def arguments_object(arguments: object, where: str) -> dict:
    """A call's arguments, JSON text of an object, parsed (rendering a past call needs them as an object)."""
    if not isinstance(arguments, str):
        raise ToolError(where, "must be a string of JSON")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ToolError(where, f"not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ToolError(where, "must be the JSON of an object")
    return parsed

"""OpenAI-style tool calling: validate tools and history, render them for a chat template, constrain and parse calls.

Pure Python (no torch): the daemon calls it from a worker thread for chat requests that carry `tools`.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import jsonschema

from kvd.engine.json_schema import closed_schema

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}
# The JSON of a constrained call: one space after ',' and ':' (what json.dumps writes and what the templates
# render in past turns), nothing else; unknown schema keywords are ignored rather than refused.
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


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


@dataclass
class ToolCall:
    id: str  # "call_" + 24 hex chars
    name: str
    arguments: str  # JSON text of the arguments object


def _new_call(name: str, arguments: dict) -> ToolCall:
    return ToolCall("call_" + secrets.token_hex(12), name, json.dumps(arguments, ensure_ascii=False))


# ---------------------------------------------------------------------------------------------------------------
# Request validation
# ---------------------------------------------------------------------------------------------------------------


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
    _arguments_object(function.get("arguments"), f"{where}.function.arguments")
    return call_id


def _known_keys(value: dict, known: tuple[str, ...], where: str) -> None:
    """Unknown fields are refused, never ignored (as everywhere in the protocol)."""
    for key in value:
        if key not in known:
            raise ToolError(f"{where}.{key}", f"not a supported field (one of: {', '.join(known)})")


def _arguments_object(arguments: object, where: str) -> dict:
    if not isinstance(arguments, str):
        raise ToolError(where, "must be a string of JSON")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ToolError(where, f"not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ToolError(where, "must be the JSON of an object")
    return parsed


# ---------------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------------


class ToolFormat(Enum):
    HERMES = "hermes"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}}


@dataclass(frozen=True)
class ToolTemplate:
    format: ToolFormat
    native: bool  # True: the model's own chat template renders tools; False: kvd's fallback prompt


def detect_tool_template(chat_template: str | None) -> ToolTemplate:
    """How the model with this chat template calls tools, and whether the template itself renders them."""
    text = chat_template or ""
    if _HERMES_OPEN in text:  # Qwen2.5, Qwen3, Hermes
        return ToolTemplate(ToolFormat.HERMES, native=True)
    if _PYTHON_TAG in text or ('"parameters"' in text and ("ipython" in text or "tools" in text)):
        return ToolTemplate(ToolFormat.LLAMA3_JSON, native=True)  # Llama 3.1 / 3.2 / 3.3
    if "tools" in text:
        return ToolTemplate(ToolFormat.HERMES, native=True)
    return ToolTemplate(ToolFormat.HERMES, native=False)


def render_messages(
    messages: list[dict], tools: list[Tool], template: ToolTemplate, developer_role: bool
) -> tuple[list[dict], list[dict] | None]:
    """(conversation, tools) for tokenizer.apply_chat_template(conversation, tools=tools)."""
    conversation = [_template_message(m, i, developer_role) for i, m in enumerate(messages)]
    if template.native:
        return conversation, [_tool_spec(tool) for tool in tools] or None
    return _fallback_conversation(conversation, tools, template.format), None


def _template_message(message: dict, index: int, developer_role: bool) -> dict:
    out = dict(message)
    if out.get("role") == "developer" and not developer_role:
        out["role"] = "system"
    if out.get("tool_calls"):
        # HF templates json-encode the arguments themselves (`arguments | tojson`).
        out["tool_calls"] = [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": _arguments_object(
                        call["function"].get("arguments"),
                        f"messages[{index}].tool_calls[{j}].function.arguments",
                    ),
                },
            }
            for j, call in enumerate(out["tool_calls"])
        ]
    return out


def _tool_spec(tool: Tool) -> dict:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def _call_text(fmt: ToolFormat, name: str, arguments: dict) -> str:
    """One call as the model is to write it."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{_HERMES_OPEN}\n{body}\n{_HERMES_CLOSE}"


def _calls_text(fmt: ToolFormat, calls: list[tuple[str, dict]]) -> str:
    separator = "; " if fmt is ToolFormat.LLAMA3_JSON else "\n"
    return separator.join(_call_text(fmt, name, arguments) for name, arguments in calls)


def _fallback_prompt(tools: list[Tool], fmt: ToolFormat) -> str:
    listing = "\n".join(json.dumps(_tool_spec(tool)["function"], ensure_ascii=False) for tool in tools)
    if fmt is ToolFormat.LLAMA3_JSON:
        how = (
            'To call a tool, answer with only {"name": <tool name>, "parameters": <arguments as a JSON object>}; '
            'separate several calls with "; ".'
        )
    else:
        how = (
            "To call a tool, answer with one block per call, each exactly like this:\n"
            f'{_HERMES_OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{_HERMES_CLOSE}'
        )
    return (
        "You can call these tools; each is a JSON object with the tool's name, what it does and the JSON schema "
        f"of its arguments:\n<tools>\n{listing}\n</tools>\n\n{how}\n"
        "A tool's result comes back inside <tool_response></tool_response>. "
        "If no tool is needed, answer normally."
    )


def _fallback_conversation(conversation: list[dict], tools: list[Tool], fmt: ToolFormat) -> list[dict]:
    """The conversation as role/content strings only, for a template that knows nothing of tools."""
    out: list[dict] = []
    for message in conversation:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            previous = out[-1] if out else None
            # Results of parallel calls share one user turn, as the templates that know tools render them.
            if previous is not None and previous.get("_tool_results"):
                previous["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            content = (content + "\n" if content else "") + _calls_text(fmt, calls)
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        prompt = _fallback_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Constrained decoding
# ---------------------------------------------------------------------------------------------------------------


def tool_call_grammar(
    tools: list[Tool], choice: ToolChoice, template: ToolTemplate, parallel: bool
) -> str | None:
    """A Lark grammar (llguidance's dialect) that forces the output to be tool call(s); None unless the choice
    is "required" (any tool; one or more calls when parallel) or "named" (that tool, once)."""
    if choice.mode == "required":
        chosen, many = tools, parallel
    elif choice.mode == "named":
        chosen, many = [tool for tool in tools if tool.name == choice.name], False
    else:
        return None
    if not chosen:
        raise ToolError("tool_choice", "no tool to call")
    key = "parameters" if template.format is ToolFormat.LLAMA3_JSON else "arguments"
    schema = _calls_schema(chosen, key)
    if template.format is ToolFormat.LLAMA3_JSON:
        separator, call = '"; "', "body"
    else:
        separator, call = r'"\n"', rf'"{_HERMES_OPEN}\n" body "\n{_HERMES_CLOSE}"'
    start = f"call ({separator} call)*" if many else "call"
    return f"%llguidance {{}}\nstart: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


def _calls_schema(tools: list[Tool], key: str) -> dict:
    """The JSON schema of one call object {"name": NAME, key: ARGUMENTS} to any of `tools`."""
    defs: dict[str, dict] = {}
    options = []
    for i, tool in enumerate(tools):
        # Closed as json_schema's objects are: a small model would invent keys until max_tokens.
        arguments = closed_schema(tool.parameters)
        if _has_local_ref(arguments):
            # "#..." refs point into the tool's own schema: keep it whole under $defs and re-root them there.
            defs[f"tool_{i}"] = _reroot_refs(arguments, f"#/$defs/tool_{i}")
            arguments = {"$ref": f"#/$defs/tool_{i}"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, key: arguments},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = _JSON_STYLE
    return schema


def _has_local_ref(node: object) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _reroot_refs(node: Any, root: str) -> Any:
    if isinstance(node, dict):
        out = {k: _reroot_refs(v, root) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = root + ref[1:]
        return out
    if isinstance(node, list):
        return [_reroot_refs(v, root) for v in node]
    return node


# ---------------------------------------------------------------------------------------------------------------
# Parsing the output
# ---------------------------------------------------------------------------------------------------------------


def _longest_marker_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _Hermes:
    """<tool_call> blocks amid text; whitespace next to a parsed call is dropped, the rest of the text kept."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    buffer: str = ""  # text not yet settled
    in_call: bool = False  # buffer is the inside of an open <tool_call> block
    before: str = ""  # the whitespace before the open block: content again if the block is no call
    after_call: bool = False  # whitespace now follows a parsed call

    def feed(self, text: str) -> str:
        self.buffer += text
        out: list[str] = []
        while True:
            if self.in_call:
                end = self.buffer.find(_HERMES_CLOSE)
                if end < 0:
                    return "".join(out)
                block, self.buffer = self.buffer[:end], self.buffer[end + len(_HERMES_CLOSE) :]
                out.append(self._close(block, closed=True))
                continue
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return "".join(out)
                self.after_call = False
            start = self.buffer.find(_HERMES_OPEN)
            if start >= 0:
                text_before = self.buffer[:start]
                stripped = text_before.rstrip()
                out.append(stripped)
                self.before = text_before[len(stripped) :]
                self.buffer = self.buffer[start + len(_HERMES_OPEN) :]
                self.in_call = True
                continue
            # Hold back trailing whitespace and anything that may be the start of a marker.
            held = _longest_marker_prefix(self.buffer, _HERMES_OPEN)
            settled = self.buffer[: len(self.buffer) - held]
            keep = settled.rstrip()
            out.append(keep)
            self.buffer = self.buffer[len(keep) :]
            return "".join(out)

    def _close(self, block: str, closed: bool) -> str:
        """Content for a finished block: none if it is a call, else the block as it came."""
        self.in_call = False
        call = _hermes_call(block, self.names)
        if call is not None:
            self.calls.append(call)
            self.after_call = True
            return ""
        tail = _HERMES_CLOSE if closed else ""
        return f"{self.before}{_HERMES_OPEN}{block}{tail}"

    def finish(self, cut: bool) -> str:
        if self.in_call:
            block, self.buffer = self.buffer, ""
            content = self._close(block, closed=False)
            # A block cut short by max_tokens is an unfinished call, not content.
            return "" if cut else content
        rest, self.buffer = self.buffer, ""
        if cut:  # the start of a <tool_call> marker, cut short, is no content either
            rest = rest[: len(rest) - _longest_marker_prefix(rest, _HERMES_OPEN)].rstrip()
        return rest


def _hermes_call(block: str, names: set[str]) -> ToolCall | None:
    try:
        value, end = json.JSONDecoder().raw_decode(block.strip())
    except json.JSONDecodeError:
        return None
    if end != len(block.strip()):
        return None
    return _as_call(value, names)


def _as_call(value: object, names: set[str]) -> ToolCall | None:
    """The call a parsed JSON value stands for, if it is one to a known tool with an object of arguments."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if not isinstance(arguments, dict):
        return None
    return _new_call(value["name"], arguments)


@dataclass
class _Llama3:
    """A whole output that is JSON call object(s) separated by ";", or else content."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    buffer: str = ""
    mode: str = "undecided"  # "undecided" | "content" | "call"

    def feed(self, text: str) -> str:
        if self.mode == "content":
            return text
        self.buffer += text
        if self.mode == "call":
            return ""
        head = self.buffer.lstrip()
        if head.startswith(_PYTHON_TAG):
            head = head[len(_PYTHON_TAG) :].lstrip()
        elif _PYTHON_TAG.startswith(head):
            return ""  # empty, whitespace or the start of <|python_tag|>: too early to tell
        if not head:
            return ""
        if head.startswith("{"):
            self.mode = "call"
            return ""
        self.mode = "content"
        out, self.buffer = self.buffer, ""
        return out

    def finish(self, cut: bool) -> str:
        text, self.buffer = self.buffer, ""
        if self.mode != "call":
            return text
        calls = _llama3_calls(text, self.names, cut)
        if calls is None:
            return text
        self.calls.extend(calls)
        return ""


def _llama3_calls(text: str, names: set[str], cut: bool) -> list[ToolCall] | None:
    """The calls `text` holds, or None if it is not calls alone; when `cut` (by max_tokens), whole calls
    followed by the start of another are the whole ones."""
    rest = text.strip()
    if rest.startswith(_PYTHON_TAG):
        rest = rest[len(_PYTHON_TAG) :].lstrip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    while True:
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return calls if cut and calls else None
        call = _as_call(value, names)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        rest = rest[1:].lstrip()
        if not rest:  # a trailing ";"
            return calls


class ToolCallParser:
    """Splits a streamed completion into content text and tool calls, holding back text that may start a call.
    `forced`: a grammar makes the output calls alone (tool_choice "required" or a named function)."""

    def __init__(self, template: ToolTemplate, tools: list[Tool], forced: bool = False) -> None:
        names = {tool.name for tool in tools}
        self._impl = _Llama3(names) if template.format is ToolFormat.LLAMA3_JSON else _Hermes(names)
        self.forced = forced

    def feed(self, text: str) -> str:
        """The content text that is safe to emit now (never a prefix of a tool-call marker, never inside a call)."""
        return self._impl.feed(text)

    def finish(self, reason: str) -> tuple[str, list[ToolCall], str]:
        """The rest of the content, the calls parsed, and the finish reason: "tool_calls" for an output with calls
        that ended on its own; one cut by max_tokens ("length") drops an unfinished call rather than returning it
        as content, and keeps its reason, as "abort" does."""
        rest, calls = self._impl.finish(reason == "length"), self._impl.calls
        if self.forced and reason == "length":
            rest = ""  # whatever is left of a forced output cut short is a call cut short
        return rest, calls, "tool_calls" if calls and reason == "stop" else reason

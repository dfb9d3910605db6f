"""Tool calling in the prompt: which format a chat template calls tools in, and the conversation to render.

A template that knows tools gets them as `tools=`; one that does not gets kvd's own system prompt describing
them, with earlier calls and results rendered as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvd.request.harmony import CHANNEL
from kvd.request.tool_validate import Tool, arguments_object

# The markers a model writes around its calls; the grammar and the output parser use them too.
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
GEMMA_TURN = "<start_of_turn>"  # Gemma's chat templates: their models call tools in the pythonic format
# Gemma 4's: a call is <|tool_call>call:NAME{key:value,...}<tool_call|>, each string inside <|"|> quotes.
GEMMA4_OPEN = "<|tool_call>"
GEMMA4_CLOSE = "<tool_call|>"
GEMMA4_QUOTE = '<|"|>'


class ToolFormat(Enum):
    HERMES = "hermes"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}}
    PYTHONIC = "pythonic"  # [name(key=value, ...), ...]: the list of calls Google documents for Gemma
    GEMMA4 = "gemma4"  # <|tool_call>call:name{key:<|"|>text<|"|>, ...}<tool_call|>
    HARMONY = "harmony"  # gpt-oss: a message to functions.NAME, its content the arguments' JSON


@dataclass(frozen=True)
class ToolTemplate:
    format: ToolFormat
    native: bool  # True: the model's own chat template renders tools; False: kvd's fallback prompt
    # The format's markers that the tokenizer holds as one token each, with its id: a forced call's grammar
    # names the token (a grammar's text would be spelled in pieces the model never wrote).
    marker_ids: tuple[tuple[str, int], ...] = ()


def detect_tool_template(chat_template: str | None, tokenizer: Any = None) -> ToolTemplate:
    """How the model with this chat template calls tools, and whether the template itself renders them."""
    text = chat_template or ""
    if GEMMA4_OPEN in text:
        markers = (GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE)
        return ToolTemplate(ToolFormat.GEMMA4, native=True, marker_ids=_single_tokens(tokenizer, markers))
    if CHANNEL in text and "to=" in text:
        return ToolTemplate(ToolFormat.HARMONY, native=True)
    if HERMES_OPEN in text:  # Qwen2.5, Qwen3, Hermes
        return ToolTemplate(ToolFormat.HERMES, native=True)
    if PYTHON_TAG in text or ('"parameters"' in text and ("ipython" in text or "tools" in text)):
        return ToolTemplate(ToolFormat.LLAMA3_JSON, native=True)  # Llama 3.1 / 3.2 / 3.3
    if "tools" in text:
        return ToolTemplate(ToolFormat.HERMES, native=True)
    if (
        GEMMA_TURN in text
    ):  # Gemma 3: no tools in its template, calls as Google's function-calling guide has them
        return ToolTemplate(ToolFormat.PYTHONIC, native=False)
    return ToolTemplate(ToolFormat.HERMES, native=False)


def _single_tokens(tokenizer: Any, markers: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    if tokenizer is None:
        return ()
    found = []
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            found.append((marker, ids[0]))
    return tuple(found)


def render_messages(
    messages: list[dict], tools: list[Tool], template: ToolTemplate, developer_role: bool
) -> tuple[list[dict], list[dict] | None]:
    """(conversation, tools) for tokenizer.apply_chat_template(conversation, tools=tools)."""
    conversation = [_template_message(m, i, developer_role) for i, m in enumerate(messages)]
    if template.native:
        # gpt-oss's template writes every tool's description (an undefined one fails it): "" for none.
        described = template.format is ToolFormat.HARMONY
        return conversation, [_tool_spec(tool, described) for tool in tools] or None
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
                    "arguments": arguments_object(
                        call["function"].get("arguments"),
                        f"messages[{index}].tool_calls[{j}].function.arguments",
                    ),
                },
            }
            for j, call in enumerate(out["tool_calls"])
        ]
    return out


def _tool_spec(tool: Tool, described: bool = False) -> dict:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None or described:
        function["description"] = tool.description or ""
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def pythonic_call(name: str, arguments: dict) -> str:
    """name(key=value, ...), each value as JSON (as the forced-call grammar writes it; the parser reads Python's
    literals too)."""
    pairs = ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items())
    return f"{name}({pairs})"


def _call_text(fmt: ToolFormat, name: str, arguments: dict) -> str:
    """One call as the model is to write it."""
    if fmt is ToolFormat.LLAMA3_JSON:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    if fmt is ToolFormat.PYTHONIC:
        return pythonic_call(name, arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def _calls_text(fmt: ToolFormat, calls: list[tuple[str, dict]]) -> str:
    if fmt is ToolFormat.PYTHONIC:
        return "[" + ", ".join(_call_text(fmt, name, arguments) for name, arguments in calls) + "]"
    separator = "; " if fmt is ToolFormat.LLAMA3_JSON else "\n"
    return separator.join(_call_text(fmt, name, arguments) for name, arguments in calls)


def _fallback_prompt(tools: list[Tool], fmt: ToolFormat) -> str:
    listing = "\n".join(json.dumps(_tool_spec(tool)["function"], ensure_ascii=False) for tool in tools)
    if fmt is ToolFormat.LLAMA3_JSON:
        how = (
            'To call a tool, answer with only {"name": <tool name>, "parameters": <arguments as a JSON object>}; '
            'separate several calls with "; ".'
        )
    elif fmt is ToolFormat.PYTHONIC:
        how = (
            "To call tools, answer with only a list of calls, nothing else: "
            '[tool_name(argument_name="a string", other_argument=2), other_tool_name()]'
        )
    else:
        how = (
            "To call a tool, answer with one block per call, each exactly like this:\n"
            f'{HERMES_OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{HERMES_CLOSE}'
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

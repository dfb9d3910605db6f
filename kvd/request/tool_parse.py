"""Tool calls in the output: split a streamed completion into content text and the calls it holds."""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.request.gemma4_calls import read_call
from kvd.request.harmony import CALL_CLOSE, CALL_OPEN, MESSAGE
from kvd.request.tool_render import (
    GEMMA4_CLOSE,
    GEMMA4_OPEN,
    HERMES_CLOSE,
    HERMES_OPEN,
    PYTHON_TAG,
    ToolFormat,
    ToolTemplate,
)
from kvd.request.tool_validate import Tool


@dataclass
class ToolCall:
    id: str  # "call_" + 24 hex chars
    name: str
    arguments: str  # JSON text of the arguments object


def _new_call(name: str, arguments: dict) -> ToolCall:
    return ToolCall("call_" + secrets.token_hex(12), name, json.dumps(arguments, ensure_ascii=False))


def _longest_marker_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


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


def _gemma4_call(block: str, names: set[str]) -> ToolCall | None:
    found = read_call(block, names)
    return _new_call(*found) if found else None


def _harmony_call(block: str, names: set[str]) -> ToolCall | None:
    """`NAME<|message|>ARGS` (kvd.request.harmony hands a call over so)."""
    name, _, arguments = block.partition(MESSAGE)
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return _new_call(name, value) if name in names and isinstance(value, dict) else None


@dataclass
class _Tagged:
    """Call blocks between an open and a close marker amid text (Hermes' <tool_call>, Gemma 4's <|tool_call>);
    whitespace next to a parsed call is dropped, the rest of the text kept."""

    names: set[str]
    open: str = HERMES_OPEN
    close: str = HERMES_CLOSE
    read: Callable[[str, set[str]], ToolCall | None] = _hermes_call  # a block's call, or None
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
                end = self.buffer.find(self.close)
                if end < 0:
                    return "".join(out)
                block, self.buffer = self.buffer[:end], self.buffer[end + len(self.close) :]
                out.append(self._close(block, closed=True))
                continue
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return "".join(out)
                self.after_call = False
            start = self.buffer.find(self.open)
            if start >= 0:
                text_before = self.buffer[:start]
                stripped = text_before.rstrip()
                out.append(stripped)
                self.before = text_before[len(stripped) :]
                self.buffer = self.buffer[start + len(self.open) :]
                self.in_call = True
                continue
            # Hold back trailing whitespace and anything that may be the start of a marker.
            held = _longest_marker_prefix(self.buffer, self.open)
            settled = self.buffer[: len(self.buffer) - held]
            keep = settled.rstrip()
            out.append(keep)
            self.buffer = self.buffer[len(keep) :]
            return "".join(out)

    def _close(self, block: str, closed: bool) -> str:
        """Content for a finished block: none if it is a call, else the block as it came."""
        self.in_call = False
        call = self.read(block, self.names)
        if call is not None:
            self.calls.append(call)
            self.after_call = True
            return ""
        tail = self.close if closed else ""
        return f"{self.before}{self.open}{block}{tail}"

    def finish(self, cut: bool) -> str:
        if self.in_call:
            block, self.buffer = self.buffer, ""
            content = self._close(block, closed=False)
            # A block cut short by max_tokens is an unfinished call, not content.
            return "" if cut else content
        rest, self.buffer = self.buffer, ""
        if cut:  # the start of a <tool_call> marker, cut short, is no content either
            rest = rest[: len(rest) - _longest_marker_prefix(rest, self.open)].rstrip()
        return rest


@dataclass
class _WholeOutput:
    """An output that is call(s) alone, or else content: held back until its first characters tell which."""

    names: set[str]
    calls: list[ToolCall] = field(default_factory=list)
    buffer: str = ""
    mode: str = "undecided"  # "undecided" | "content" | "call"

    def _starts_call(self, head: str) -> bool | None:
        """Whether output beginning with `head` (leading whitespace gone) is to be read as calls; None: too early
        to tell."""
        raise NotImplementedError

    def _parse(self, text: str, cut: bool) -> list[ToolCall] | None:
        """The calls `text` holds, or None if it is not calls alone (see ToolCallParser.finish for `cut`)."""
        raise NotImplementedError

    def feed(self, text: str) -> str:
        if self.mode == "content":
            return text
        self.buffer += text
        if self.mode == "call":
            return ""
        verdict = self._starts_call(self.buffer.lstrip())
        if verdict is None:
            return ""
        if verdict:
            self.mode = "call"
            return ""
        self.mode = "content"
        out, self.buffer = self.buffer, ""
        return out

    def finish(self, cut: bool) -> str:
        text, self.buffer = self.buffer, ""
        if self.mode != "call":
            return text
        calls = self._parse(text, cut)
        if calls is None:
            return text
        self.calls.extend(calls)
        return ""


class _Llama3(_WholeOutput):
    """JSON call object(s) separated by ";", after an optional <|python_tag|>."""

    def _starts_call(self, head: str) -> bool | None:
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(head):
            return None  # empty, whitespace or the start of <|python_tag|>: too early to tell
        return head.startswith("{") if head else None

    def _parse(self, text: str, cut: bool) -> list[ToolCall] | None:
        return _llama3_calls(text, self.names, cut)


def _llama3_calls(text: str, names: set[str], cut: bool) -> list[ToolCall] | None:
    """The calls `text` holds, or None if it is not calls alone; when `cut` (by max_tokens), whole calls
    followed by the start of another are the whole ones."""
    rest = text.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :].lstrip()
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


class _Pythonic(_WholeOutput):
    """A list of calls, [name(key=value, ...), ...]."""

    def _starts_call(self, head: str) -> bool | None:
        return head.startswith("[") if head else None

    def _parse(self, text: str, cut: bool) -> list[ToolCall] | None:
        calls = _pythonic_calls(text.strip(), self.names)
        if calls is not None or not cut:
            return calls
        # Cut short: the whole calls before the cut (each ends in ")"), if those are calls alone.
        for end in reversed([i for i, c in enumerate(text) if c == ")"]):
            calls = _pythonic_calls(text[: end + 1].strip() + "]", self.names)
            if calls is not None:
                return calls
        return None


def _pythonic_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls a [name(key=value, ...), ...] list holds, its values Python or JSON literals; None if the text
    is anything else. Parsed, never evaluated."""
    # A tool name need not be a Python name ("get-weather"): where a call starts (after "[" or ","), such a
    # name is read as a stand-in.
    aliases = {f"_kvd_tool_{i}": name for i, name in enumerate(sorted(names)) if not name.isidentifier()}
    for alias, name in aliases.items():
        text = re.sub(rf"([\[,]\s*){re.escape(name)}\(", rf"\g<1>{alias}(", text)
    names = names | set(aliases)
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
            return None
        if node.args or any(k.arg is None for k in node.keywords):
            return None  # positional arguments or **kwargs: not a call with named arguments
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(_new_call(aliases.get(node.func.id, node.func.id), arguments))
    return calls


_NAMED_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> object:
    """A JSON value from a literal's syntax tree: Python's, or JSON's true / false / null."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_literal(k) for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    raise ValueError("not a literal")


class ToolCallParser:
    """Splits a streamed completion into content text and tool calls, holding back text that may start a call.
    `forced`: a grammar makes the output calls alone (tool_choice "required" or a named function)."""

    def __init__(self, template: ToolTemplate, tools: list[Tool], forced: bool = False) -> None:
        names = {tool.name for tool in tools}
        parsers = {
            ToolFormat.LLAMA3_JSON: _Llama3,
            ToolFormat.PYTHONIC: _Pythonic,
            ToolFormat.HERMES: _Tagged,
            ToolFormat.GEMMA4: lambda names: _Tagged(names, GEMMA4_OPEN, GEMMA4_CLOSE, _gemma4_call),
            ToolFormat.HARMONY: lambda names: _Tagged(names, CALL_OPEN, CALL_CLOSE, _harmony_call),
        }
        self._impl = parsers[template.format](names)
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

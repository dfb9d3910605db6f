"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, read from the output and forced by a
grammar.

Values are JSON's, written Gemma's way: a string inside `<|"|>` quotes (no escapes: it ends at the next quote),
object keys bare (`{unit:<|"|>celsius<|"|>,days:3}`), numbers, true, false and null as JSON writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from kvd.request.json_schema import closed_schema
from kvd.request.tool_render import GEMMA4_CLOSE, GEMMA4_OPEN, GEMMA4_QUOTE

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}
_MAX_DEPTH = 64
_BARE_KEY = re.compile(r"[^\s:{}\[\],<]+")  # a key read_call reads without quotes


class _Unreadable(ValueError):
    pass


def read_call(block: str, names: set[str]) -> tuple[str, dict] | None:
    """(name, arguments) of the inside of one call block (`call:NAME{...}`), or None if it is not a call to
    one of `names` with an object of arguments and nothing after it."""
    text = block.strip()
    if not text.startswith("call:"):
        return None
    brace = text.find("{")
    name = text[len("call:") : brace].strip() if brace > 0 else ""
    if name not in names:
        return None
    try:
        arguments, end = _value(text, brace, 0)
    except (_Unreadable, RecursionError):
        return None
    if text[end:].strip():
        return None
    return name, arguments


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _value(text: str, i: int, depth: int) -> tuple[object, int]:
    """The value that starts at text[i] (after whitespace) and the index after it."""
    if depth > _MAX_DEPTH:
        raise _Unreadable("nested too deeply")
    i = _skip(text, i)
    if text.startswith(GEMMA4_QUOTE, i):
        start = i + len(GEMMA4_QUOTE)
        end = text.find(GEMMA4_QUOTE, start)
        if end < 0:
            raise _Unreadable("an unclosed string")
        return text[start:end], end + len(GEMMA4_QUOTE)
    if text.startswith("{", i):
        return _members(text, i + 1, depth)
    if text.startswith("[", i):
        return _items(text, i + 1, depth)
    for word, value in _WORDS.items():
        if text.startswith(word, i):
            return value, i + len(word)
    number = _NUMBER.match(text, i)
    if number:
        return json.loads(number.group()), number.end()
    raise _Unreadable(f"no value at {i}")


def _sequence(text: str, i: int, close: str, read: Callable[[int], int]) -> int:
    """Elements, each read by `read` (index in, index after it out), separated by "," up to `close`; the index
    after `close`."""
    i = _skip(text, i)
    if text.startswith(close, i):
        return i + 1
    while True:
        i = _skip(text, read(i))
        if text.startswith(close, i):
            return i + 1
        if not text.startswith(",", i):
            raise _Unreadable(f"no ',' before {close!r}")
        i += 1


def _members(text: str, i: int, depth: int) -> tuple[dict, int]:
    out: dict = {}

    def member(i: int) -> int:
        i = _skip(text, i)
        if text.startswith(GEMMA4_QUOTE, i):  # a key may be quoted as a string is
            key, i = _value(text, i, depth + 1)
        else:
            colon = text.find(":", i)
            key = text[i:colon].strip() if colon > i else ""
            if not key or any(c in key for c in "{}[],"):
                raise _Unreadable("no key")
            i = colon
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise _Unreadable("no ':' after a key")
        out[key], i = _value(text, i + 1, depth + 1)
        return i

    return out, _sequence(text, i, "}", member)


def _items(text: str, i: int, depth: int) -> tuple[list, int]:
    out: list = []

    def item(i: int) -> int:
        value, i = _value(text, i, depth + 1)
        out.append(value)
        return i

    return out, _sequence(text, i, "]", item)


class _Grammar:
    """Lark rules (llguidance's dialect) for calls in Gemma 4's syntax, each argument's value shaped by its JSON
    schema where the schema says a shape kvd writes (types, enums, const, arrays, objects, unions), any value
    otherwise. A marker the tokenizer holds as one token is named by its id."""

    def __init__(self, marker_ids: dict[str, int]) -> None:
        self.rules: list[str] = []
        self.root: dict = {}  # the schema "#" refs point into (the tool's parameters)
        self.refs: dict[str, str] = {}  # the tool's refs -> their rules, so that a recursive ref is one rule
        self.term = {m: f"<[{marker_ids[m]}]>" if m in marker_ids else json.dumps(m) for m in _MARKERS}
        quote = self.term[GEMMA4_QUOTE]
        # Between quote tokens a string may hold anything; between quotes spelled as text, no "<".
        body = "/(?s:.*)/" if GEMMA4_QUOTE in marker_ids else "/[^<]*/"
        self.rules += [
            f"g_str: {quote} {body} {quote}",
            r"g_int: /-?(0|[1-9][0-9]*)/",
            r"g_num: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
            'g_bool: "true" | "false"',
            'g_null: "null"',
            "g_key: /[A-Za-z_][A-Za-z0-9_.-]*/",
            'g_any: g_str | g_num | g_bool | g_null | "[" (g_any ("," g_any)*)? "]" '
            '| "{" (g_key ":" g_any ("," g_key ":" g_any)*)? "}"',
        ]

    def rule(self, body: str) -> str:
        name = f"g_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: object) -> str:
        """The grammar of one value of `schema`."""
        if not isinstance(schema, dict):
            return "g_any"
        if isinstance(schema.get("$ref"), str):
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self._literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rule(" | ".join(self._literal(v) for v in schema["enum"]))
        union = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(union, list) and union:
            return self.rule(" | ".join(self.value(s) for s in union))
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return self.rule(" | ".join(self.value({**schema, "type": k}) for k in kind))
        simple = {
            "string": "g_str",
            "integer": "g_int",
            "number": "g_num",
            "boolean": "g_bool",
            "null": "g_null",
        }
        if kind in simple:
            return simple[kind]
        if kind == "array":
            item = self.value(schema.get("items")) if isinstance(schema.get("items"), dict) else "g_any"
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self.rule(f'"{{" {self.members(schema)} "}}"')
        return "g_any"

    def _ref(self, ref: str) -> str:
        """A "#/..." ref's rule, into the tool's parameters; any value for a ref elsewhere."""
        if ref in self.refs:
            return self.refs[ref]
        target: object = self.root if ref == "#" or ref.startswith("#/") else None
        for part in ref[2:].split("/") if ref.startswith("#/") else []:
            step = part.replace("~1", "/").replace("~0", "~")
            target = target.get(step) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return "g_any"
        name = self.refs[ref] = self.rule("g_any")  # its body once the ref's value is known (it may recur)
        self.rules[int(name[2:])] = f"{name}: {self.value(target)}"
        return name

    def members(self, schema: dict) -> str:
        """key:value pairs of an object schema's listed properties: the required ones in order, then any in-order
        choice of the optional ones (one rule each: linear in their number)."""
        schema = closed_schema(schema)
        properties = schema.get("properties") or {}
        required = [k for k in properties if k in set(schema.get("required") or ())]
        optional = [k for k in properties if k not in required]
        pair = {key: f"{self._key(key)} {self.value(properties[key])}" for key in properties}
        tail = ""
        for k in reversed(range(len(optional))):
            rest = f' ("," {tail})? | {tail}' if tail else ""
            tail = self.rule(f"{pair[optional[k]]}{rest}")
        parts = ' "," '.join(pair[key] for key in required)
        if tail:
            parts = f'{parts} ("," {tail})?' if required else f"{tail}?"
        return parts

    def _key(self, key: str) -> str:
        """`key:` as Gemma writes it: bare, or quoted where read_call could not read it bare."""
        if _BARE_KEY.fullmatch(key):
            return json.dumps(key + ":")
        return f'{self.term[GEMMA4_QUOTE]} {json.dumps(key)} {self.term[GEMMA4_QUOTE]} ":"'

    def _literal(self, value: object) -> str:
        """A JSON value written as Gemma writes it, in the grammar's terms."""
        if isinstance(value, str):
            return f"{self.term[GEMMA4_QUOTE]} {json.dumps(value)} {self.term[GEMMA4_QUOTE]}"
        if isinstance(value, dict):
            inner = ' "," '.join(f"{self._key(k)} {self._literal(v)}" for k, v in value.items())
            return f'"{{" {inner} "}}"'
        if isinstance(value, list):
            return '"[" ' + ' "," '.join(self._literal(v) for v in value) + ' "]"'
        return json.dumps(json.dumps(value))


_MARKERS = (GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE)


def calls_grammar(tools: list[tuple[str, dict]], many: bool, marker_ids: dict[str, int]) -> str:
    """The grammar of one call (several when `many`) to any of `tools` ((name, parameters schema) pairs)."""
    g = _Grammar(marker_ids)
    options = []
    for name, schema in tools:
        g.root, g.refs = closed_schema(schema), {}
        options.append(g.rule(f'{json.dumps("call:" + name + "{")} {g.members(g.root)} "}}"'))
    call = f"call: {g.term[GEMMA4_OPEN]} ({' | '.join(options)}) {g.term[GEMMA4_CLOSE]}"
    start = "start: call+" if many else "start: call"
    return "%llguidance {}\n" + "\n".join([start, call, *g.rules]) + "\n"

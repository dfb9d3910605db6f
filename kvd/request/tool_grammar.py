"""Forced tool calls: the grammar that makes the output call(s) for tool_choice "required" or a named function."""

from __future__ import annotations

import json
from typing import Any

from kvd.request.gemma4_calls import calls_grammar
from kvd.request.harmony import call_grammar
from kvd.request.json_schema import closed_schema
from kvd.request.tool_render import HERMES_CLOSE, HERMES_OPEN, ToolFormat, ToolTemplate
from kvd.request.tool_validate import Tool, ToolChoice, ToolError

# The JSON of a constrained call: one space after ',' and ':' (what json.dumps writes and what the templates
# render in past turns), nothing else; unknown schema keywords are ignored rather than refused.
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}


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
    if template.format is ToolFormat.PYTHONIC:
        return _pythonic_grammar(chosen, many)
    if template.format is ToolFormat.HARMONY:  # one call a message: never several
        return call_grammar(
            [(tool.name, {**closed_schema(tool.parameters), "x-guidance": _JSON_STYLE}) for tool in chosen]
        )
    if template.format is ToolFormat.GEMMA4:
        return calls_grammar(
            [(tool.name, tool.parameters) for tool in chosen], many, dict(template.marker_ids)
        )
    key = "parameters" if template.format is ToolFormat.LLAMA3_JSON else "arguments"
    schema = _calls_schema(chosen, key)
    if template.format is ToolFormat.LLAMA3_JSON:
        separator, call = '"; "', "body"
    else:
        separator, call = r'"\n"', rf'"{HERMES_OPEN}\n" body "\n{HERMES_CLOSE}"'
    start = f"call ({separator} call)*" if many else "call"
    return f"%llguidance {{}}\nstart: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


def _pythonic_grammar(tools: list[Tool], many: bool) -> str:
    """[name(key=value, ...), ...]: each tool's listed arguments in their schema's order, the required ones
    first, every value JSON of its property's schema (which the parser reads)."""
    rules = ["start: " + ('"[" call (", " call)* "]"' if many else '"[" call "]"')]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        parameters = closed_schema(tool.parameters)
        properties = parameters.get("properties") or {}
        required = [k for k in properties if k in set(parameters.get("required") or ())]
        optional = [k for k in properties if k not in required]
        # The whole parameters under $defs, so that any "#..." ref of a property resolves there.
        defs = {"tool": _reroot_refs(parameters, "#/$defs/tool")} if _has_local_ref(parameters) else None
        item = {key: _pythonic_argument(key, schema, defs) for key, schema in properties.items()}
        # opt_i_k: any non-empty, in-order choice of optional arguments k.. (one rule each: linear in their number).
        for k, key in enumerate(optional):
            rest = f' (", " opt_{i}_{k + 1})? | opt_{i}_{k + 1}' if k + 1 < len(optional) else ""
            rules.append(f"opt_{i}_{k}: {item[key]}{rest}")
        parts = ' ", " '.join(item[key] for key in required)
        if optional:
            parts = f'{parts} (", " opt_{i}_0)?' if required else f"opt_{i}_0?"
        rules.append(f'call_{i}: "{tool.name}(" {parts} ")"')
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _pythonic_argument(key: str, schema: dict, defs: dict | None) -> str:
    """key=<JSON of the schema>, in the grammar's terms."""
    schema = {**_reroot_refs(schema, "#/$defs/tool"), "$defs": defs} if defs else dict(schema)
    schema["x-guidance"] = _JSON_STYLE
    return f'"{key}=" %json {json.dumps(schema)}'


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

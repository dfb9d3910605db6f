"""JSON schemas as structured output and forced tool calls take them: objects closed to the properties they list.

Pure Python (no torch): structured output and the tool-call grammars share it.
"""

from __future__ import annotations

# Keywords whose values are subschemas (a schema, a list of them, or a map of names to them).
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_EXTRA_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_schema(schema: object, close: bool = True) -> object:
    """The schema with every object that lists `properties` and says nothing of others closed to them.

    As in OpenAI's strict structured outputs (and vLLM's default): JSON Schema's own default lets a model invent
    keys until max_tokens, which small models do. `"additionalProperties": true` keeps an object open. The parts
    of an allOf are left open at their top (each lists only some of the properties the whole has)."""
    if not isinstance(schema, dict):
        return schema
    out = _merged_all_of(schema)
    if close and "properties" in out and not any(k in out for k in _EXTRA_KEYS) and "allOf" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(s, close=False) for s in out["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    return out


_PLAIN_OBJECT = {"type", "properties", "required", "description", "title"}


def _merged_all_of(schema: dict) -> dict:
    """An allOf of plain objects (properties and required only) as the one object it describes, which can then
    be closed; any other allOf is kept as it is."""
    parts = schema.get("allOf")
    plain = (
        isinstance(parts, list)
        and parts
        and all(
            isinstance(p, dict) and set(p) <= _PLAIN_OBJECT and p.get("type", "object") == "object"
            for p in parts
        )
    )
    names = [name for p in parts for name in p.get("properties", {})] if plain else []
    if not plain or len(set(names)) < len(names) or any(k in schema for k in ("properties", *_EXTRA_KEYS)):
        return dict(schema)  # a property in two parts must meet both: not a plain union
    out = {k: v for k, v in schema.items() if k != "allOf"}
    out["type"] = "object"
    out["properties"] = {name: s for p in parts for name, s in p.get("properties", {}).items()}
    out["required"] = list(
        dict.fromkeys([*schema.get("required", []), *(r for p in parts for r in p.get("required", []))])
    )
    return out

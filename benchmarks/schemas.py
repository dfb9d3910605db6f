"""Twenty JSON schemas of the shapes requests carry, each with a task that a prompt asks the model to fill."""

from __future__ import annotations

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "zip"],
}

_TYPES_60 = ["integer", "boolean", "string"]
_LARGE_PROPERTIES = {
    f"field_{i:02d}": {"type": _TYPES_60[i % 3], **({"maxLength": 12} if i % 3 == 2 else {})}
    for i in range(60)
}

# (name, task for the prompt, schema). Strings carry maxLength where the shape allows it: an unbounded string
# is where a 135M model rambles until max_tokens, and that would measure the model, not the constraint.
SCHEMAS: list[tuple[str, str, dict]] = [
    (
        "flat_person",
        "a person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer"},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["name", "age", "email"],
        },
    ),
    (
        "ref_addresses",
        "a customer with billing and shipping addresses",
        {
            "type": "object",
            "$defs": {"address": _ADDRESS},
            "properties": {
                "customer": {"type": "string", "maxLength": 40},
                "billing": {"$ref": "#/$defs/address"},
                "shipping": {"$ref": "#/$defs/address"},
            },
            "required": ["customer", "billing", "shipping"],
        },
    ),
    (
        "order_items",
        "a shop order with its line items",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                },
            },
            "required": ["order_id", "items"],
        },
    ),
    (
        "enums",
        "a support ticket",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["open", "pending", "closed"]},
                "priority": {"type": "integer", "enum": [1, 2, 3]},
                "channel": {"type": "string", "enum": ["email", "phone", "chat", "web"]},
            },
            "required": ["status", "priority", "channel"],
        },
    ),
    (
        "string_formats",
        "a calendar event",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "day": {"type": "string", "format": "date"},
                "starts": {"type": "string", "format": "date-time"},
                "organizer": {"type": "string", "format": "email"},
            },
            "required": ["id", "day", "starts", "organizer"],
        },
    ),
    (
        "bounded_numbers",
        "a weather reading",
        {
            "type": "object",
            "properties": {
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 400},
                "stations": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["temperature_c", "humidity", "wind_kmh", "stations"],
        },
    ),
    (
        "any_of",
        "a contact, by email or by phone",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "contact": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"email": {"type": "string", "format": "email"}},
                            "required": ["email"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{8,12}$"}},
                            "required": ["phone"],
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "required": ["name", "contact"],
        },
    ),
    (
        "one_of",
        "a geometric shape",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
                    "required": ["kind", "radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "rectangle"},
                        "width": {"type": "number", "minimum": 0},
                        "height": {"type": "number", "minimum": 0},
                    },
                    "required": ["kind", "width", "height"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
    (
        "recursive_tree",
        "a small folder tree",
        {
            "$ref": "#/$defs/node",
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "children": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["name", "children"],
                    "additionalProperties": False,
                }
            },
        },
    ),
    (
        "optional_fields",
        "a user profile",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "maxLength": 20},
                "nickname": {"type": "string", "maxLength": 20},
                "bio": {"type": "string", "maxLength": 80},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "verified": {"type": "boolean"},
            },
            "required": ["username"],
        },
    ),
    (
        "closed_object",
        "a blog post's metadata",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "draft": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 4},
            },
            "required": ["title", "draft", "tags"],
            "additionalProperties": False,
        },
    ),
    (
        "large_60",
        "a settings record",
        {
            "type": "object",
            "properties": _LARGE_PROPERTIES,
            "required": [f"field_{i:02d}" for i in range(0, 60, 6)],
        },
    ),
    (
        "string_lengths",
        "a product code and label",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
                "label": {"type": "string", "minLength": 3, "maxLength": 24},
                "note": {"type": "string", "maxLength": 10},
            },
            "required": ["code", "label", "note"],
        },
    ),
    (
        "nullable",
        "a book with an optional subtitle and year",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "subtitle": {"type": ["string", "null"], "maxLength": 60},
                "year": {"type": ["integer", "null"], "minimum": 1000, "maximum": 2100},
            },
            "required": ["title", "subtitle", "year"],
        },
    ),
    (
        "tool_call",
        "a call of the weather tool for a city",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 40},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ),
    (
        "matrix",
        "a 2x2 or 3x3 integer matrix",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 3,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 3,
                        "items": {"type": "integer", "minimum": -99, "maximum": 99},
                    },
                }
            },
            "required": ["rows"],
        },
    ),
    (
        "all_of",
        "an employee record",
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 40}},
                    "required": ["name"],
                },
                {
                    "type": "object",
                    "properties": {"employee_id": {"type": "integer", "minimum": 1}},
                    "required": ["employee_id"],
                },
            ]
        },
    ),
    (
        "dictionary",
        "scores of up to four players, by name",
        {
            "type": "object",
            "properties": {
                "scores": {
                    "type": "object",
                    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "maxProperties": 4,
                }
            },
            "required": ["scores"],
        },
    ),
    (
        "deep_nesting",
        "a delivery with its location",
        {
            "type": "object",
            "properties": {
                "delivery": {
                    "type": "object",
                    "properties": {
                        "courier": {"type": "string", "maxLength": 30},
                        "route": {
                            "type": "object",
                            "properties": {
                                "stop": {
                                    "type": "object",
                                    "properties": {
                                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                                    },
                                    "required": ["lat", "lon"],
                                }
                            },
                            "required": ["stop"],
                        },
                    },
                    "required": ["courier", "route"],
                }
            },
            "required": ["delivery"],
        },
    ),
    (
        "flags_and_lists",
        "a user's permissions",
        {
            "type": "object",
            "properties": {
                "admin": {"type": "boolean"},
                "active": {"type": "boolean"},
                "roles": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {"enum": ["reader", "writer", "owner"]},
                },
            },
            "required": ["admin", "active", "roles"],
        },
    ),
]

# Five ways of asking, so that each schema meets prompts that lead the model differently.
PROMPTS: list[str] = [
    "Write {task} as JSON.",
    "Give me an example of {task}. Answer with JSON only.",
    "Describe {task} in JSON, with realistic values.",
    "Return {task} as a JSON object matching this schema: {schema}",
    "I need test data: {task}. Output only the JSON.",
]

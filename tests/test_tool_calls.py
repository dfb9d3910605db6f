"""Tool calling: request validation, rendering through real chat templates, call grammars and the output parser."""

from __future__ import annotations

import copy
import json
import re

import chat_templates
import llguidance
import llguidance.hf
import pytest

from kvd.model.families.gemma3 import Gemma3ForCausalLM
from kvd.model.gguf_loader import GGUFFile, load_gguf_tokenizer
from kvd.model.hub import default_model_path
from kvd.request.tool_grammar import tool_call_grammar
from kvd.request.tool_parse import ToolCallParser
from kvd.request.tool_render import (
    ToolFormat,
    ToolTemplate,
    detect_tool_template,
    pythonic_call,
    render_messages,
)
from kvd.request.tool_validate import (
    MAX_TOOLS,
    Tool,
    ToolChoice,
    ToolError,
    check_history,
    parse_tool_choice,
    parse_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = parse_tools([WEATHER, ADD])
HERMES = ToolTemplate(ToolFormat.HERMES, native=True)
LLAMA3 = ToolTemplate(ToolFormat.LLAMA3_JSON, native=True)
PYTHONIC = ToolTemplate(ToolFormat.PYTHONIC, native=False)  # Gemma's, through kvd's prompt
GEMMA4 = ToolTemplate(ToolFormat.GEMMA4, native=True)  # its markers in pieces in this tokenizer
GEMMA4_MARKERS = ["<|tool_call>", "<tool_call|>", '<|"|>']


@pytest.fixture(scope="module")
def hf_tokenizer():
    return load_gguf_tokenizer(GGUFFile(default_model_path()))


@pytest.fixture(scope="module")
def ll_tokenizer(hf_tokenizer):
    return llguidance.hf.from_tokenizer(hf_tokenizer)


def _function(name: str = "f", **extra: object) -> list[dict]:
    return [{"type": "function", "function": {"name": name, **extra}}]


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------------------------
# Request validation
# ---------------------------------------------------------------------------------------------------------------


def test_parse_tools_reads_the_openai_list():
    weather, add = TOOLS
    assert weather == Tool("get_weather", "Current weather of a city", WEATHER["function"]["parameters"])
    assert add.description is None
    assert parse_tools(_function("x-y_1", strict=True))[0].parameters == {"type": "object", "properties": {}}
    assert parse_tools(None) == [] and parse_tools([]) == []
    assert len(parse_tools([_function(f"f{i}")[0] for i in range(MAX_TOOLS)])) == MAX_TOOLS


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"type": "function"}, "tools"),
        ([_function(f"f{i}")[0] for i in range(MAX_TOOLS + 1)], "tools"),
        (["get_weather"], "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": "f"}], "tools[0].function"),
        (_function(""), "tools[0].function.name"),
        (_function("a" * 65), "tools[0].function.name"),
        (_function("get weather"), "tools[0].function.name"),
        (_function("naïve"), "tools[0].function.name"),
        ([{"type": "function", "function": {}}], "tools[0].function.name"),
        ([WEATHER, ADD, WEATHER], "tools[2].function.name"),
        (_function(description=3), "tools[0].function.description"),
        (_function(strict="yes"), "tools[0].function.strict"),
        (_function(parameters=[]), "tools[0].function.parameters"),
        (_function(parameters={"type": 5}), "tools[0].function.parameters"),
        (_function(parameters={"type": "string"}), "tools[0].function.parameters"),
        (
            _function(parameters={"type": "object", "properties": {"a": {"minimum": "zero"}}}),
            "tools[0].function.parameters",
        ),
        # Unknown fields are refused, never ignored.
        ([{**WEATHER, "extra": 1}], "tools[0].extra"),
        (_function(bogus=1), "tools[0].function.bogus"),
    ],
)
def test_parse_tools_refuses(value, field):
    with pytest.raises(ToolError) as info:
        parse_tools(value)
    assert info.value.field == field
    assert str(info.value).startswith(field + ": ")


def test_invalid_schema_gives_the_library_reason_and_where():
    with pytest.raises(ToolError) as info:
        parse_tools(_function(parameters={"type": 5}))
    assert "not valid under any of the given schemas" in info.value.message
    with pytest.raises(ToolError) as info:
        parse_tools(_function(parameters={"type": "object", "properties": {"a": {"minimum": "zero"}}}))
    assert (
        "properties/a/minimum" in info.value.message
        and "'zero' is not of type 'number'" in info.value.message
    )


@pytest.mark.parametrize(
    ("value", "tools", "expected"),
    [
        (None, TOOLS, ToolChoice("auto")),
        (None, [], ToolChoice("none")),
        ("none", TOOLS, ToolChoice("none")),
        ("auto", TOOLS, ToolChoice("auto")),
        ("required", TOOLS, ToolChoice("required")),
        ({"type": "function", "function": {"name": "add"}}, TOOLS, ToolChoice("named", "add")),
    ],
)
def test_parse_tool_choice(value, tools, expected):
    assert parse_tool_choice(value, tools) == expected


@pytest.mark.parametrize(
    ("value", "tools", "field"),
    [
        ("required", [], "tool_choice"),
        ({"type": "function", "function": {"name": "add"}}, [], "tool_choice"),
        ({"type": "function", "function": {"name": "sub"}}, TOOLS, "tool_choice.function.name"),
        ({"type": "function"}, TOOLS, "tool_choice"),
        ({"function": {"name": "add"}}, TOOLS, "tool_choice"),
        ("any", TOOLS, "tool_choice"),
        (1, TOOLS, "tool_choice"),
        ({"type": "function", "function": {"name": "add"}, "x": 1}, TOOLS, "tool_choice.x"),
        (
            {"type": "function", "function": {"name": "add", "strict": True}},
            TOOLS,
            "tool_choice.function.strict",
        ),
    ],
)
def test_parse_tool_choice_refuses(value, tools, field):
    with pytest.raises(ToolError) as info:
        parse_tool_choice(value, tools)
    assert info.value.field == field


def _history() -> list[dict]:
    return [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris and 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("call_1", "get_weather", '{"city": "Paris"}'),
                _call("call_2", "add", '{"a": 2, "b": 3}'),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": "5"},
        {"role": "assistant", "content": "It is 22 C and sunny; 2+3 is 5."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_check_history_accepts_a_conversation_with_calls():
    check_history(_history())
    check_history([{"role": "user", "content": "hi"}])


def _broken(index: int, **changes: object) -> list[dict]:
    messages = _history()
    messages[index].update(changes)
    return messages


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (_broken(3, tool_call_id="call_9"), "messages[3].tool_call_id"),
        (_broken(4, tool_call_id=None), "messages[4].tool_call_id"),
        (
            [{"role": "tool", "tool_call_id": "call_1", "content": "x"}, *_history()],
            "messages[0].tool_call_id",
        ),
        (
            _broken(2, tool_calls=[_call("call_1", "get_weather", "{city: Paris}")]),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            _broken(2, tool_calls=[_call("call_1", "get_weather", '["Paris"]')]),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            _broken(
                2,
                tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}],
            ),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            _broken(2, tool_calls=[_call("call_1", "get_weather", "{}"), _call("call_1", "add", "{}")]),
            "messages[2].tool_calls[1].id",
        ),
        (_broken(2, tool_calls=[{**_call("call_1", "add", "{}"), "zz": 1}]), "messages[2].tool_calls[0].zz"),
        (
            _broken(2, tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{}", "index": 0}}]),
            "messages[2].tool_calls[0].function.index",
        ),
        (
            _broken(2, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]),
            "messages[2].tool_calls[0].id",
        ),
        (_broken(2, tool_calls=[{"id": "c", "type": "function"}]), "messages[2].tool_calls[0].function"),
        (
            _broken(2, tool_calls=[{"id": "c", "type": "code", "function": {}}]),
            "messages[2].tool_calls[0].type",
        ),
        (_broken(2, tool_calls={"id": "c"}), "messages[2].tool_calls"),
        (_broken(1, tool_calls=[_call("call_1", "get_weather", "{}")]), "messages[1].tool_calls"),
        (_broken(1, content=None), "messages[1].content"),
        (_broken(5, content=None), "messages[5].content"),
        (_broken(2, tool_calls=[]), "messages[2].content"),
        (_broken(3, content=None), "messages[3].content"),
        (_broken(1, content=["parts"]), "messages[1].content"),
    ],
)
def test_check_history_refuses(messages, field):
    with pytest.raises(ToolError) as info:
        check_history(messages)
    assert info.value.field == field


# ---------------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------------


def test_detect_tool_template_on_real_templates(hf_tokenizer):
    assert detect_tool_template(hf_tokenizer.chat_template) == ToolTemplate(ToolFormat.HERMES, native=False)
    assert detect_tool_template(chat_templates.QWEN2_5) == HERMES
    assert detect_tool_template(chat_templates.LLAMA3_1) == LLAMA3
    assert detect_tool_template(None) == ToolTemplate(ToolFormat.HERMES, native=False)
    assert (
        detect_tool_template(Gemma3ForCausalLM.CHAT_TEMPLATE) == PYTHONIC
    )  # Gemma 3's template knows no tools
    # A template that renders tools some other way is given the Hermes format.
    other = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_tool_template(other) == HERMES


def _render(
    tokenizer, template: str | None, messages: list[dict], tools: list[Tool], developer_role=False
) -> str:
    check_history(messages)
    kind = detect_tool_template(template or tokenizer.chat_template)
    conversation, template_tools = render_messages(messages, tools, kind, developer_role)
    return tokenizer.apply_chat_template(
        conversation, tools=template_tools, chat_template=template, add_generation_prompt=True, tokenize=False
    )


def test_qwen_template_renders_tools_calls_and_results(hf_tokenizer):
    text = _render(hf_tokenizer, chat_templates.QWEN2_5, _history(), TOOLS)
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Current weather'
        in text
    )
    assert '\n{"type": "function", "function": {"name": "add", "parameters": {' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\n5\n</tool_response><|im_end|>"
        in text
    )
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")


def test_llama3_template_renders_tools_calls_and_results(hf_tokenizer):
    messages = _history()
    messages[2]["tool_calls"] = messages[2]["tool_calls"][:1]  # the template refuses parallel calls
    del messages[4]
    text = _render(hf_tokenizer, chat_templates.LLAMA3_1, messages, TOOLS)
    assert "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n" in text
    assert "Answer briefly.<|eot_id|>" in text
    assert 'Respond in the format {"name": function name, "parameters": dictionary' in text
    assert '"name": "get_weather",\n        "description": "Current weather of a city"' in text
    assert "Weather in Paris and 2+3?<|eot_id|>" in text
    assert '<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C, sunny"<|eot_id|>' in text
    assert text.endswith("Thanks!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_fallback_renders_the_whole_conversation_through_a_template_without_tools(hf_tokenizer):
    messages = _history()
    before = copy.deepcopy(messages)
    text = _render(hf_tokenizer, None, messages, TOOLS)
    assert messages == before  # the request is left as it came
    assert "You are a helpful AI assistant named SmolLM" not in text  # the system turn is ours
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\nYou can call these tools")
    assert (
        '<tools>\n{"name": "get_weather", "description": "Current weather of a city", "parameters": {' in text
    )
    assert '\n{"name": "add", "parameters": {"type": "object"' in text
    assert (
        '<tool_call>\n{"name": <tool name>, "arguments": <arguments as a JSON object>}\n</tool_call>' in text
    )
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\n5\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nIt is 22 C"
    ) in text


def test_gemma_fallback_renders_calls_as_a_list_of_python_calls(hf_tokenizer):
    text = _render(hf_tokenizer, Gemma3ForCausalLM.CHAT_TEMPLATE, _history(), TOOLS)
    assert "answer with only a list of calls, nothing else" in text
    assert '<start_of_turn>model\n[get_weather(city="Paris"), add(a=2, b=3)]<end_of_turn>' in text
    assert "<start_of_turn>user\n<tool_response>\n22 C, sunny\n</tool_response>" in text


def test_fallback_adds_a_system_turn_and_keeps_content_with_calls(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [_call("c1", "get_weather", '{"city": "Zürich"}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "-2 C"},
    ]
    text = _render(hf_tokenizer, None, messages, TOOLS)
    assert text.startswith("<|im_start|>system\nYou can call these tools")
    assert (
        'assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        in text
    )


def test_without_tools_only_roles_and_history_are_converted(hf_tokenizer):
    conversation, template_tools = render_messages(_history(), [], HERMES, developer_role=False)
    assert template_tools is None
    assert conversation[0] == {"role": "system", "content": "Answer briefly."}
    assert conversation[2]["tool_calls"][1]["function"]["arguments"] == {"a": 2, "b": 3}
    assert conversation[2]["content"] is None and conversation[3]["tool_call_id"] == "call_1"
    conversation, _ = render_messages(_history(), [], HERMES, developer_role=True)
    assert conversation[0]["role"] == "developer"
    text = _render(hf_tokenizer, None, _history(), [])
    assert "You can call these tools" not in text and "<tools>" not in text
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    assert "<tool_response>\n5\n</tool_response>" in text


def test_native_render_passes_the_tools_in_the_openai_shape():
    conversation, template_tools = render_messages(_history(), TOOLS, LLAMA3, developer_role=False)
    assert template_tools == [WEATHER, ADD]  # ADD has no description: none is rendered
    assert [m["role"] for m in conversation] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]


# ---------------------------------------------------------------------------------------------------------------
# Parsing the output
# ---------------------------------------------------------------------------------------------------------------

CITY = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES_CASES = [
    ("Hello <b>world</b>, 1 < 2 and <tool>.", "Hello <b>world</b>, 1 < 2 and <tool>.", []),
    (
        f"Let me look.\n<tool_call>\n{CITY}\n</tool_call>",
        "Let me look.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        f'<tool_call>\n{CITY}\n</tool_call>\n<tool_call>\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n</tool_call>\n',
        "",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    ('<tool_call>{"name":"add","parameters":{"a":1,"b":2}}</tool_call>', "", [("add", {"a": 1, "b": 2})]),
    (f"<tool_call>  \n {CITY} \n\n</tool_call>\n\nDone.", "Done.", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>\n{CITY}\n", "", [("get_weather", {"city": "Paris"})]),  # </tool_call> never came
    ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
    ("Hi <tool_call>not json</tool_call> bye", "Hi <tool_call>not json</tool_call> bye", []),
    (
        'A\n<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>\nB',
        'A\n<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>\nB',
        [],
    ),
    (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
        [],
    ),
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call> x <tool_call',
        "x <tool_call",
        [("get_weather", {"city": "Zürich"})],
    ),
    ("ends in whitespace \n", "ends in whitespace \n", []),
]
LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    (
        ' {"name": "add", "arguments": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Paris"}};',
        "",
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})],
    ),
    ("The weather is {fine}.", "The weather is {fine}.", []),
    ("<|python_tag|>brave_search.call(query=1)", "<|python_tag|>brave_search.call(query=1)", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "sub", "parameters": {}}', '{"name": "sub", "parameters": {}}', []),
    (
        '{"name": "add", "parameters": {"a": 1, "b": 2}} and then',
        '{"name": "add", "parameters": {"a": 1, "b": 2}} and then',
        [],
    ),
    ('{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
]
PYTHONIC_CASES = [
    ('[get_weather(city="Paris")]', "", [("get_weather", {"city": "Paris"})]),
    (
        " [add(a=1, b=-2), get_weather(city=\"Zürich\", unit='c')]\n",
        "",
        [("add", {"a": 1, "b": -2}), ("get_weather", {"city": "Zürich", "unit": "c"})],
    ),
    # Python's literals and JSON's alike; tuples as lists.
    ("[add(a={'x': (1, None)}, b=true)]", "", [("add", {"a": {"x": [1, None]}, "b": True})]),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[sub(a=1)]", "[sub(a=1)]", []),  # not a tool
    ("[add(1, 2)]", "[add(1, 2)]", []),  # positional arguments
    ("[add(a=__import__('os'))]", "[add(a=__import__('os'))]", []),  # never evaluated
    ("[add(a=1)] and more", "[add(a=1)] and more", []),
    ("The list: [add(a=1)]", "The list: [add(a=1)]", []),
    ("[]", "[]", []),
]
Q = '<|"|>'
GEMMA4_CASES = [
    (
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        f"Let me look.<|tool_call>call:add{{a:1,b:-2.5e1}}<tool_call|><|tool_call>call:get_weather{{city:{Q}a, b: {{c}}{Q},"
        f"unit:{Q}c{Q}}}<tool_call|>",
        "Let me look.",
        [("add", {"a": 1, "b": -25.0}), ("get_weather", {"city": "a, b: {c}", "unit": "c"})],
    ),
    # Nested objects with bare or quoted keys, arrays, true / false / null, whitespace between.
    (
        f"<|tool_call>call:add{{ a: {{x:[1, true, null], {Q}y z{Q}:false}}, b:[] }}<tool_call|> Done.",
        "Done.",
        [("add", {"a": {"x": [1, True, None], "y z": False}, "b": []})],
    ),
    (
        "<|tool_call>call:sub{a:1}<tool_call|>",
        "<|tool_call>call:sub{a:1}<tool_call|>",
        [],
    ),  # not a tool
    ("<|tool_call>call:add{a:1} x<tool_call|>", "<|tool_call>call:add{a:1} x<tool_call|>", []),
    (f"<|tool_call>call:add{{a:{Q}open}}<tool_call|>", f"<|tool_call>call:add{{a:{Q}open}}<tool_call|>", []),
    ("<|tool_call>add(a=1)<tool_call|>", "<|tool_call>add(a=1)<tool_call|>", []),
    ("1 <| 2 and <tool_call> stay text", "1 <| 2 and <tool_call> stay text", []),
]
PARSER_CASES = (
    [(HERMES, *case) for case in HERMES_CASES]
    + [(LLAMA3, *case) for case in LLAMA3_CASES]
    + [(PYTHONIC, *case) for case in PYTHONIC_CASES]
    + [(GEMMA4, *case) for case in GEMMA4_CASES]
)


def _calls(calls) -> list[tuple[str, dict]]:
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _parse(template: ToolTemplate, chunks: list[str]) -> tuple[list[str], str, list[tuple[str, dict]]]:
    parser = ToolCallParser(template, TOOLS)
    emitted = [parser.feed(chunk) for chunk in chunks]
    rest, calls, _ = parser.finish("stop")
    return emitted, "".join(emitted) + rest, _calls(calls)


@pytest.mark.parametrize(("template", "text", "content", "calls"), PARSER_CASES)
def test_parser_whole_and_at_every_cut(template, text, content, calls):
    assert _parse(template, [text])[1:] == (content, calls)
    for cut in range(len(text) + 1):
        assert _parse(template, [text[:cut], text[cut:]])[1:] == (content, calls), cut
    emitted, *result = _parse(template, list(text))
    assert tuple(result) == (content, calls)
    # Emitted text is never taken back: each step's total is a start of the final content, so no marker of a
    # call (nor any part of one) was ever let out.
    for step in range(len(emitted) + 1):
        assert content.startswith("".join(emitted[:step]))


CUT_CASES = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "argu', "", []),
    (
        HERMES,
        f'Sure. <tool_call>{CITY}</tool_call>\n<tool_call>\n{{"na',
        "Sure.",
        [("get_weather", {"city": "Paris"})],
    ),
    (HERMES, f"<tool_call>{CITY}\n", "", [("get_weather", {"city": "Paris"})]),  # whole but for </tool_call>
    (HERMES, "plain text, cut", "plain text, cut", []),
    (HERMES, "Sure. <tool_ca", "Sure.", []),  # the marker's start, cut short
    (HERMES, "<tool", "", []),
    (LLAMA3, f'{CITY}; {{"name": "add", "parameters": {{"a": 1', "", [("get_weather", {"city": "Paris"})]),
    # Not one whole call: JSON content or a call, no telling, so the text stays content.
    (LLAMA3, '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
    (PYTHONIC, '[get_weather(city="Paris"), add(a=1, b', "", [("get_weather", {"city": "Paris"})]),
    (PYTHONIC, "[add(a=1", "[add(a=1", []),  # no whole call: a list or a call, no telling
    (GEMMA4, "Sure. <|tool_call>call:add{a:1,b", "Sure.", []),
    (GEMMA4, "<|tool_call>call:add{a:1,b:2}<tool_call|><|tool_c", "", [("add", {"a": 1, "b": 2})]),
]


def test_a_forced_output_cut_short_is_never_content():
    # A grammar made it calls alone: a Llama 3 call cut short is one too, though it is no whole JSON call.
    for template, text in [
        (LLAMA3, '{"name": "add", "parameters": {"a": 1'),
        (HERMES, '<tool_call>\n{"na'),
        (PYTHONIC, "[add(a=1"),
    ]:
        parser = ToolCallParser(template, TOOLS, forced=True)
        assert (parser.feed(text), parser.finish("length")) == ("", ("", [], "length"))


@pytest.mark.parametrize(("template", "text", "content", "calls"), CUT_CASES)
def test_a_call_cut_by_max_tokens_is_not_content(template, text, content, calls):
    for cut in range(len(text) + 1):
        parser = ToolCallParser(template, TOOLS)
        emitted = parser.feed(text[:cut]) + parser.feed(text[cut:])
        rest, parsed, reason = parser.finish("length")
        assert reason == "length"
        assert (emitted + rest, _calls(parsed)) == (content, calls), cut


def test_parser_streams_plain_text_without_delay():
    parser = ToolCallParser(HERMES, TOOLS)
    assert parser.feed("Hello") == "Hello"
    assert parser.feed(" wor") == " wor"
    assert parser.feed("ld <tool") == "ld"
    assert parser.feed("s>") == " <tools>"
    parser = ToolCallParser(LLAMA3, TOOLS)
    assert parser.feed(" ") == ""
    assert parser.feed("Sure") == " Sure"
    assert parser.feed("!") == "!"


def test_unicode_arguments_are_kept_as_text():
    parser = ToolCallParser(HERMES, TOOLS)
    parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "K\\u00f8benhavn"}}</tool_call>')
    assert parser.finish("stop")[1][0].arguments == '{"city": "København"}'


# ---------------------------------------------------------------------------------------------------------------
# Constrained decoding
# ---------------------------------------------------------------------------------------------------------------


def _matcher(ll_tokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _accepts(ll_tokenizer, hf_tokenizer, grammar: str, text: str) -> bool:
    matcher = _matcher(ll_tokenizer, grammar)
    return (
        matcher.consume_tokens(hf_tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    )


def _call_text(template: ToolTemplate, name: str, arguments: object) -> str:
    # As a model writes it: non-ASCII as itself (the grammar refuses a \u escape of a printable character).
    if template.format is ToolFormat.PYTHONIC:
        return "[" + pythonic_call(name, arguments) + "]"
    if template.format is ToolFormat.LLAMA3_JSON:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    if template.format is ToolFormat.GEMMA4:
        return f"<|tool_call>call:{name}{_gemma4_value(arguments)}<tool_call|>"
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def _gemma4_value(value: object) -> str:
    """A JSON value as Gemma 4 writes it in a call (strings in <|"|> quotes, keys bare)."""
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma4_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_gemma4_value, value)) + "]"
    return json.dumps(value)


def _join(template: ToolTemplate, texts: list[str]) -> str:
    if template.format is ToolFormat.GEMMA4:
        return "".join(texts)
    if template.format is ToolFormat.PYTHONIC:
        return "[" + ", ".join(t[1:-1] for t in texts) + "]"
    return ("; " if template.format is ToolFormat.LLAMA3_JSON else "\n").join(texts)


@pytest.mark.parametrize(
    "template", [HERMES, LLAMA3, PYTHONIC, GEMMA4], ids=["hermes", "llama3_json", "pythonic", "gemma4"]
)
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_required_grammar(ll_tokenizer, hf_tokenizer, template, parallel):
    grammar = tool_call_grammar(TOOLS, ToolChoice("required"), template, parallel)
    weather = _call_text(template, "get_weather", {"city": "Paris", "unit": "c"})
    add = _call_text(template, "add", {"a": 2, "b": 3})
    for text in (weather, add):
        assert _accepts(ll_tokenizer, hf_tokenizer, grammar, text), text
    assert _accepts(ll_tokenizer, hf_tokenizer, grammar, _join(template, [add, weather])) is parallel
    refused = [
        "",
        "I will not call a tool.",
        _call_text(template, "sub", {"a": 2, "b": 3}),  # not a tool
        _call_text(template, "add", {"a": 2, "b": "3"}),  # wrong argument type
        _call_text(template, "add", {"a": 2}),  # a required argument missing
        _call_text(template, "add", {"a": 2, "b": 3, "c": 4}),  # additionalProperties false
        _call_text(template, "get_weather", {"city": "Paris", "unit": "k"}),  # not in the enum
    ]
    weather = _call_text(template, "get_weather", {"city": "Paris", "unit": "c"})
    if template.format is ToolFormat.PYTHONIC:  # one space after ",", none around "="
        refused += [weather.replace(", ", ","), weather.replace("=", " = ")]
    elif template.format is ToolFormat.GEMMA4:  # no spaces, keys bare, strings in <|"|> quotes
        refused += [weather.replace(",", ", "), weather.replace("city:", '"city":'), weather.replace(Q, '"')]
    else:  # not json.dumps' spacing: too little, or too much
        refused += [weather.replace('", "', '","'), weather.replace('{"', '{ "')]
    for text in refused:
        assert not _accepts(ll_tokenizer, hf_tokenizer, grammar, text), text


@pytest.mark.parametrize(
    "template", [HERMES, LLAMA3, PYTHONIC, GEMMA4], ids=["hermes", "llama3_json", "pythonic", "gemma4"]
)
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_named_grammar(ll_tokenizer, hf_tokenizer, template, parallel):
    grammar = tool_call_grammar(TOOLS, ToolChoice("named", "add"), template, parallel)
    add = _call_text(template, "add", {"a": 2, "b": 3})
    assert _accepts(ll_tokenizer, hf_tokenizer, grammar, add)
    assert not _accepts(ll_tokenizer, hf_tokenizer, grammar, _join(template, [add, add]))  # once only
    assert not _accepts(
        ll_tokenizer, hf_tokenizer, grammar, _call_text(template, "get_weather", {"city": "Paris"})
    )
    assert not _accepts(ll_tokenizer, hf_tokenizer, grammar, _call_text(template, "add", {"a": 2.5, "b": 3}))


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_no_grammar_unless_a_call_is_forced(mode):
    assert tool_call_grammar(TOOLS, ToolChoice(mode), HERMES, parallel=True) is None


@pytest.mark.parametrize("template", [HERMES, PYTHONIC, GEMMA4], ids=["hermes", "pythonic", "gemma4"])
def test_grammar_keeps_the_refs_of_a_schema(ll_tokenizer, hf_tokenizer, template):
    tools = parse_tools(
        _function(
            "convert",
            parameters={
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/unit"}, "also": {"$ref": "#/properties/to"}},
                "required": ["to"],
                "$defs": {"unit": {"enum": ["c", "f"]}},
            },
        )
    )
    grammar = tool_call_grammar(tools, ToolChoice("required"), template, parallel=False)
    assert _accepts(
        ll_tokenizer, hf_tokenizer, grammar, _call_text(template, "convert", {"to": "f", "also": "c"})
    )
    assert not _accepts(ll_tokenizer, hf_tokenizer, grammar, _call_text(template, "convert", {"to": "k"}))
    assert not _accepts(
        ll_tokenizer, hf_tokenizer, grammar, _call_text(template, "convert", {"to": "c", "also": "k"})
    )


def test_forced_arguments_take_only_the_listed_properties_unless_the_schema_opens_them(
    ll_tokenizer, hf_tokenizer
):
    """As json_schema's objects: a small model would otherwise invent keys until max_tokens."""
    listed = {"type": "object", "properties": {"tz": {"type": "string"}}}
    for parameters, extra_allowed in [(listed, False), ({**listed, "additionalProperties": True}, True)]:
        tools = parse_tools(_function("get_time", parameters=parameters))
        grammar = tool_call_grammar(tools, ToolChoice("required"), HERMES, parallel=False)
        assert _accepts(ll_tokenizer, hf_tokenizer, grammar, _call_text(HERMES, "get_time", {"tz": "UTC"}))
        extra = _call_text(HERMES, "get_time", {"tz": "UTC", "date": "today"})
        assert _accepts(ll_tokenizer, hf_tokenizer, grammar, extra) == extra_allowed


@pytest.mark.parametrize(
    "template", [HERMES, LLAMA3, PYTHONIC, GEMMA4], ids=["hermes", "llama3_json", "pythonic", "gemma4"]
)
def test_text_the_grammar_accepts_parses_into_the_calls(ll_tokenizer, hf_tokenizer, template):
    grammar = tool_call_grammar(TOOLS, ToolChoice("required"), template, parallel=True)
    text = _join(
        template,
        [
            _call_text(template, "get_weather", {"city": "Zürich", "unit": "c"}),
            _call_text(template, "add", {"a": -1, "b": 0}),
        ],
    )
    matcher = _matcher(ll_tokenizer, grammar)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    parser = ToolCallParser(template, TOOLS)
    # Streamed token by token, as the engine's detokenizer hands it over: text only once its bytes are whole.
    content, shown = "", ""
    for n in range(1, len(ids) + 1):
        text = hf_tokenizer.decode(ids[:n])
        if not text.endswith("\ufffd"):
            content += parser.feed(text[len(shown) :])
            shown = text
    rest, calls, reason = parser.finish("stop")
    assert content + rest == "" and reason == "tool_calls"
    assert [(call.name, call.arguments) for call in calls] == [
        ("get_weather", '{"city": "Zürich", "unit": "c"}'),
        ("add", '{"a": -1, "b": 0}'),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Gemma 4: its markers as tokens of their own, as in its tokenizer
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4_tokenizers(hf_tokenizer):
    tokenizer = copy.deepcopy(hf_tokenizer)
    tokenizer.add_tokens(GEMMA4_MARKERS)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def test_gemma4s_template_is_detected_with_its_marker_tokens(gemma4_tokenizers):
    tokenizer, _ = gemma4_tokenizers
    found = detect_tool_template(chat_templates.GEMMA4, tokenizer)
    assert found.format is ToolFormat.GEMMA4 and found.native
    assert dict(found.marker_ids) == {m: tokenizer.convert_tokens_to_ids(m) for m in GEMMA4_MARKERS}
    assert detect_tool_template(chat_templates.GEMMA4) == GEMMA4  # no tokenizer: no ids


def test_gemma4_template_renders_tools_calls_and_results(gemma4_tokenizers):
    tokenizer, _ = gemma4_tokenizers
    messages = [
        {"role": "user", "content": "Weather in Oslo, then 2 + 3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("c1", "get_weather", '{"city": "Oslo"}'),
                _call("c2", "add", '{"a": 2, "b": 3}'),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "name": "add", "content": "5"},
    ]
    text = _render(tokenizer, chat_templates.GEMMA4, messages, TOOLS)
    assert '<|tool>declaration:get_weather{description:<|"|>Current weather of a city<|"|>' in text
    assert (
        f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|><|tool_call>call:add{{a:2,b:3}}<tool_call|>"
        f"<|tool_response>response:get_weather{{value:{Q}sunny{Q}}}<tool_response|>"
    ) in text
    assert text.endswith(f"response:add{{value:{Q}5{Q}}}<tool_response|>")  # the model goes on in its turn


def test_gemma4_grammar_names_its_marker_tokens(gemma4_tokenizers):
    """With the markers as tokens the grammar takes them alone (never spelled in pieces), and a string may hold
    any text, "<" included, up to its closing quote token."""
    tokenizer, ll = gemma4_tokenizers
    template = detect_tool_template(chat_templates.GEMMA4, tokenizer)
    grammar = tool_call_grammar(TOOLS, ToolChoice("required"), template, parallel=True)
    ids = dict(template.marker_ids)
    assert f"<[{ids['<|tool_call>']}]>" in grammar
    text = _join(
        template,
        [
            _call_text(template, "get_weather", {"city": "a <b> & <|c", "unit": "c"}),
            _call_text(template, "add", {"a": -1, "b": 0}),
        ],
    )
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert tokens.count(ids[Q]) == 4 and tokens.count(ids["<|tool_call>"]) == 2
    matcher = _matcher(ll, grammar)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    # The same text spelled without the marker tokens is refused.
    pieces = [
        t
        for piece in re.split(r"(<\|tool_call>|<tool_call\|>|<\|\"\|>)", text)
        for t in _pieces(tokenizer, piece)
    ]
    assert pieces != tokens and tokenizer.decode(pieces) == text
    assert not _matcher(ll, grammar).consume_tokens(pieces)
    parser = ToolCallParser(template, TOOLS, forced=True)
    content = "".join(parser.feed(tokenizer.decode([t])) for t in tokens)
    rest, calls, reason = parser.finish("stop")
    assert content + rest == "" and reason == "tool_calls"
    assert _calls(calls) == [
        ("get_weather", {"city": "a <b> & <|c", "unit": "c"}),
        ("add", {"a": -1, "b": 0}),
    ]


def _pieces(tokenizer, text: str) -> list[int]:
    """`text` as tokens, a marker spelled one character at a time."""
    if text in GEMMA4_MARKERS:
        return [t for c in text for t in tokenizer.encode(c, add_special_tokens=False)]
    return tokenizer.encode(text, add_special_tokens=False)


def test_gemma4_grammar_keeps_each_tools_refs_and_quotes_keys_it_cannot_write_bare(gemma4_tokenizers):
    """Two tools whose $defs share a name resolve each to its own (a cache keyed across tools once mixed them),
    and a property named "a:b" is written quoted, which the parser reads back."""
    tokenizer, ll = gemma4_tokenizers
    template = detect_tool_template(chat_templates.GEMMA4, tokenizer)

    def tool(name: str, item: dict, key: str = "x") -> dict:
        parameters = {"type": "object", "properties": {key: {"$ref": "#/$defs/Item"}}, "required": [key]}
        return {
            "type": "function",
            "function": {"name": name, "parameters": {**parameters, "$defs": {"Item": item}}},
        }

    tools = parse_tools([tool("ints", {"type": "integer"}), tool("texts", {"type": "string"}, key="a:b")])
    grammar = tool_call_grammar(tools, ToolChoice("required"), template, parallel=False)

    def accepts(text: str) -> bool:
        matcher = _matcher(ll, grammar)
        return (
            matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
            and matcher.is_accepting()
        )

    assert accepts("<|tool_call>call:ints{x:3}<tool_call|>")
    quoted = f"<|tool_call>call:texts{{{Q}a:b{Q}:{Q}hi{Q}}}<tool_call|>"
    assert accepts(quoted) and not accepts(quoted.replace(f"{Q}hi{Q}", "3"))
    assert not accepts('<|tool_call>call:ints{x:<|"|>3<|"|>}<tool_call|>')
    parser = ToolCallParser(template, tools, forced=True)
    parser.feed(quoted)
    assert _calls(parser.finish("stop")[1]) == [("texts", {"a:b": "hi"})]

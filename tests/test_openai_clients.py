"""The application surface of the OpenAI API against a real daemon, through the official openai client and
raw HTTP: structured output, tool calls, embeddings, echo, prompt lists, continuous usage and bad input.
With random weights constrained output still parses: the grammar forces it."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from daemon_fixtures import DaemonProcess
from gateway_fixtures import WEATHER_PARAMETERS, daemon_fixture, kvd_fixture, model_fixture, oai_fixture  # noqa: F401

from kvd_client import Client

PROMPT = "The capital of France is"
HI = [{"role": "user", "content": "Hi"}]
# Bounded strings, so that a schema's output ends well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "time_in",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,  # else the random model may add keys until max_tokens
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def http(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.base_url, timeout=60) as client:
        yield client


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_replies_validate_streamed_or_not(oai: openai.OpenAI, model: str, seed: int):
    params = dict(model=model, messages=HI, max_tokens=200, seed=seed, response_format=_json_schema(PERSON))
    reply = oai.chat.completions.create(**params)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in oai.chat.completions.create(**params, stream=True)
    )
    assert streamed == reply.choices[0].message.content  # the same seed: the same text
    # /v1/completions takes response_format too (the openai client passes it in extra_body).
    completion = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=200,
        seed=seed,
        extra_body={"response_format": _json_schema(PERSON)},
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_json_object_regex_and_grammar(oai: openai.OpenAI, model: str):
    # Greedy: a sampled object of the random model may grow keys past any max_tokens.
    reply = oai.chat.completions.create(
        model=model, messages=HI, max_tokens=200, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"
    got = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, seed=3, extra_body={"regex": "[0-9]{3}-[a-z]{2}"}
    )
    assert (
        len(got.choices[0].text) == 6 and got.choices[0].text[3] == "-" and got.choices[0].text[:3].isdigit()
    )
    grammar = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z]{1,8}/'
    got = oai.chat.completions.create(
        model=model, messages=HI, max_tokens=30, extra_body={"grammar": grammar}
    )
    answer, _, reason = got.choices[0].message.content.partition(" because ")
    assert answer in ("yes", "no") and 1 <= len(reason) <= 8 and reason.isalpha()


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ("required", {"weather", "time_in"}),
        ({"type": "function", "function": {"name": "time_in"}}, {"time_in"}),
    ],
)
def test_forced_tool_calls_parse_and_validate_streamed_or_not(
    oai: openai.OpenAI, model: str, tool_choice: object, names: set[str]
):
    # One call: with parallel calls allowed the random model may go on calling until max_tokens.
    params = dict(
        model=model,
        messages=HI,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=200,
        seed=4,
    )
    reply = oai.chat.completions.create(**params)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    _check_calls(message.tool_calls, names)
    chunks = list(oai.chat.completions.create(**params, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(message.tool_calls)))
    assert [(d.id, d.function.name, d.function.arguments) for d in deltas] != []
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert (
        chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].delta.tool_calls is None
    )
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_auto_tool_choice_parses_calls_from_the_text(oai: openai.OpenAI, model: str):
    # A grammar makes the random model write a call in the template's format; "auto" must parse it out.
    call = '<tool_call>\\n{\\"name\\": \\"weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\", \\"days\\": 2}}\\n</tool_call>'
    params = dict(
        model=model, messages=HI, tools=TOOLS, max_tokens=60, extra_body={"grammar": f'start: "{call}"'}
    )
    reply = oai.chat.completions.create(**params)
    (got,) = reply.choices[0].message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == (
        "weather",
        {"city": "Paris", "days": 2},
    )
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    chunks = list(oai.chat.completions.create(**params, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the call's text is not content
    (delta,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert delta.function.name == "weather" and delta.id.startswith("call_")
    # Without tools to match, the same text stays content.
    plain = oai.chat.completions.create(
        model=model, messages=HI, max_tokens=60, extra_body=params["extra_body"]
    )
    assert (
        plain.choices[0].message.content.startswith("<tool_call>") and not plain.choices[0].message.tool_calls
    )


def test_a_two_turn_tool_conversation(oai: openai.OpenAI, model: str, http: httpx.Client):
    first = oai.chat.completions.create(
        model=model,
        messages=HI,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=5,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls  # parallel_tool_calls false: exactly one
    history = [*HI, message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = oai.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # The history holds the first prompt, the call and its result.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    body = {
        "model": model,
        "messages": [*HI, message.model_dump(exclude_none=True), history[2]],
        "max_tokens": 2,
    }
    body["messages"][2] = {**history[2], "tool_call_id": "call_unknown"}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[2].tool_call_id"


def test_embeddings_float_base64_and_dimensions(
    oai: openai.OpenAI, kvd: Client, model: str, http: httpx.Client
):
    texts = ["Hello world", "Bonjour"]
    expected = kvd.embed(texts)
    floats = oai.embeddings.create(model=model, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    for got, want in zip(floats.data, expected.embeddings, strict=True):
        assert got.embedding == pytest.approx(want)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == expected.prompt_tokens
    raw = http.post(
        "/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "base64"}
    ).json()
    decoded = [
        list(struct.unpack(f"<{expected.dimensions}f", base64.b64decode(d["embedding"]))) for d in raw["data"]
    ]
    for got, want in zip(decoded, expected.embeddings, strict=True):
        assert got == pytest.approx(want, abs=1e-6)  # float32 on the wire
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == model
    # The openai client asks for base64 by default and decodes it.
    default = oai.embeddings.create(model=model, input="Hello world", dimensions=8)
    (vector,) = [d.embedding for d in default.data]
    assert len(vector) == 8 and sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-5)
    assert vector == pytest.approx(kvd.embed("Hello world", dimensions=8).embeddings[0], abs=1e-6)
    ids = kvd.tokenize("Hello world")
    by_ids = oai.embeddings.create(model=model, input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(expected.embeddings[0])
    too_many = http.post("/v1/embeddings", json={"model": model, "input": "x", "dimensions": 10**6})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "dimensions"


def test_guidellms_streaming_body(http: httpx.Client, model: str):
    body = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 12,
        "ignore_eos": True,
        "messages": HI,
        "model": model,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 12
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1  # the count before the end is the daemon's own
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_logit_bias_and_max_completion_tokens(oai: openai.OpenAI, kvd: Client, model: str):
    (token,) = kvd.tokenize(" blue")
    got = oai.chat.completions.create(
        model=model,
        messages=HI,
        max_completion_tokens=5,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.content == kvd.detokenize([token] * 5) and got.usage.completion_tokens == 5
    banned = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(token): -100}
    )
    free = kvd.generate(PROMPT, max_tokens=6, temperature=0, logit_bias={str(token): -100})
    assert banned.choices[0].text == free.text and token not in free.token_ids


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_the_prompt(oai: openai.OpenAI, kvd: Client, model: str, max_tokens: int):
    ids = kvd.tokenize(PROMPT)
    got = oai.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    choice = choice_lp = got.choices[0]
    choice_lp = choice.logprobs
    expected = kvd.generate(ids, max_tokens=1, temperature=0, prompt_logprobs=1).prompt_logprobs
    assert choice.text.startswith(PROMPT) and len(choice_lp.tokens) == len(ids) + max_tokens
    assert "".join(choice_lp.tokens) == choice.text
    assert choice_lp.token_logprobs[0] is None and choice_lp.top_logprobs[0] is None
    assert choice_lp.token_logprobs[1 : len(ids)] == pytest.approx([lp.logprob for lp in expected[1:]])
    assert choice_lp.text_offset[:2] == [0, len(choice_lp.tokens[0])]
    assert got.usage.completion_tokens == max_tokens and got.usage.prompt_tokens == len(ids)
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"


def test_a_list_of_prompts_in_one_request(oai: openai.OpenAI, kvd: Client, model: str):
    prompts = ["One two", "Three four five"]
    got = oai.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=4, seed=9, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    expected = [
        kvd.generate(p, max_tokens=4, seed=9 + j, ignore_eos=True).text for p in prompts for j in range(2)
    ]
    assert [c.text for c in got.choices] == expected
    assert got.usage.prompt_tokens == sum(len(kvd.tokenize(p)) for p in prompts)
    assert got.usage.completion_tokens == 16


def test_output_neutral_fields_are_accepted_and_change_nothing(oai: openai.OpenAI, model: str):
    params = dict(model=model, messages=HI, max_tokens=6, temperature=0)
    plain = oai.chat.completions.create(**params).choices[0].message.content
    neutral = oai.chat.completions.create(
        **params,
        store=True,
        metadata={"team": "x"},
        service_tier="auto",
        user="u1",
        safety_identifier="s1",
        prompt_cache_key="k1",
        parallel_tool_calls=True,
        prediction={"type": "content", "content": "Hello"},
        response_format={"type": "text"},
    )
    assert neutral.choices[0].message.content == plain


def _error(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {"response_format": _json_schema({"type": "objekt"})},
            "response_format.json_schema.schema",
            "objekt",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", ""),
        ({"regex": "(unclosed"}, "regex", "regex"),
        ({"grammar": "start: nothing_defined"}, "grammar", ""),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
            "",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", ""),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        (
            {"reasoning_effort": "high"},
            "reasoning_effort",
            "takes no reasoning effort",
        ),  # a model that cannot think
        (
            {"chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs.enable_thinking",
            "thinking",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "enable_thinking"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias", ""),
        (
            {"messages": [*HI, {"role": "tool", "content": "x", "tool_call_id": "call_9"}]},
            "messages[1].tool_call_id",
            "",
        ),
    ],
)
def test_bad_input_names_the_field(http: httpx.Client, model: str, extra: dict, param: str, says: str):
    error = _error(http, "/v1/chat/completions", {"model": model, "messages": HI, "max_tokens": 4, **extra})
    assert error["param"] == param and says in error["message"], error


def test_a_400_names_every_refused_field(http: httpx.Client, model: str):
    body = {
        "model": model,
        "messages": HI,
        "reasoning_effort": "extreme",
        "functions": [{"name": "f"}],
        "audio": {"voice": "x"},
        "n": 0,
    }
    error = _error(http, "/v1/chat/completions", body)
    assert error["param"] == "n"
    for field in ("n", "reasoning_effort", "functions", "audio"):
        assert f"{field}:" in error["message"]
    error = _error(
        http,
        "/v1/completions",
        {"model": model, "prompt": PROMPT, "echo": True, "stream": True, "best_of": 3},
    )
    assert error["param"] == "echo" and "best_of:" in error["message"]
    error = _error(http, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 0})
    assert error["param"] == "max_tokens"

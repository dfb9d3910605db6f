"""Anthropic's Messages API on the gateway, through the official anthropic client against a real daemon: text,
system prompts, streams with Anthropic's events, tool use and tool results, token counts, and its error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from daemon_fixtures import DaemonProcess
from gateway_fixtures import PERSON, WEATHER_PARAMETERS, daemon_fixture, kvd_fixture, model_fixture  # noqa: F401

from kvd_client import Client

HI = [{"role": "user", "content": "Hi"}]
# Anthropic's current SDK sends no sampling fields of its own; older clients and kvd's extension still may.
GREEDY = {"temperature": 0}
WEATHER = {"name": "weather", "description": "The weather in a city", "input_schema": WEATHER_PARAMETERS}
DAEMON_WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def api(daemon: DaemonProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=60)


def test_a_message_is_the_daemons_chat(api: anthropic.Anthropic, kvd: Client, model: str):
    reply = api.messages.create(model=model, messages=HI, max_tokens=8, extra_body=GREEDY)
    direct = kvd.chat(HI, max_tokens=8, temperature=0)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == direct.text
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[direct.finish_reason]
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (
        direct.usage.prompt_tokens,
        direct.usage.completion_tokens,
    )


@pytest.mark.parametrize(
    "system", ["Be brief.", [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]]
)
def test_the_system_prompt_and_content_blocks_reach_the_template(
    api: anthropic.Anthropic, kvd: Client, model: str, system
):
    blocks = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    reply = api.messages.create(model=model, system=system, messages=blocks, max_tokens=4, extra_body=GREEDY)
    expected = [{"role": "system", "content": "Be brief."}, *HI]
    assert reply.usage.input_tokens == len(kvd.tokenize(messages=expected))
    assert reply.content[0].text == kvd.chat(expected, max_tokens=4, temperature=0).text


def test_a_stream_has_anthropics_events_and_the_same_message(api: anthropic.Anthropic, model: str):
    params = dict(model=model, messages=HI, max_tokens=8, extra_body=GREEDY)
    whole = api.messages.create(**params)
    events = list(api.messages.create(**params, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    with api.messages.stream(**params) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text and len(final.content) == 1
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_named(api: anthropic.Anthropic, model: str):
    params = dict(model=model, messages=HI, max_tokens=12, extra_body=GREEDY)
    free = api.messages.create(**params).content[0].text
    stop = free[3:6]
    assert stop and stop not in free[:3]
    reply = api.messages.create(**params, stop_sequences=["never written", stop])
    assert (reply.stop_reason, reply.stop_sequence, reply.content[0].text) == (
        "stop_sequence",
        stop,
        free[:3],
    )
    with api.messages.stream(**params, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_use_validates_streamed_or_not(api: anthropic.Anthropic, model: str):
    params = dict(
        model=model,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        max_tokens=200,
        extra_body={"seed": 4},
    )
    reply = api.messages.create(**params)
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with api.messages.stream(**params) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input) and final.stop_reason == "tool_use"
    anyone = api.messages.create(**{**params, "tool_choice": {"type": "any"}})
    assert anyone.stop_reason == "tool_use"


def test_tool_results_and_token_counts(api: anthropic.Anthropic, kvd: Client, model: str):
    history = [
        *HI,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo", "days": 1}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And?"},
            ],
        },
    ]
    reply = api.messages.create(
        model=model, messages=history, tools=[WEATHER], max_tokens=4, extra_body=GREEDY
    )
    counted = api.messages.count_tokens(model=model, messages=history, tools=[WEATHER])
    daemon = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And?"},
    ]
    assert (
        counted.input_tokens
        == reply.usage.input_tokens
        == len(kvd.tokenize(messages=daemon, tools=[DAEMON_WEATHER]))
    )
    assert counted.input_tokens > api.messages.count_tokens(model=model, messages=history).input_tokens
    assert api.messages.count_tokens(model=model, messages=HI).input_tokens == len(kvd.tokenize(messages=HI))
    failed = [
        *history[:2],
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "down", "is_error": True}
            ],
        },
    ]
    assert api.messages.count_tokens(model=model, messages=failed).input_tokens > 0


def test_an_output_format_is_a_json_schema(api: anthropic.Anthropic, model: str):
    config = {"format": {"type": "json_schema", "schema": PERSON}}
    reply = api.messages.create(
        model=model,
        messages=HI,
        max_tokens=60,
        output_config=config,
        extra_body={"seed": 1},
        speed="standard",
    )
    jsonschema.validate(json.loads(reply.content[0].text), PERSON)
    assert reply.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("params", "error", "says"),
    [
        ({"model": "claude-x"}, anthropic.NotFoundError, "claude-x"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, anthropic.BadRequestError, "thinking"),
        ({"extra_body": {"temperature": -1}}, anthropic.BadRequestError, "temperature"),
        ({"output_config": {"effort": "high"}}, anthropic.BadRequestError, "output_config.effort"),
        ({"thinking": {"type": "enabled"}}, anthropic.BadRequestError, "thinking.budget_tokens"),
        ({"stop_sequences": [""]}, anthropic.BadRequestError, "stop_sequences"),
        ({"extra_body": {"frequency": 1}}, anthropic.BadRequestError, "frequency"),
        ({"tool_choice": {"type": "any"}}, anthropic.BadRequestError, "tool_choice"),
        (
            {"messages": [*HI, {"role": "assistant", "content": "{"}]},
            anthropic.BadRequestError,
            "messages[1]",
        ),
        ({"messages": []}, anthropic.BadRequestError, "messages"),
        ({"messages": [{"role": "user", "content": []}]}, anthropic.BadRequestError, "messages[0].content"),
        ({"tools": [{**WEATHER, "strict": True}]}, anthropic.BadRequestError, "tools[0].strict"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}],
                    }
                ]
            },
            anthropic.BadRequestError,
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}],
                    }
                ]
            },
            anthropic.BadRequestError,
            "messages[0].content[0]",
        ),
    ],
)
def test_refused_requests_in_anthropics_shape(api: anthropic.Anthropic, model: str, params, error, says):
    with pytest.raises(error) as e:
        api.messages.create(**{"model": model, "messages": HI, "max_tokens": 4, **params})
    assert e.value.body["type"] == "error" and says in e.value.body["error"]["message"]
    kind = "not_found_error" if error is anthropic.NotFoundError else "invalid_request_error"
    assert e.value.body["error"]["type"] == kind


def test_a_malformed_body_is_a_400_in_anthropics_shape(daemon: DaemonProcess, model: str):
    r = httpx.post(f"{daemon.base_url}/v1/messages", json={"model": model, "messages": HI}, timeout=30)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and "max_tokens" in body["error"]["message"]

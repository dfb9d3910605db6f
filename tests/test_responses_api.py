"""OpenAI's Responses API on the gateway, through the openai client's `responses` against a real daemon: text,
instructions, json_schema, function tools and their outputs, streams with the Responses events, responses kept
for previous_response_id (and only for their caller), and errors naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from gateway_fixtures import (  # noqa: F401
    PERSON,
    WEATHER_PARAMETERS,
    daemon_fixture,
    kvd_fixture,
    model_fixture,
    oai_fixture,
)

from kvd.gateway.response_store import ResponseStore
from kvd_client import Client

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather",
    "parameters": WEATHER_PARAMETERS,
}


def test_text_is_the_daemons_chat(oai: openai.OpenAI, kvd: Client, model: str):
    reply = oai.responses.create(model=model, input="Hi", max_output_tokens=8, temperature=0)
    direct = kvd.chat(HI, max_tokens=8, temperature=0)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.output_text == direct.text
    assert [item.type for item in reply.output] == ["message"]
    assert reply.usage.input_tokens == direct.usage.prompt_tokens == len(kvd.tokenize(messages=HI))
    assert reply.usage.output_tokens == direct.usage.completion_tokens
    if direct.finish_reason == "length":
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed" and reply.incomplete_details is None


def test_instructions_and_message_items_reach_the_template(oai: openai.OpenAI, kvd: Client, model: str):
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "H"}, {"type": "input_text", "text": "i"}],
        }
    ]
    reply = oai.responses.create(
        model=model, instructions="Be brief.", input=items, max_output_tokens=6, temperature=0
    )
    expected = [{"role": "system", "content": "Be brief."}, *HI]
    assert reply.usage.input_tokens == len(kvd.tokenize(messages=expected))
    assert reply.output_text == kvd.chat(expected, max_tokens=6, temperature=0).text


def test_a_json_schema_format(oai: openai.OpenAI, model: str):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    reply = oai.responses.create(
        model=model, input="Who?", text=text, max_output_tokens=60, temperature=0.7, extra_body={"seed": 3}
    )
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    assert reply.text.format.type == "json_schema"


def test_a_stream_has_the_responses_events_and_the_same_response(oai: openai.OpenAI, model: str):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    fields = {"model": model, "input": "Hi", "max_output_tokens": 60, "temperature": 0, "text": text}
    whole = oai.responses.create(**fields)
    assert whole.status == "completed"
    events = list(oai.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert (
        final.output_text
        == whole.output_text
        == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    with oai.responses.stream(**fields) as stream:  # the SDK's own accumulation agrees
        assert stream.get_final_response().output_text == whole.output_text
    cut = list(oai.responses.create(**{**fields, "max_output_tokens": 3, "text": None}, stream=True))
    assert (
        cut[-1].type == "response.incomplete"
        and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    )
    with oai.responses.stream(**fields) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_a_forced_call_its_output_and_the_next_turn(oai: openai.OpenAI, kvd: Client, model: str):
    first = oai.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = oai.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=6,
        temperature=0,
    )
    daemon_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "weather", "arguments": call.arguments},
    }
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [daemon_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert second.usage.input_tokens == len(kvd.tokenize(messages=conversation, tools=tools))
    same = oai.responses.create(
        model=model,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(), result],
        tools=[WEATHER],
        max_output_tokens=6,
        temperature=0,
    )
    assert same.output_text == second.output_text and same.usage.input_tokens == second.usage.input_tokens


def test_kept_responses_are_retrieved_deleted_and_not_kept_when_store_is_false(
    oai: openai.OpenAI, model: str
):
    reply = oai.responses.create(model=model, input="Hi", max_output_tokens=3, temperature=0)
    assert oai.responses.retrieve(reply.id).output_text == reply.output_text
    follow = oai.responses.create(
        model=model, previous_response_id=reply.id, input="More", max_output_tokens=3
    )
    assert follow.previous_response_id == reply.id and follow.usage.input_tokens > reply.usage.input_tokens
    oai.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(reply.id)
    unkept = oai.responses.create(model=model, input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, previous_response_id=unkept.id, input="More", max_output_tokens=3)
    assert e.value.body["param"] == "previous_response_id"


def test_the_store_keeps_a_response_for_its_caller_only_and_for_a_while():
    store = ResponseStore(max_responses=2, ttl_s=60)
    store.put("alice", {"id": "resp_1"}, [])
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.get("alice", "resp_1").body == {"id": "resp_1"}
    store.put("alice", {"id": "resp_2"}, [])
    store.put("alice", {"id": "resp_3"}, [])
    assert store.get("alice", "resp_1") is None  # the oldest went first
    shared = ResponseStore(max_responses=10, max_per_owner=2)
    for i in range(3):
        shared.put("mallory", {"id": f"resp_m{i}"}, [])
    shared.put("alice", {"id": "resp_a"}, [])
    for i in range(3, 6):
        shared.put("mallory", {"id": f"resp_m{i}"}, [])
    assert shared.get("alice", "resp_a") is not None  # another caller's many responses push only its own out
    assert [shared.get("mallory", f"resp_m{i}") is not None for i in range(6)] == [False] * 4 + [True] * 2
    brief = ResponseStore(ttl_s=0)
    brief.put("alice", {"id": "resp_4"}, [])
    assert brief.get("alice", "resp_4") is None


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            "input[0].content[0]",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools[0].name"),
        (
            {
                "input": [
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}
                ]
            },
            "input[0].output[0]",
        ),
        ({"previous_response_id": "resp_nothing"}, "previous_response_id"),
        ({"temperature": -1}, "temperature"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # this model has no thinking section
    ],
)
def test_bad_requests_name_the_field(oai: openai.OpenAI, model: str, params: dict, param: str):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        oai.responses.create(**{"model": model, "input": "Hi", "max_output_tokens": 3, **params})
    assert e.value.body["param"] == param, e.value.body

"""A reasoning model through a real daemon and its gateway: the thinking section apart from the answer in the
protocol's replies (streamed and whole), OpenAI's reasoning_content, Anthropic's thinking blocks and Ollama's
thinking, with a JSON schema that holds for the answer after the section."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest
from daemon_fixtures import DaemonProcess
from gateway_fixtures import gateway_daemon, kvd_fixture, model_fixture, oai_fixture  # noqa: F401
from tiny_models import save_tiny_reasoning_llama

from kvd_client import BadRequestError, Client

HELLO = [{"role": "user", "content": "hello there"}]
OK_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", name="daemon")
def daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    model = save_tiny_reasoning_llama(tmp_path_factory.mktemp("reasoning_model"))
    with gateway_daemon(model, tmp_path_factory.mktemp("reasoning_gateway")) as proc:
        yield proc


def test_the_daemon_sends_the_section_apart_streamed_or_whole(kvd: Client):
    assert kvd.info()["reasoning"] == {"start": "<think>", "end": "</think>"}
    fields = {"max_tokens": 40, "temperature": 0, "json_schema": OK_SCHEMA, "reasoning_budget": 4}
    whole = kvd.chat(HELLO, **fields)
    chunks = list(kvd.stream_chat(HELLO, **fields))
    assert "".join(c.reasoning for c in chunks) == whole.reasoning != ""
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert isinstance(json.loads(whole.text)["ok"], bool) and "</think>" not in whole.text + whole.reasoning
    assert whole.usage.reasoning_tokens == 4 + 1  # the budget's tokens and the end marker
    off = kvd.chat(HELLO, **{**fields, "think": False})
    assert off.reasoning == "" and isinstance(json.loads(off.text)["ok"], bool)
    assert len(kvd.tokenize(messages=HELLO, think=False)) > len(kvd.tokenize(messages=HELLO))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"think": "yes"}, "think"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"reasoning_budget": -2}, "reasoning_budget"),
    ],
)
def test_bad_reasoning_fields_name_themselves(kvd: Client, fields: dict, field: str):
    with pytest.raises(BadRequestError) as e:
        kvd.chat(HELLO, max_tokens=2, **fields)
    assert e.value.field == field


def test_openai_reasoning_content(oai: openai.OpenAI, model: str):
    fields = {
        "model": model,
        "messages": HELLO,
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK_SCHEMA}},
        "extra_body": {"reasoning_budget": 5},
    }
    reply = oai.chat.completions.create(**fields)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] and isinstance(json.loads(message.content)["ok"], bool)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5 + 1
    stream = oai.chat.completions.create(**fields, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    off = oai.chat.completions.create(**{**fields, "reasoning_effort": "none"}).choices[0].message
    assert "reasoning_content" not in off.model_extra and json.loads(off.content)
    kwargs = oai.chat.completions.create(
        **{**fields, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    )
    assert kwargs.choices[0].message.content == off.content


def test_anthropic_thinking_blocks(daemon: DaemonProcess, model: str):
    api = anthropic.Anthropic(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=60)
    fields = {
        "model": model,
        "messages": HELLO,
        "max_tokens": 40,
        "thinking": {"type": "enabled", "budget_tokens": 4},
        "output_config": {"format": {"type": "json_schema", "schema": OK_SCHEMA}},
        "extra_body": {"temperature": 0},
    }
    reply = api.messages.create(**fields)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking and isinstance(json.loads(reply.content[1].text)["ok"], bool)
    with api.messages.stream(**fields) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds.index("text_delta") > kinds.index("thinking_delta")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    omitted = api.messages.create(**{**fields, "thinking": {**fields["thinking"], "display": "omitted"}})
    assert omitted.content[0].thinking == "" and omitted.content[1].text == reply.content[1].text
    disabled = api.messages.create(**{**fields, "thinking": {"type": "disabled"}})
    assert [b.type for b in disabled.content] == ["text"]


def test_ollama_thinking(daemon: DaemonProcess, model: str, kvd: Client):
    api = ollama.Client(host=daemon.base_url, timeout=60)
    options = {"temperature": 0, "num_predict": 12}
    reply = api.chat(model=model, messages=HELLO, think=True, options=options)
    direct = kvd.chat(HELLO, max_tokens=12, temperature=0, think=True)
    assert reply.message.thinking == direct.reasoning != "" and reply.message.content == direct.text
    streamed = list(api.chat(model=model, messages=HELLO, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed) == direct.reasoning
    assert "thinking" in api.show(model).capabilities


def test_responses_reasoning_items(oai: openai.OpenAI, model: str):
    fields = {
        "model": model,
        "input": "hello there",
        "max_output_tokens": 40,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "ok", "schema": OK_SCHEMA}},
        "extra_body": {"reasoning_budget": 3},
    }
    reply = oai.responses.create(**fields)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text and isinstance(json.loads(reply.output_text)["ok"], bool)
    assert reply.usage.output_tokens_details.reasoning_tokens == 3 + 1
    events = list(oai.responses.create(**fields, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reply.output[0].content[0].text
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    off = oai.responses.create(**{**fields, "reasoning": {"effort": "none"}})
    assert [item.type for item in off.output] == ["message"]

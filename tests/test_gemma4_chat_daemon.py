"""A tiny Gemma 4 with its markers as tokens and a template in Gemma 4's format, through a real daemon and the
openai SDK: tool calls in Gemma 4's syntax forced, parsed and streamed; past calls and results rendered by the
template; its thought channel as the reasoning section."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from conftest import save_tiny_checkpoint
from daemon_fixtures import DaemonProcess
from gateway_fixtures import gateway_daemon, kvd_fixture, model_fixture, oai_fixture  # noqa: F401
from tiny_models import gemma4_tokenizer
from tool_fixtures import SCHEMAS, TOOLS

from kvd_client import Client

ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module", name="daemon")
def daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("gemma4_chat")
    save_tiny_checkpoint("gemma4", folder, tokenizer=gemma4_tokenizer(), max_position_embeddings=2048)
    with gateway_daemon(folder, tmp_path_factory.mktemp("gemma4_gateway")) as proc:
        yield proc


def test_info_names_gemma4s_formats(kvd: Client):
    info = kvd.info()
    assert info["tools"] == {"format": "gemma4", "template": "model"}
    assert info["reasoning"] == {"start": "<|channel>thought", "end": "<channel|>"}


def test_thinking_on_and_off_are_rendered_by_the_template(kvd: Client):
    on, off = (kvd.tokenize(messages=ASK, think=think) for think in (True, False))
    text_on, text_off = (kvd.detokenize(ids) for ids in (on, off))
    assert "<|think|>" in text_on and text_on.endswith("<|turn>model\n")
    assert text_off.endswith("<|turn>model\n<|channel>thought\n<channel|>")


def test_a_forced_call_comes_back_as_a_tool_call_whole_and_streamed(oai: openai.OpenAI, model: str):
    fields = dict(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    whole = oai.chat.completions.create(**fields).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    calls = whole.message.tool_calls
    assert len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed: dict[int, list[str]] = {}
    for chunk in oai.chat.completions.create(**fields, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            parts = streamed.setdefault(delta.index, ["", ""])
            parts[0] += (delta.function and delta.function.name) or ""
            parts[1] += (delta.function and delta.function.arguments) or ""
    assert [tuple(p) for _, p in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_named_call_and_then_its_result(oai: openai.OpenAI, model: str):
    named = {"type": "function", "function": {"name": "get_time"}}
    first = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60
    ).choices[0]
    (call,) = first.message.tool_calls
    assert call.function.name == "get_time"
    # The call and its result go back through the template (Gemma 4's call and response blocks).
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    after = oai.chat.completions.create(
        model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=8
    ).choices[0]
    assert after.finish_reason in ("stop", "length", "tool_calls")
    usage_before = oai.chat.completions.create(model=model, messages=ASK, max_tokens=1).usage.prompt_tokens
    usage_after = oai.chat.completions.create(model=model, messages=history, max_tokens=1).usage.prompt_tokens
    assert usage_after > usage_before


def test_parallel_calls_cut_by_max_tokens_keep_the_whole_ones(oai: openai.OpenAI, model: str):
    """The random model calls again and again until max_tokens: the whole calls come back, the cut one does not."""
    reply = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=100
    ).choices[0]
    assert reply.finish_reason == "length" and not reply.message.content
    assert len(reply.message.tool_calls) >= 2
    for call in reply.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

"""Ollama's API on the gateway, through the official ollama client against a real daemon: chat, generate,
streams, format, embeddings, tools, the model listings, and the options it refuses."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import jsonschema
import ollama
import pytest
from daemon_fixtures import DaemonProcess
from gateway_fixtures import PERSON, daemon_fixture, kvd_fixture, model_fixture  # noqa: F401
from packaging.version import Version

from kvd.gateway.choices import Choice
from kvd.gateway.ollama import ReplyShape
from kvd_client import Chunk, Client, ToolCall, Usage

HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0, "num_predict": 8}


def weather(city: str) -> str:
    """The weather in a city.

    Args:
      city: the city's name
    """
    return "sunny"


@pytest.fixture(scope="module")
def api(daemon: DaemonProcess) -> ollama.Client:
    return ollama.Client(host=daemon.base_url, timeout=60)


def test_chat_matches_the_daemon_streamed_or_not(api: ollama.Client, kvd: Client, model: str):
    expected = kvd.chat(HI, temperature=0, max_tokens=8)
    reply = api.chat(model=model, messages=HI, options=GREEDY, stream=False)
    assert reply.message.role == "assistant" and reply.message.content == expected.text
    assert reply.done and reply.done_reason == expected.finish_reason
    assert (reply.prompt_eval_count, reply.eval_count) == (expected.usage.prompt_tokens, 8)
    assert reply.total_duration >= reply.eval_duration > 0
    parts = list(api.chat(model=f"{model}:latest", messages=HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == expected.text
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 8 and parts[-1].done_reason == "length"


def test_generate_templated_raw_and_system(api: ollama.Client, kvd: Client, model: str):
    templated = api.generate(model=model, prompt="Hi", options=GREEDY)
    assert templated.response == kvd.chat(HI, temperature=0, max_tokens=8).text
    raw = api.generate(model=model, prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.response == kvd.generate("The capital of France is", temperature=0, max_tokens=8).text
    system = [{"role": "system", "content": "Be terse."}, *HI]
    with_system = api.generate(model=model, prompt="Hi", system="Be terse.", options=GREEDY)
    assert with_system.prompt_eval_count == kvd.chat(system, temperature=0, max_tokens=1).usage.prompt_tokens
    parts = list(api.generate(model=model, prompt="Hi", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == templated.response and parts[-1].done
    loaded = api.generate(model=model)  # no prompt: Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_sampling_options_reach_the_daemon(api: ollama.Client, kvd: Client, model: str):
    options = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 3, "num_predict": 10}
    options |= {"repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.2, "num_ctx": 4096}
    expected = kvd.chat(
        HI,
        temperature=0.9,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=3,
        max_tokens=10,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.2,
    )
    assert api.chat(model=model, messages=HI, options=options).message.content == expected.text
    stop = expected.text[2:5]
    cut = api.chat(model=model, messages=HI, options={**options, "stop": [stop]})
    assert stop not in cut.message.content and cut.done_reason == "stop"
    # Seed -1 is Ollama's "random": unseeded, so two replies differ where seeded ones repeat.
    unseeded = {**options, "seed": -1, "temperature": 1.5, "top_k": 0, "min_p": 0.0, "num_predict": 24}
    replies = {api.chat(model=model, messages=HI, options=unseeded).message.content for _ in range(3)}
    assert len(replies) > 1


def test_logprobs_in_ollamas_shape(api: ollama.Client, kvd: Client, model: str):
    expected = kvd.chat(HI, temperature=0, max_tokens=8, logprobs=2)
    got = api.chat(model=model, messages=HI, options=GREEDY, logprobs=True, top_logprobs=2)
    assert "".join(lp.token for lp in got.logprobs) == got.message.content
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert all(len(lp.top_logprobs) == 2 for lp in got.logprobs)
    parts = list(api.generate(model=model, prompt="Hi", options=GREEDY, logprobs=True, stream=True))
    assert [lp.logprob for p in parts for lp in p.logprobs or []] == pytest.approx(
        [lp.logprob for lp in expected.logprobs]
    )


def test_format_json_and_a_schema(api: ollama.Client, model: str):
    reply = api.chat(model=model, messages=HI, format="json", options={"temperature": 0, "num_predict": 200})
    assert isinstance(json.loads(reply.message.content), dict)
    reply = api.generate(model=model, prompt="Hi", format=PERSON, options={"seed": 2, "num_predict": 200})
    jsonschema.validate(json.loads(reply.response), PERSON)


def test_tools_and_a_tool_history_reach_the_template(api: ollama.Client, model: str):
    plain = api.chat(model=model, messages=HI, options=GREEDY)
    reply = api.chat(model=model, messages=HI, tools=[weather], options=GREEDY)
    assert reply.prompt_eval_count > plain.prompt_eval_count  # kvd's system message lists the tools
    call = {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    history = [
        *HI,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_name": "weather"},
    ]
    second = api.chat(model=model, messages=history, tools=[weather], options=GREEDY)
    assert second.prompt_eval_count > reply.prompt_eval_count  # the call and its result are in the prompt


def test_tool_calls_are_in_ollamas_shape():
    # The random model calls no tool through Ollama's API (it has no tool_choice to force one), so the reply's
    # shape is checked against the official client's own types.
    shape = ReplyShape("m", chat=True, want_logprobs=False, texts=None)
    final = Chunk(1, "", [5], finish_reason="tool_calls", usage=Usage(3, 1, 0))
    final.tool_calls = [ToolCall("call_1", "weather", '{"city": "Paris"}')]
    lines = [ollama.ChatResponse.model_validate(line) for line in shape.lines(final)]
    (call,) = [c for line in lines for c in line.message.tool_calls or []]
    assert (call.function.name, call.function.arguments) == ("weather", {"city": "Paris"})
    assert lines[-1].done and lines[-1].done_reason == "stop" and lines[-1].eval_count == 1
    choice = Choice(0)
    choice.add(final)
    whole = ollama.ChatResponse.model_validate(shape.whole(choice, final))
    assert whole.message.tool_calls[0].function.arguments == {"city": "Paris"}


def test_embed_and_the_older_embeddings(api: ollama.Client, kvd: Client, model: str):
    expected = kvd.embed(["Hello", "World"])
    got = api.embed(model=model, input=["Hello", "World"])
    assert len(got.embeddings) == 2 and got.prompt_eval_count == expected.prompt_tokens
    for vector, want in zip(got.embeddings, expected.embeddings, strict=True):
        assert vector == pytest.approx(want)
    short = api.embed(model=model, input="Hello", dimensions=4)
    assert short.embeddings[0] == pytest.approx(kvd.embed("Hello", dimensions=4).embeddings[0])
    older = api.embeddings(model=model, prompt="Hello")
    assert older.embedding == pytest.approx(expected.embeddings[0])


def test_listings(api: ollama.Client, kvd: Client, model: str):
    info = kvd.info()
    (listed,) = api.list().models
    assert listed.model == f"{model}:latest" and listed.details.family == "llama"
    shown = api.show(model)
    assert shown.modelinfo["llama.context_length"] == info["max_model_len"] and "tools" in shown.capabilities
    (running,) = api.ps().models
    assert running.model == listed.model and running.context_length == info["max_model_len"]


def test_version_is_an_ollama_release_beside_kvds_own(api: ollama.Client, kvd: Client):
    """Ollama's clients compare `version` with the release they need: it stays the API release followed."""
    body = httpx.get(f"{api._client.base_url}/api/version").json()
    assert Version(body["version"]) >= Version("0.12.0")
    assert body["kvd_version"] == kvd.info()["kvd_version"] == importlib.metadata.version("kvd")


@pytest.mark.parametrize(
    ("call", "status", "says"),
    [
        (
            lambda api, m: api.chat(model=m, messages=HI, options={"mirostat": 2, "tfs_z": 0.5}),
            400,
            "mirostat",
        ),
        (lambda api, m: api.chat(model=m, messages=HI, think=True), 400, "think"),
        (lambda api, m: api.generate(model=m, prompt="x", template="{{ .Prompt }}"), 400, "template"),
        (lambda api, m: api.generate(model=m, prompt="x", raw=True, system="s"), 400, "system"),
        (
            lambda api, m: api.chat(model=m, messages=HI, options={"temperature": 500}),
            400,
            "options.temperature",
        ),
        (lambda api, m: api.chat(model=m, messages=HI, format={"type": "objekt"}), 400, "format"),
        (lambda api, m: api.chat(model="llama3", messages=HI), 404, "not found"),
    ],
)
def test_refused_requests(api: ollama.Client, model: str, call, status: int, says: str):
    with pytest.raises(ollama.ResponseError) as e:
        call(api, model)
    assert e.value.status_code == status and says in e.value.error


def test_several_refused_options_are_named_at_once(api: ollama.Client, model: str):
    with pytest.raises(ollama.ResponseError) as e:
        api.chat(model=model, messages=HI, options={"mirostat": 2, "tfs_z": 0.5, "num_thread": 2})
    assert "options.mirostat" in e.value.error and "options.tfs_z" in e.value.error
    assert "num_thread" not in e.value.error  # a load-time setting: accepted

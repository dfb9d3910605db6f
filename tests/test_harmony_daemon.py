"""A tiny gpt-oss with harmony's markers as special tokens and a template in the harmony format, through a real
daemon and the openai SDK: its channels split into reasoning and answer (no marker in either), a forced call
parsed and streamed, and the same split as the raw tokens' text read by the parser."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from conftest import save_tiny_checkpoint
from daemon_fixtures import DaemonProcess
from gateway_fixtures import gateway_daemon, kvd_fixture, model_fixture, oai_fixture  # noqa: F401
from tiny_models import HARMONY_MARKERS, harmony_tokenizer
from tool_fixtures import SCHEMAS, TOOLS

from kvd.request.harmony import HARMONY_REASONING, HarmonyParser
from kvd_client import Client

ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module", name="daemon")
def daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("harmony_chat")
    tokenizer = harmony_tokenizer()
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    save_tiny_checkpoint(
        "gpt_oss", folder, tokenizer=tokenizer, max_position_embeddings=2048, eos_token_id=ends
    )
    with gateway_daemon(folder, tmp_path_factory.mktemp("harmony_gateway")) as proc:
        yield proc


def test_info_names_the_harmony_formats(kvd: Client):
    info = kvd.info()
    assert info["tools"] == {"format": "harmony", "template": "model"}
    assert info["reasoning"] == HARMONY_REASONING


@pytest.mark.parametrize("seed", range(4))
def test_a_chat_is_split_as_its_raw_text_reads_and_keeps_no_marker(kvd: Client, seed: int):
    # Markers (and "analysis" / "final") made likely, so that the random model writes messages of every kind.
    tokenizer = harmony_tokenizer()
    likely = [*HARMONY_MARKERS, "analysis", "final"]
    bias = {i: 4.0 for word in likely for i in tokenizer.encode(word, add_special_tokens=False)}
    fields = dict(temperature=1.0, seed=seed, max_tokens=40, logit_bias=bias, ignore_eos=True)
    chat = kvd.chat(ASK, **fields)
    for text in (chat.text, chat.reasoning):
        assert not any(marker in text for marker in HARMONY_MARKERS), text
    # The same tokens from the raw prompt, decoded with their markers and split by the parser.
    raw = kvd.generate(kvd.tokenize(messages=ASK), **fields)
    assert raw.token_ids == chat.token_ids
    parser = HarmonyParser(drop=tuple(t for t in tokenizer.all_special_tokens if t not in HARMONY_MARKERS))
    raw_text = tokenizer.decode(raw.token_ids, skip_special_tokens=False)
    assert sum(raw_text.count(marker) for marker in HARMONY_MARKERS) >= 3, raw_text
    reasoning, answer = parser.feed(raw_text)
    last, rest = parser.finish()
    assert (chat.reasoning, chat.text) == (reasoning + last, answer + rest)
    chunks = list(kvd.stream_chat(ASK, **fields))
    assert "".join(c.text for c in chunks) == chat.text
    assert "".join(c.reasoning or "" for c in chunks) == chat.reasoning


def _steer(first: str) -> dict[int, float]:
    """logit_bias that steers the random model into a message on channel `first` (the grammar lets it write an
    analysis before its call or answer), an analysis ending at once."""
    tokenizer = harmony_tokenizer()
    bias = {i: 8.0 for i in tokenizer.encode(first, add_special_tokens=False)}
    bias[tokenizer.convert_tokens_to_ids("<|end|>")] = 16.0
    return bias


@pytest.mark.parametrize("first", ["commentary", "analysis"])
def test_a_forced_call_comes_back_whole_and_streamed(oai: openai.OpenAI, model: str, first: str):
    bias = {str(i): b for i, b in _steer(first).items()}
    fields = dict(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        logit_bias=bias,
    )
    whole = oai.chat.completions.create(**fields).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    (call,) = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = ["", ""]
    for chunk in oai.chat.completions.create(**fields, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            streamed[0] += (delta.function and delta.function.name) or ""
            streamed[1] += (delta.function and delta.function.arguments) or ""
    assert streamed == [call.function.name, call.function.arguments]
    # The call and its result go back through the template.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    after = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4)
    assert after.usage.prompt_tokens > oai.chat.completions.create(**fields).usage.prompt_tokens


@pytest.mark.parametrize("first", ["final", "analysis"])
def test_json_schema_holds_for_the_final_message_after_any_analysis(kvd: Client, first: str):
    """The random model is steered (logit_bias) into its final message at once, or into an analysis first."""
    tokenizer = harmony_tokenizer()
    bias = _steer(first)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = kvd.chat(ASK, temperature=0, max_tokens=80, logit_bias=bias, json_schema=schema)
    raw = tokenizer.decode(reply.token_ids, skip_special_tokens=False)
    assert raw.startswith(f"<|channel|>{first}<|message|>"), raw
    assert isinstance(json.loads(reply.text)["ok"], bool), raw

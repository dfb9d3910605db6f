"""The wire protocol without a daemon: decoding limits, request validation, replies the client reads."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.server import protocol
from kvd.server.protocol import (
    BAD_REQUEST,
    TOO_LARGE,
    UNSUPPORTED_VERSION,
    AbortMessage,
    DetokenizeMessage,
    GenerateMessage,
    ProtocolError,
    TokenizeMessage,
)
from kvd_client import messages as client_messages
from kvd_client.errors import OverloadedError

LIMIT = 4096


def parse(msg: dict) -> protocol.Message:
    return protocol.parse_message(protocol.decode(msgpack.packb(msg), LIMIT))


def rejection(msg: object, limit: int = LIMIT) -> ProtocolError:
    data = msg if isinstance(msg, bytes) else msgpack.packb(msg)
    with pytest.raises(ProtocolError) as info:
        protocol.parse_message(protocol.decode(data, limit))
    return info.value


def generate(**fields: object) -> dict:
    return {"v": 1, "id": 7, "op": "generate", "prompt": "Hello", **fields}


def chat(**fields: object) -> dict:
    return {"v": 1, "id": 1, "op": "chat", "messages": [{"role": "user", "content": "Hi"}]} | fields


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_structured_fields_tools_and_embed_parse():
    message = parse(
        generate(json_schema={"type": "object"}, logit_bias={"7": -100, "9": 2.5}, prompt_logprobs=2)
    )
    assert message.params.structured == ("json_schema", {"type": "object"})
    assert message.params.logit_bias == {7: -100, 9: 2.5} and message.params.prompt_logprobs == 2
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    message = parse(chat(messages=history, tools=[TOOL], tool_choice="required", parallel_tool_calls=False))
    assert [t.name for t in message.tools] == ["f"]
    assert (message.tool_choice.mode, message.parallel_tool_calls) == ("required", False)
    assert parse(chat()).tools is None and parse(chat()).tool_choice.mode == "none"
    embed = parse({"v": 1, "id": 2, "op": "embed", "input": "one", "dimensions": 8})
    assert (embed.inputs, embed.dimensions) == (["one"], 8)
    assert parse({"v": 1, "id": 2, "op": "embed", "input": [3, 4]}).inputs == [[3, 4]]


def test_generate_request_carries_prompt_params_and_options():
    req = parse(
        generate(max_tokens=5, temperature=0.0, stop="\n", stream=True, cache_salt="tenant-a", seed=3)
    )
    assert isinstance(req, GenerateMessage)
    assert (req.id, req.op, req.prompt, req.prompt_token_ids, req.messages) == (
        7,
        "generate",
        "Hello",
        None,
        None,
    )
    assert req.stream and req.cache_salt == "tenant-a"
    assert (req.params.max_tokens, req.params.temperature, req.params.stop, req.params.seed) == (
        5,
        0.0,
        ["\n"],
        3,
    )


def test_defaults_follow_the_openai_completions_api_and_nil_means_absent():
    req = parse(generate(seed=None, logprobs=None, stream=None))
    assert (req.params.max_tokens, req.params.temperature, req.params.top_p) == (16, 1.0, 1.0)
    assert req.params.seed is None and req.params.logprobs is None and req.stream is False


def test_token_id_prompts_chat_and_string_ids():
    req = parse({"v": 1, "id": "job-1", "op": "generate", "prompt_token_ids": [1, 2, 3]})
    assert (req.id, req.prompt, req.prompt_token_ids) == ("job-1", None, [1, 2, 3])
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]
    chat = parse({"v": 1, "id": 1, "op": "chat", "messages": messages, "logprobs": 2})
    assert chat.messages == messages and chat.params.logprobs == 2


def test_other_ops_parse_to_their_requests():
    tok = parse({"v": 1, "id": 1, "op": "tokenize", "text": "hi"})
    assert isinstance(tok, TokenizeMessage) and tok.text == "hi" and tok.messages is None
    detok = parse({"v": 1, "id": 2, "op": "detokenize", "token_ids": []})
    assert isinstance(detok, DetokenizeMessage) and detok.token_ids == []
    abort = parse({"v": 1, "id": 3, "op": "abort", "target": "job-1"})
    assert isinstance(abort, AbortMessage) and abort.target == "job-1"
    for op in ("health", "info", "stats"):
        assert parse({"v": 1, "id": 4, "op": op}).op == op


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (generate(promt="typo"), "promt"),
        (generate(n=2), "n"),
        ({"v": 1, "id": 1, "op": "health", "text": "x"}, "text"),
        (generate(temperature=-1.0), "temperature"),
        (generate(temperature="hot"), "temperature"),
        (generate(max_tokens=0), "max_tokens"),
        (generate(max_tokens=2**64 - 1), "max_tokens"),
        (generate(top_p=float("nan")), "top_p"),
        (generate(seed=-1), "seed"),
        (generate(logprobs=21), "logprobs"),
        (generate(ignore_eos=1), "ignore_eos"),
        (generate(stream="yes"), "stream"),
        (generate(stop=["a"] * 17), "stop"),
        (generate(stop=[""]), "stop"),
        (generate(stop=[1]), "stop"),
        (generate(stop={"a": 1}), "stop"),
        (generate(stop_token_ids=[-1]), "stop_token_ids"),
        (generate(stop_token_ids=5), "stop_token_ids"),
        (generate(cache_salt=5), "cache_salt"),
        (generate(cache_salt="x" * 257), "cache_salt"),
        (generate(prompt=""), "prompt"),
        (generate(prompt=b"bytes"), "prompt"),
        (generate(prompt_token_ids=[1]), "prompt"),  # both prompt forms
        ({"v": 1, "id": 1, "op": "generate"}, "prompt"),  # neither
        ({"v": 1, "id": 1, "op": "generate", "prompt_token_ids": []}, "prompt_token_ids"),
        ({"v": 1, "id": 1, "op": "generate", "prompt_token_ids": [1, True]}, "prompt_token_ids"),
        ({"v": 1, "id": 1, "op": "generate", "prompt_token_ids": [2**31]}, "prompt_token_ids"),
        ({"v": 1, "id": 1, "op": "chat"}, "messages"),
        ({"v": 1, "id": 1, "op": "chat", "messages": []}, "messages"),
        ({"v": 1, "id": 1, "op": "chat", "messages": ["hi"]}, "messages[0]"),
        ({"v": 1, "id": 1, "op": "chat", "messages": [{"role": "user"}]}, "messages[0]"),
        (
            {"v": 1, "id": 1, "op": "chat", "messages": [{"role": "user", "content": "a", "x": 1}]},
            "messages[0].x",
        ),
        ({"v": "1", "id": 1, "op": "health"}, "v"),
        ({"v": 1, "id": 1, "op": "chat", "messages": [{"role": 1, "content": "a"}]}, "messages[0].role"),
        (generate(json_schema=5), "json_schema"),
        (generate(regex=""), "regex"),
        (generate(grammar=["start"]), "grammar"),
        (generate(json_object="yes"), "json_object"),
        (generate(regex="a", json_schema={"type": "object"}), "regex"),  # two structured fields
        (generate(logit_bias=[1, 2]), "logit_bias"),
        (generate(logit_bias={"abc": 1.0}), "logit_bias"),
        (generate(logit_bias={"-1": 1.0}), "logit_bias"),
        (generate(logit_bias={"\u0665": 1.0}), "logit_bias"),  # an Arabic-Indic five: int() would take it
        (generate(logit_bias={"05": 1.0}), "logit_bias"),  # the same token as "5"
        (generate(logit_bias={"5": 200}), "logit_bias"),
        (generate(logit_bias={"5": "x"}), "logit_bias"),
        (generate(prompt_logprobs=21), "prompt_logprobs"),
        (generate(tools=[]), "tools"),  # tools belong to chat
        (chat(tools="x"), "tools"),
        (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
            "tools[0].function.parameters",
        ),
        (chat(tool_choice="required"), "tool_choice"),  # without tools
        (
            chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
            "tool_choice.function.name",
        ),
        (chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
        (chat(tools=[TOOL], parallel_tool_calls="yes"), "parallel_tool_calls"),
        (chat(tools=[TOOL], tool_choice="required", json_object=True), "tool_choice"),
        (
            chat(
                messages=[
                    {"role": "user", "content": "a"},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"},
                ]
            ),
            "messages[1].tool_call_id",
        ),
        (chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
        (chat(messages=[{"role": "user", "content": "a", "tool_call_id": 5}]), "messages[0].tool_call_id"),
        ({"v": 1, "id": 1, "op": "embed"}, "input"),
        ({"v": 1, "id": 1, "op": "embed", "input": ["a", 5]}, "input[1]"),
        ({"v": 1, "id": 1, "op": "embed", "input": [[1, -1]]}, "input[0]"),
        ({"v": 1, "id": 1, "op": "embed", "input": "a", "dimensions": True}, "dimensions"),
        ({"v": 1, "id": 1, "op": "embed", "input": "a", "temperature": 0}, "temperature"),
        ({"v": 1, "id": 1, "op": "tokenize"}, "text"),
        ({"v": 1, "id": 1, "op": "detokenize", "token_ids": "abc"}, "token_ids"),
        ({"v": 1, "id": 1, "op": "abort"}, "target"),
        ({"v": 1, "id": 1, "op": "abort", "target": -5}, "target"),
        ({"v": 1, "id": 1, "op": "launch"}, "op"),
        ({"v": 1, "id": 1, "op": ["generate"]}, "op"),
        ({"v": 1, "id": 1}, "op"),
        ({"id": 1, "op": "health"}, "v"),
        ({"v": "1", "id": 1, "op": "health"}, "v"),
    ],
)
def test_invalid_requests_name_the_field_and_keep_the_id(msg: dict, field: str):
    error = rejection(msg)
    assert (error.code, error.field, error.request_id) == (BAD_REQUEST, field, msg.get("id"))
    assert error.message


@pytest.mark.parametrize("bad_id", [None, -1, 2**63, True, 1.5, "", "x" * 129, [1], {"a": 1}, b"raw"])
def test_an_unreadable_id_is_reported_with_a_nil_id(bad_id: object):
    msg = {"v": 1, "op": "health"} | ({} if bad_id is None else {"id": bad_id})
    error = rejection(msg)
    assert (error.code, error.field, error.request_id) == (BAD_REQUEST, "id", None)


def test_unsupported_version_is_its_own_code():
    error = rejection({"v": 2, "id": 9, "op": "health"})
    assert (error.code, error.field, error.request_id) == (UNSUPPORTED_VERSION, "v", 9)


def test_oversized_messages_get_too_large_with_their_id():
    big = msgpack.packb(generate(prompt="x" * LIMIT))
    error = rejection(big)
    assert (error.code, error.request_id) == (TOO_LARGE, 7)
    assert rejection(b"\xc1" * (LIMIT + 1)).code == TOO_LARGE  # and junk that large still gets an answer


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # an array announcing 2 items with 1
        msgpack.packb([1, 2, 3]),
        msgpack.packb("just a string"),
        msgpack.packb({1: "int key"}),
        msgpack.packb({"k": 1}) + b"\x00",  # trailing data
        msgpack.packb(msgpack.ExtType(5, b"ext")),
        msgpack.packb({"v": 1, "id": 1, "op": "health", "t": msgpack.Timestamp(0)}),
        b"\xa3\xff\xfe\xfd",  # a str that is not UTF-8
        b"\x91" * 3000 + b"\x00",  # nesting deeper than the unpacker's stack
        msgpack.packb({f"k{i}": i for i in range(protocol.MAX_MAP_LEN + 1)}),
    ],
)
def test_malformed_frames_are_bad_requests(frame: bytes):
    error = rejection(frame)
    assert error.code == BAD_REQUEST and error.request_id is None


# Any msgpack value: the decoder and validator either accept it or raise ProtocolError, never anything else.
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
_field_names = st.sampled_from(
    ["v", "id", "op", "prompt", "prompt_token_ids", "messages", "max_tokens", "temperature", "stop", "target"]
)
_ops = st.sampled_from([*protocol.OP_FIELDS, "nope"])
_requestish = st.fixed_dictionaries({"v": st.just(1), "id": st.integers(0, 10), "op": _ops}).flatmap(
    lambda base: st.dictionaries(_field_names, _values, max_size=5).map(lambda extra: base | extra)
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(_values, _requestish))
def test_any_value_is_accepted_or_rejected_cleanly(value: object):
    try:
        parse(value) if isinstance(value, dict) else protocol.decode(msgpack.packb(value), LIMIT)
    except ProtocolError as e:
        assert e.code in protocol.ERROR_CODES and e.message


def test_replies_are_what_the_client_library_reads():
    lp = [type("Tok", (), {"token_id": 5, "logprob": -0.5, "top_logprobs": [(5, -0.5), (6, -1.5)]})()]
    logprobs = protocol.logprobs_payload(lp)
    usage = protocol.usage(3, 1, 0)

    def roundtrip(reply: dict) -> dict:
        return client_messages.unpack_reply(protocol.encode(reply))

    chunk = client_messages.to_chunk(roundtrip(protocol.chunk_reply(4, "Hi", [5], logprobs)))
    assert (chunk.id, chunk.text, chunk.token_ids, chunk.finished) == (4, "Hi", [5], False)
    assert chunk.logprobs[0].top_logprobs == [(5, -0.5), (6, -1.5)]
    final = client_messages.to_completion(
        roundtrip(protocol.final_reply(4, "Hi!", [5, 6], None, "length", usage))
    )
    assert (final.text, final.finish_reason, final.usage.prompt_tokens, final.logprobs) == (
        "Hi!",
        "length",
        3,
        None,
    )
    last = client_messages.to_chunk(roundtrip(protocol.final_reply(4, "", [], [], "stop", usage)))
    assert last.finished and last.usage.completion_tokens == 1 and last.logprobs == []
    assert client_messages.to_result(roundtrip(protocol.result_reply(1, {"status": "ready"}))) == {
        "status": "ready"
    }
    with pytest.raises(OverloadedError) as info:
        client_messages.to_result(roundtrip(protocol.error_reply(2, protocol.OVERLOADED, "busy")))
    assert (info.value.code, info.value.field, info.value.request_id) == ("overloaded", None, 2)
    assert roundtrip(protocol.heartbeat_reply()) == {"id": None, "type": "heartbeat"}


def test_a_lenient_reading_keeps_only_an_id_a_call_could_have_sent():
    def refused(frame: bytes) -> protocol.ProtocolError:
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.decode(frame, LIMIT)
        return info.value

    frame = msgpack.packb({"v": 1, "id": "IDID", "op": "generate", "prompt": "Hi", "logit_bias": {3: 1.0}})
    error = refused(frame)
    assert (error.request_id, error.field) == ("IDID", "logit_bias")
    # The same with an id that is no UTF-8: no call sent it, so the reply names none.
    error = refused(frame.replace(b"IDID", b"\xff\xfe\xfd\xfc"))
    assert (error.request_id, error.field) == (None, "id")

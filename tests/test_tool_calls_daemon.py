"""Tool calls through a real daemon: forced calls always parse and validate, their text never streams as content,
earlier calls and results render, and a model whose own template knows tools (Qwen2.5's) gets them natively."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from chat_templates import QWEN2_5
from daemon_fixtures import DaemonProcess, start_daemon
from tool_fixtures import SCHEMAS, TOOLS

from kvd_client import BadRequestError

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def qwen_daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with Qwen2.5's tool-aware chat template in place of SmolLM2's."""
    folder = tmp_path_factory.mktemp("qwen_template")
    for item in tiny_daemon_model.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN2_5
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    daemon = start_daemon(tmp_path_factory.mktemp("qwen_daemon"), model=folder)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def _assert_valid(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("which", ["kvd prompt (SmolLM2 template)", "native (Qwen2.5 template)"])
def test_required_and_named_calls_always_parse(tiny_daemon: DaemonProcess, qwen_daemon: DaemonProcess, which):
    daemon = qwen_daemon if "Qwen" in which else tiny_daemon
    with daemon.client() as client:
        assert client.info()["tools"] == {
            "format": "hermes",
            "template": "model" if "Qwen" in which else "kvd",
        }
        for seed in range(3):
            reply = client.chat(
                ASK,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                seed=seed,
                max_tokens=200,
            )
            assert reply.finish_reason == "tool_calls" and reply.text == ""
            assert len(reply.tool_calls) == 1
            _assert_valid(reply.tool_calls, {"get_weather", "get_time"})
        # Parallel calls: one or more, each valid (a cut after the first complete call still returns it).
        reply = client.chat(ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=9, max_tokens=300)
        assert reply.finish_reason == "tool_calls"
        _assert_valid(reply.tool_calls, {"get_weather", "get_time"})
        named = {"type": "function", "function": {"name": "get_time"}}
        reply = client.chat(ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, **GREEDY)
        assert len(reply.tool_calls) == 1
        _assert_valid(reply.tool_calls, {"get_time"})


def test_streamed_calls_come_whole_in_the_final_reply(tiny_daemon: DaemonProcess):
    with tiny_daemon.client() as client:
        whole = client.chat(ASK, tools=TOOLS, tool_choice="required", **GREEDY)
        chunks = list(client.stream_chat(ASK, tools=TOOLS, tool_choice="required", **GREEDY))
    assert "".join(c.text for c in chunks) == ""  # the call's markup is never content
    final = chunks[-1]
    assert final.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in final.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    assert sum(len(c.token_ids) for c in chunks) == whole.usage.completion_tokens


def test_a_call_cut_by_max_tokens_ends_with_length_and_no_markup(tiny_daemon: DaemonProcess):
    single = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    with tiny_daemon.client() as client:
        whole = client.chat(ASK, max_tokens=200, **single)
        assert whole.finish_reason == "tool_calls" and len(whole.tool_calls) == 1
        half = whole.usage.completion_tokens // 2
        cut = client.chat(ASK, max_tokens=half, **single)
        chunks = list(client.stream_chat(ASK, max_tokens=half, **single))
    assert (cut.finish_reason, cut.text, cut.tool_calls) == ("length", "", [])
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == "length"
    assert chunks[-1].tool_calls == [] and sum(len(c.token_ids) for c in chunks) == half


def test_the_in_process_chat_calls_tools_as_the_daemon_does(
    tiny_daemon: DaemonProcess, tiny_daemon_model: Path
):
    import torch

    from kvd import LLM, SamplingParams

    threads = torch.get_num_threads()
    llm = LLM(
        str(tiny_daemon_model), dtype="float32", kv_cache_memory=64 << 20, num_threads=1
    )  # as the daemon
    try:
        named = {"type": "function", "function": {"name": "get_time"}}
        with tiny_daemon.client() as client:
            for choice, max_tokens in [("required", 200), (named, 200), ("required", 8), ("auto", 24)]:
                served = client.chat(
                    ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=max_tokens
                )
                params = SamplingParams(temperature=0, max_tokens=max_tokens)
                (local,) = llm.chat(ASK, params, use_tqdm=False, tools=TOOLS, tool_choice=choice)
                assert (local.text, local.finish_reason) == (served.text, served.finish_reason), choice
                assert [(c.name, c.arguments) for c in local.tool_calls] == [
                    (c.name, c.arguments) for c in served.tool_calls
                ]
                assert bool(local.tool_calls) == (max_tokens == 200), choice  # whole calls, or a cut one
            assert served.tool_calls == [] and local.tool_calls == []  # auto: the tiny model writes text
        with pytest.raises(ValueError, match="tool_choice"):
            llm.chat(ASK, tools=TOOLS, tool_choice="any")
    finally:
        torch.set_num_threads(threads)


def test_a_two_turn_tool_conversation(tiny_daemon: DaemonProcess, qwen_daemon: DaemonProcess):
    for daemon in (tiny_daemon, qwen_daemon):
        with daemon.client() as client:
            call = client.chat(ASK, tools=TOOLS, tool_choice="required", **GREEDY).tool_calls[0]
            history = [
                *ASK,
                {"role": "assistant", "content": None, "tool_calls": [call.to_message()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
            ]
            prompt = client.tokenize(messages=history)
            rendered = client.detokenize(prompt)
            assert call.name in rendered and '{"temp": 21}' in rendered
            reply = client.chat(history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
            assert reply.finish_reason in ("stop", "length") and not reply.tool_calls


def test_auto_leaves_text_without_calls_as_content(tiny_daemon: DaemonProcess):
    with tiny_daemon.client() as client:
        for seed in range(3):
            auto = client.chat(ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=16)
            # Nothing the random model writes is a call, so all of it, held back or not, comes out as content.
            assert not auto.tool_calls and auto.finish_reason in ("stop", "length")
            assert auto.text == client.detokenize(auto.token_ids).removesuffix("<|im_end|>")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(tiny_daemon: DaemonProcess, fields, field):
    with tiny_daemon.client() as client:
        messages = fields.pop("messages", ASK)
        with pytest.raises(BadRequestError) as e:
            client.chat(messages, **fields)
        assert e.value.field == field
        assert client.chat(ASK, max_tokens=2).finish_reason == "length"  # still serving


def test_the_developer_role_reaches_a_template_without_one_as_system(tiny_daemon: DaemonProcess):
    with tiny_daemon.client() as client:
        developer = client.tokenize(messages=[{"role": "developer", "content": "Be brief."}, *ASK])
        system = client.tokenize(messages=[{"role": "system", "content": "Be brief."}, *ASK])
        rendered = client.detokenize(developer)
    assert developer == system
    # SmolLM2's template adds its own system prompt only when the conversation has none.
    assert "Be brief." in rendered and "SmolLM" not in rendered

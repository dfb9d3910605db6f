"""Gemma 3 270M (Q4_K_M GGUF): our loader against transformers' GGUF loading of the same file, greedy tokens with a
prompt longer than its 512-token window, and its chat through `make demo`'s path."""

from __future__ import annotations

import pytest
import torch
from daemon_fixtures import run_demo
from greedy_helper import assert_params_equal_hf, greedy_generate, load_with_private_cache, transformers_gguf

from benchmarks.real_models import GEMMA3_270M, model_path

GGUF = model_path(GEMMA3_270M)
TEXTS = ["Hello, world!", "  spaces\tand tabs\n\nnewlines ", "Ünïcödé — 🦙 中文", "<start_of_turn>user\nhi"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF path (it dequantizes every tensor: ~30 s), loaded once for the module."""
    return transformers_gguf(GGUF)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return load_with_private_cache(str(GGUF), tmp_path_factory)


def test_weights_equal_transformers(ours, reference):
    """Every weight bit for bit; the norms hold 1 + weight as the file does, where transformers subtracts the 1
    and adds it back in its forward (which can move the last bit)."""
    assert_params_equal_hf(ours, reference[0].state_dict(), norms_within_an_ulp=True)


def test_config_agrees_with_transformers(ours, reference):
    hf, c = reference[0].config, ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.head_dim, c.num_key_value_heads) == (18, 640, 256, 1)
    assert c.layer_types == tuple(hf.layer_types) and c.attention_window == hf.sliding_window == 512
    assert c.attention_scale == hf.query_pre_attn_scalar**-0.5
    assert c.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert c.sliding_rope_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert c.hidden_act == hf.hidden_activation and c.final_logit_softcapping == hf.final_logit_softcapping
    end_of_turn = ours.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert c.eos_token_ids == (hf.eos_token_id, end_of_turn)


def test_tokenizer_ids_equal_transformers_and_turns_are_gemmas(ours, reference):
    theirs = reference[1]
    for text in TEXTS:
        assert ours.tokenizer(text)["input_ids"] == theirs(text)["input_ids"], text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi! "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = ours.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize("length", [40, 700])  # inside the 512-token window; past it, so that it slides
def test_greedy_continuation_equals_transformers(ours, reference, length):
    prompt = [2, *torch.randint(300, 200000, (length - 1,), generator=torch.Generator().manual_seed(length))]
    prompt = [int(t) for t in prompt]
    with torch.inference_mode():
        out = reference[0].generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    got = greedy_generate(ours.model, prompt, NEW_TOKENS, stop_ids=ours.config.eos_token_ids)
    assert got == expected, (ours.tokenizer.decode(got), ours.tokenizer.decode(expected))


def test_chat_through_the_demo_path():
    """`python -m kvd.demo --model <file>`: the daemon serves the file in its own types and answers both turns."""
    out, replies, cached = run_demo("--model", str(GGUF))
    assert "Connected: gemma-3-270m-it-Q4_K_M (gguf weights" in out
    assert len(replies) == 2 and all(r.strip() for r in replies)
    assert cached[0] == 0 and cached[1] > 0


def test_tools_are_called_in_gemmas_pythonic_format():
    """Gemma 3's template knows no tools: kvd's prompt asks for [name(key=value)] calls, as Google's guide has
    them; forced calls (the grammar writes that format) parse into calls that validate."""
    import json

    import jsonschema
    from tool_fixtures import SCHEMAS, TOOLS

    from kvd import LLM, SamplingParams

    llm = LLM(str(GGUF), kv_cache_memory=64 << 20)
    assert llm.engine.info()["tools"] == {"format": "pythonic", "template": "kvd"}
    ask = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]
    greedy = SamplingParams(temperature=0, max_tokens=60)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in [("required", {"get_weather", "get_time"}), (named, {"get_time"})]:
        (out,) = llm.chat(ask, greedy, use_tqdm=False, tools=TOOLS, tool_choice=choice)
        assert out.finish_reason == "tool_calls" and out.text == "", out.text
        for call in out.tool_calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])

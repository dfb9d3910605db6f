"""SmolLM2-135M-Instruct (Q4_1 GGUF): our loader against transformers' GGUF loading of the same file."""

from __future__ import annotations

import pytest
import torch
from greedy_helper import assert_params_equal_hf, greedy_generate, load_with_private_cache, transformers_gguf

from kvd.model.hub import default_model_path

GGUF = default_model_path()
TEXTS = [
    "Hello, world!",
    "  leading spaces\tand tabs\n\nand newlines ",
    "Ünïcödé — emoji 🦙 and 中文字符",
    "def f(x):\n    return x ** 2  # 12345678",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Explain gravity in one sentence."},
    ],
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF path, loaded once for the module (it takes ~15-30 s)."""
    return transformers_gguf(GGUF)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return load_with_private_cache(None, tmp_path_factory)


def test_weights_bit_identical_to_transformers(ours, reference):
    assert ours.dtype == torch.float32 and ours.name == "SmolLM2-135M-Instruct.Q4_1"
    assert_params_equal_hf(ours, reference[0].state_dict())


def test_config_agrees_with_transformers(ours, reference):
    hf = reference[0].config
    c = ours.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.head_dim) == (49152, 576, 30, 64)
    assert (c.num_attention_heads, c.num_key_value_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
    assert c.rope_theta == hf.rope_parameters["rope_theta"] and c.rope_scaling is None
    assert (c.rms_norm_eps, c.max_position_embeddings) == (hf.rms_norm_eps, hf.max_position_embeddings)
    assert c.tie_word_embeddings and hf.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))


def test_tokenizer_ids_equal_transformers(ours, reference):
    theirs = reference[1]
    tokenizer = ours.tokenizer
    assert tokenizer.chat_template == theirs.chat_template
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
    )
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert tokenizer.decode(ids) == theirs.decode(ids)
    for messages in CONVERSATIONS:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert ids == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_greedy_continuation_equals_transformers(ours, reference, conversation):
    hf_model, hf_tokenizer = reference
    prompt = hf_tokenizer.apply_chat_template(CONVERSATIONS[conversation], add_generation_prompt=True)[
        "input_ids"
    ]
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=hf_tokenizer.pad_token_id,
        )
    expected = out[0, len(prompt) :].tolist()

    got = greedy_generate(ours.model, prompt, NEW_TOKENS, stop_ids=ours.config.eos_token_ids)

    assert len(got) >= 8  # a real continuation, not an immediate stop
    assert got == expected, (ours.tokenizer.decode(got), hf_tokenizer.decode(expected))

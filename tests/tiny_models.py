"""Tiny random-weight models with a real (tiny) tokenizer, saved as Hugging Face folders for offline tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: naïve café, 日本語のテキスト, emoji 🦊🐶 and ### markers.",
    "def f(x):\n    return x * 2  # doubled",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Byte-level BPE with a tiny vocabulary, so multi-byte characters split across several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", chat_template=CHAT_TEMPLATE)


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with GQA and a byte-level tokenizer, in float32, saved to `path`."""
    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# A reasoning template as Qwen3.5's: the answer starts inside an open <think> section, which enable_thinking false
# closes empty in the prompt.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def reasoning_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with <think> and </think> as tokens of their own, and a template that reasons."""
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = REASONING_TEMPLATE
    return tokenizer


def save_tiny_reasoning_llama(path: Path) -> Path:
    """The tiny Llama with the reasoning tokenizer."""
    save_tiny_llama(path)
    reasoning_tokenizer().save_pretrained(path)
    return path


# Gemma 4's markers: turns, the thought channel, tool declarations, calls, results and string quotes, each a token
# of its own that decodes to its text (as in Gemma 4's tokenizer, where they are not special).
GEMMA4_MARKERS = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>"]
GEMMA4_MARKERS += ["<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']


def gemma4_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with Gemma 4's markers and a template in Gemma 4's format (tests/chat_templates)."""
    from chat_templates import GEMMA4

    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(GEMMA4_MARKERS)
    tokenizer.chat_template = GEMMA4
    return tokenizer


HARMONY_MARKERS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
]


def harmony_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with harmony's markers as special tokens (as gpt-oss's are), <|return|> its
    end of sequence, and a template in the harmony format (tests/chat_templates)."""
    from chat_templates import HARMONY

    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    tokenizer.eos_token = "<|return|>"
    tokenizer.chat_template = HARMONY
    return tokenizer

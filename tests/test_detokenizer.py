"""Incremental detokenization: no half characters, streamed pieces add up to the whole, stop strings cut."""

import random

import pytest
from tiny_models import CORPUS, byte_level_tokenizer

from kvd.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def _stream(tokenizer, prompt_ids, output_ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, list(stop))
    pieces = []
    for i, token in enumerate(output_ids):
        detok.add_tokens([token])
        last = i == len(output_ids) - 1 or detok.stopped
        if last:
            detok.finish()
        pieces.append(detok.take_delta(finished=last))
        if detok.stopped:
            break
    return pieces, detok


@pytest.mark.parametrize("text", CORPUS)
def test_streamed_pieces_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    prompt, output = ids[:3], ids[3:]
    pieces, _ = _stream(tokenizer, prompt, output)
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer("🦊")["input_ids"]
    assert len(ids) > 1, "the test needs an emoji that spans several tokens"
    pieces, _ = _stream(tokenizer, [], ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🦊"


def test_random_token_streams_match_full_decode(tokenizer):
    # Random ids make invalid UTF-8 too: whatever the bytes, the stream must add up to the whole decode.
    rng = random.Random(0)
    prompt = tokenizer("The quick")["input_ids"]
    for _ in range(200):
        output = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        pieces, _ = _stream(tokenizer, prompt, output)
        assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True)


def test_stop_string_split_across_tokens_is_cut_and_never_streamed(tokenizer):
    text = "emoji 🦊🐶 and ### markers."
    ids = tokenizer(text)["input_ids"]
    pieces, detok = _stream(tokenizer, [], ids, stop=["###"])
    assert detok.stopped
    assert "".join(pieces) == "emoji 🦊🐶 and "
    assert all("#" not in p for p in pieces)


def test_held_back_prefix_of_a_stop_string_is_released_when_it_does_not_complete(tokenizer):
    ids = tokenizer("a ## b")["input_ids"]
    pieces, detok = _stream(tokenizer, [], ids, stop=["###"])
    assert not detok.stopped
    assert "".join(pieces) == "a ## b"


@pytest.mark.parametrize("stop", [["in", "pa"], ["pa", "in"]])
def test_several_stop_strings_cut_at_the_earliest_match_in_the_text(tokenizer, stop):
    # One call with every token: both stop strings arrive in the same new text (as with a word-sized token).
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Hello there")["input_ids"], stop)
    detok.add_tokens(tokenizer(" The painting was lovely")["input_ids"])
    assert detok.stopped
    assert detok.take_delta(finished=True) == " The "

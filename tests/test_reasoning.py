"""Reasoning models: the thinking section split from the answer as it streams, a grammar held for the answer
after the section, a token budget that ends the section, all the same bits alone and batched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import byte_level_tokenizer, reasoning_tokenizer, save_tiny_llama, save_tiny_reasoning_llama

import kvd
from kvd.engine.grammar import GrammarCompiler, apply_masks
from kvd.engine.reasoning_gate import ReasoningGate, gate
from kvd.request.reasoning import (
    Phase,
    ReasoningError,
    ReasoningFormat,
    ReasoningParser,
    ReasoningRequest,
    check_reasoning,
    detect_reasoning,
    parse_reasoning,
)
from kvd.request.sampling_params import SamplingParams

WHITESPACE = 199  # "\n" in the tiny tokenizer
FMT = ReasoningFormat("<think>", "</think>", 300, 301, frozenset({WHITESPACE}))
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _split(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, answer = [], []
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = parser.finish()
    return "".join(reasoning) + r, "".join(answer) + a


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nweigh it\n</think>\n\nYes.", False, ("weigh it", "Yes.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Plain answer <think> kept", False, ("", "Plain answer <think> kept")),
        ("\n\nHello", False, ("", "\n\nHello")),
        ("step one\n</think>\n\n{}", True, ("step one", "{}")),
        ("cut off mid thought  ", True, ("cut off mid thought", "")),
        ("</think>answer", True, ("", "answer")),
        ("a </thin b </think> c", True, ("a </thin b", "c")),
        ("<thi", False, ("", "<thi")),  # the beginning of a marker that never came is the answer
        ("<", False, ("", "<")),
    ],
)
def test_the_parser_splits_at_every_cut_as_it_does_whole(text: str, opened: bool, expected: tuple[str, str]):
    assert _split(ReasoningParser(FMT, opened), [text]) == expected
    for cut in range(len(text) + 1):
        assert _split(ReasoningParser(FMT, opened), [text[:cut], text[cut:]]) == expected, cut
    assert _split(ReasoningParser(FMT, opened), list(text)) == expected


CHANNEL = ReasoningFormat("<|channel>", "<channel|>", 300, 301, frozenset({WHITESPACE}), label="thought")


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<|channel>thought\nweigh it\n<channel|>Yes.", False, ("weigh it", "Yes.")),
        ("<|channel>thought\n<channel|>\nYes.", False, ("", "Yes.")),  # an empty channel
        ("<|channel>thoughtful words<channel|>x", False, ("ful words", "x")),  # the label only is dropped
        ("<|channel>musing<channel|>x", False, ("musing", "x")),  # no label
        ("<|channel>thou", False, ("", "")),  # cut inside the label
        ("Plain <|channel> kept", False, ("", "Plain <|channel> kept")),
        ("thought\nstep<channel|>done", True, ("step", "done")),
    ],
)
def test_gemma4s_thought_channel_splits_at_every_cut(text: str, opened: bool, expected: tuple[str, str]):
    for cut in range(len(text) + 1):
        assert _split(ReasoningParser(CHANNEL, opened), [text[:cut], text[cut:]]) == expected, cut
    assert _split(ReasoningParser(CHANNEL, opened), list(text)) == expected


def test_gemma4s_channel_is_detected_where_its_markers_are_plain_tokens():
    from chat_templates import GEMMA4

    tokenizer = byte_level_tokenizer()
    assert detect_reasoning(tokenizer, GEMMA4) is None  # markers in pieces
    tokenizer.add_tokens(["<|channel>", "<channel|>"])
    fmt = detect_reasoning(tokenizer, GEMMA4)
    assert fmt is not None and (fmt.start, fmt.end, fmt.label) == ("<|channel>", "<channel|>", "thought")
    assert fmt.info() == {"start": "<|channel>thought", "end": "<channel|>"}
    # Thinking off: the generation prompt closes an empty channel, which leaves no section open.
    off, on = (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            add_generation_prompt=True,
            chat_template=GEMMA4,
            tokenize=False,
            enable_thinking=think,
        )
        for think in (False, True)
    )
    assert off.endswith("<|channel>thought\n<channel|>") and on.endswith("<|turn>model\n")
    assert not fmt.opened_by(tokenizer.encode(off, add_special_tokens=False))


def test_a_format_needs_both_markers_as_plain_tokens_and_a_template_that_closes_them():
    tokenizer = reasoning_tokenizer()
    fmt = detect_reasoning(tokenizer, tokenizer.chat_template)
    assert fmt is not None and (fmt.start, fmt.end) == ("<think>", "</think>")
    assert tokenizer.decode([fmt.start_id, fmt.end_id]) == "<think></think>"
    assert detect_reasoning(tokenizer, "{{ messages }}") is None  # the template never thinks
    assert (
        detect_reasoning(byte_level_tokenizer(), tokenizer.chat_template) is None
    )  # markers split in pieces
    special = byte_level_tokenizer()
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert detect_reasoning(special, tokenizer.chat_template) is None  # left out of the decoded text


def test_a_prompt_opens_a_section_only_where_the_generation_prompt_ends_with_one():
    assert FMT.opened_by([5, 300]) and FMT.opened_by([5, 300, WHITESPACE, WHITESPACE])
    assert not FMT.opened_by([5, 300, 7])  # a marker a client wrote inside a message
    assert not FMT.opened_by([5, 300, WHITESPACE, 301, WHITESPACE])
    assert not FMT.opened_by([5, 6]) and not FMT.opened_by([])


def test_the_token_count_agrees_with_the_text_on_leading_whitespace():
    parser = ReasoningParser(FMT, False)
    parser.count([WHITESPACE, 300, 5, 6, 301, 7])
    assert parser.num_tokens == 4  # the markers and what lies between them
    answer_only = ReasoningParser(FMT, False)
    answer_only.count([WHITESPACE, 7, 300, 5])
    assert answer_only.num_tokens == 0  # a marker inside the answer opens nothing


def test_reasoning_fields_are_checked_and_need_a_section():
    assert parse_reasoning(True, "low", 5) == ReasoningRequest(True, "low", 5)
    for args, field in [(("yes", None, None), "think"), ((None, "max", None), "reasoning_effort")]:
        with pytest.raises(ReasoningError) as e:
            parse_reasoning(*args)
        assert e.value.field == field
    with pytest.raises(ReasoningError) as e:
        parse_reasoning(None, None, -1)
    assert e.value.field == "reasoning_budget"
    check_reasoning(ReasoningRequest(think=False), None, False)  # turning off what is not there is fine
    check_reasoning(ReasoningRequest(effort="low"), None, True)  # gpt-oss's template reads an effort
    for request, field in [
        (ReasoningRequest(budget=3), "reasoning_budget"),
        (ReasoningRequest(think=True), "think"),
        (ReasoningRequest(effort="low"), "reasoning_effort"),
    ]:
        with pytest.raises(ReasoningError) as e:
            check_reasoning(request, None, False)
        assert e.value.field == field
    assert ReasoningRequest(think=False, budget=9).token_budget == 0
    assert ReasoningRequest(think=True, effort="high").template_kwargs() == {
        "enable_thinking": True,
        "reasoning_effort": "high",
    }


@pytest.fixture(scope="module")
def grammars() -> tuple[GrammarCompiler, ReasoningFormat]:
    tokenizer = reasoning_tokenizer()
    fmt = detect_reasoning(tokenizer, tokenizer.chat_template)
    return GrammarCompiler(tokenizer, 320, {tokenizer.eos_token_id}), fmt


def _allowed(constraint) -> set[int]:
    logits = torch.zeros(1, 320)
    apply_masks(logits, [0], [constraint])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_the_gate_holds_the_grammar_until_the_section_ends(grammars):
    compiler, fmt = grammars
    params = SamplingParams(json_schema=OK_SCHEMA)
    plain = _allowed(compiler.matcher(params))
    before = ReasoningGate(fmt, False, None, compiler.matcher(params))
    assert _allowed(before) == plain | {fmt.start_id}  # the answer's grammar, or a section
    assert _allowed(ReasoningGate(fmt, False, 0, compiler.matcher(params))) == plain - {fmt.start_id}
    thinking = ReasoningGate(fmt, True, 2, compiler.matcher(params))
    assert len(_allowed(thinking)) == 320  # anything while thinking
    for token in (40, 41):
        assert thinking.consume_token(token) and thinking.phase is Phase.THINKING
    assert _allowed(thinking) == {fmt.end_id}  # the budget is spent
    thinking.consume_token(fmt.end_id)
    assert thinking.phase is Phase.ANSWER and _allowed(thinking) == plain
    assert not thinking.is_stopped()
    eos = compiler._eos[0]
    pending = ReasoningGate(fmt, True, None, compiler.matcher(params), [eos])
    assert _allowed(pending) == set(range(320)) - {eos}  # the answer must come
    assert len(_allowed(ReasoningGate(fmt, True, None, None, [eos]))) == 320  # nothing waits: it may end
    assert gate(fmt, [1, 2], None, None) is None  # nothing to hold: no gate
    assert gate(None, [1, 2], 5, None) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([300, 301, 91, 2, 79, 75, 26, 65, 93, 40, WHITESPACE]), max_size=12),
    st.sampled_from([None, 0, 1, 3]),
    st.booleans(),
)
def test_a_drafts_valid_part_is_what_step_by_step_masks_allow(
    grammars, tokens: list[int], budget, opened: bool
):
    compiler, fmt = grammars
    checked = ReasoningGate(fmt, opened, budget, compiler.matcher(SamplingParams(json_schema=OK_SCHEMA)))
    stepped = ReasoningGate(fmt, opened, budget, compiler.matcher(SamplingParams(json_schema=OK_SCHEMA)))
    valid = 0
    for token in tokens:
        if token not in _allowed(stepped):
            break
        assert stepped.consume_token(token)
        valid += 1
    assert checked.validate_tokens(tokens) == valid
    assert checked.phase is (Phase.THINKING if opened else Phase.BEFORE)  # validating changes nothing


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> kvd.LLM:
    return kvd.LLM(str(save_tiny_reasoning_llama(tmp_path_factory.mktemp("reasoning"))), max_model_len=512)


HELLO = [{"role": "user", "content": "hello there"}]


def _params(llm: kvd.LLM, **fields) -> SamplingParams:
    # The end token kept out of the answer, so the grammar alone ends it.
    eos = llm.engine.tokenizer.eos_token_id
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, "logit_bias": {eos: -100}, **fields})


def test_json_after_a_budgeted_section(llm: kvd.LLM):
    fmt = llm.engine.reasoning
    assert llm.engine.info()["reasoning"] == {"start": "<think>", "end": "</think>"}
    for budget in (0, 3, 6):
        out = llm.chat(HELLO, _params(llm, json_schema=OK_SCHEMA), use_tqdm=False, reasoning_budget=budget)[0]
        assert out.token_ids[budget] == fmt.end_id and fmt.end_id not in out.token_ids[:budget]
        assert isinstance(json.loads(out.text)["ok"], bool)
        assert out.reasoning == llm.engine.decode(out.token_ids[:budget]).strip()
        assert out.finish_reason == "stop"


def test_think_false_renders_the_closed_section_and_answers_at_once(llm: kvd.LLM):
    on = llm.engine.apply_chat_template(HELLO, None, ReasoningRequest())
    off = llm.engine.apply_chat_template(HELLO, None, ReasoningRequest(think=False))
    assert llm.engine.decode(on).endswith("<|assistant|><think>\n")  # the template's default opens it
    assert llm.engine.decode(off).endswith("<|assistant|><think>\n\n</think>\n\n")
    out = llm.chat(HELLO, _params(llm, json_schema=OK_SCHEMA), use_tqdm=False, think=False)[0]
    assert out.reasoning == "" and llm.engine.reasoning.end_id not in out.token_ids
    assert isinstance(json.loads(out.text)["ok"], bool)


def test_an_unclosed_section_is_all_reasoning(llm: kvd.LLM):
    eos, end = llm.engine.tokenizer.eos_token_id, llm.engine.reasoning.end_id
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: -100, end: -100})
    out = llm.chat(HELLO, params, use_tqdm=False)[0]
    assert out.text == "" and out.finish_reason == "length"
    assert out.reasoning == llm.engine.decode(out.token_ids).strip() != ""


def test_gated_requests_give_the_same_bits_alone_and_batched(llm: kvd.LLM):
    conversations = [[{"role": "user", "content": f"question {i} " * (1 + i)}] for i in range(4)]
    budgets = [2, 5, 0, 4]
    params = [
        _params(llm, json_schema=OK_SCHEMA),
        _params(llm, temperature=0.8, seed=11, json_schema=OK_SCHEMA),
        _params(llm, regex="[a-z]{3,6}"),
        _params(llm, temperature=0.9, seed=5, max_tokens=9),
    ]
    alone = []
    for conversation, p, budget in zip(conversations, params, budgets, strict=True):
        out = llm.chat(conversation, p, use_tqdm=False, reasoning_budget=budget)[0]
        alone.append((out.token_ids, out.reasoning, out.text))
    engine = llm.engine
    constraints, ids = [], []
    for conversation, p, budget in zip(conversations, params, budgets, strict=True):
        prompt = engine.apply_chat_template(conversation, None, ReasoningRequest())
        constraints.append(
            engine.chat_constraint(engine.compile_grammar(p), prompt, ReasoningRequest(budget=budget))
        )
        ids.append(prompt)
    batched = llm._complete(ids, params, False, constraints)
    for (tokens, _, _), out in zip(alone, batched, strict=True):
        assert out.token_ids == tokens


def test_a_model_without_a_section_refuses_reasoning(tmp_path: Path):
    llm = kvd.LLM(str(save_tiny_llama(tmp_path / "plain")), max_model_len=256)
    assert llm.engine.reasoning is None and llm.engine.info()["reasoning"] is None
    with pytest.raises(ReasoningError) as e:
        llm.chat(HELLO, SamplingParams(max_tokens=2), use_tqdm=False, think=True)
    assert e.value.field == "think"
    out = llm.chat(HELLO, SamplingParams(max_tokens=2), use_tqdm=False, think=False)[0]
    assert out.reasoning == "" and len(out.token_ids) == 2

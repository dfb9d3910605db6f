"""gpt-oss's harmony format: its output (markers kept) split into reasoning, answer and calls at every cut; a forced
call's grammar over the markers as special tokens, and what it accepts read back as the call."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import pytest
from chat_templates import HARMONY
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import HARMONY_MARKERS, byte_level_tokenizer, harmony_tokenizer

from kvd.engine.grammar import GrammarCompiler
from kvd.request.harmony import HARMONY_REASONING, HarmonyParser, detect_harmony
from kvd.request.reasoning import ReasoningError, ReasoningRequest, check_reasoning, detect_reasoning
from kvd.request.sampling_params import SamplingParams
from kvd.request.tool_grammar import tool_call_grammar
from kvd.request.tool_parse import ToolCallParser
from kvd.request.tool_render import ToolFormat, detect_tool_template, render_messages
from kvd.request.tool_validate import ToolChoice, parse_tools

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
    ]
)
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
CASES = [
    # (output, reasoning, answer, calls)
    (
        "<|channel|>analysis<|message|>Think it over.<|end|><|start|>assistant<|channel|>final<|message|>Yes.<|return|>",
        "Think it over.",
        "Yes.",
        [],
    ),
    ("<|channel|>analysis<|message|>Check.<|end|><|start|>assistant" + CALL, "Check.", "", [("Oslo",)]),
    # The recipient in the role's header, the content type after the channel.
    (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome", "days": 2}<|call|>',
        "",
        "",
        [("Rome", 2)],
    ),
    # A message to a built-in tool kvd does not run is dropped; commentary to no one is answer.
    (
        "<|channel|>analysis to=browser.search<|message|>{}<|call|>",
        "",
        "",
        [],
    ),
    ("<|channel|>commentary<|message|>Looking.<|end|>", "", "Looking.", []),
    ('{"ok": true}', "", '{"ok": true}', []),  # no header: a grammar's JSON
    ("<|channel|>analysis<|message|>cut mid thought", "cut mid thought", "", []),
    # A marker's beginning is held back until the text shows it is none: at the end it is text.
    ("<|channel|>final<|message|>a <| b and <|mess", "", "a <| b and <|mess", []),
    ("<|channel|>final<|message|>x<|channel|>analysis<|message|>y<|end|>", "y", "x", []),
    ("<|channel|>analys", "", "", []),  # a header cut short
    # A call to a function the request has not given is dropped, as a built-in tool's is.
    ('<|channel|>commentary to=functions.get_time<|message|>{"zone": "cet"}<|call|>', "", "", []),
    # A final message whose words could begin nothing but text: streamed whole, "to" and "functions." included.
    ("<|channel|>final<|message|>Go to functions. Now", "", "Go to functions. Now", []),
]


def _split(pieces: list[str], calls: bool = True) -> tuple[str, str, list[tuple]]:
    parser = HarmonyParser(frozenset({"get_weather"}) if calls else frozenset())
    tool_parser = ToolCallParser(detect_tool_template(HARMONY), TOOLS)
    reasoning, answer = "", ""
    for piece in pieces:
        r, a = parser.feed(piece)
        reasoning, answer = reasoning + r, answer + tool_parser.feed(a)
    r, a = parser.finish()
    content = answer + tool_parser.feed(a)
    rest, found, _ = tool_parser.finish("stop")
    return reasoning + r, content + rest, [tuple(json.loads(c.arguments).values()) for c in found]


@pytest.mark.parametrize(("text", "reasoning", "answer", "calls"), CASES)
def test_the_parser_splits_at_every_cut(text, reasoning, answer, calls):
    assert _split([text]) == (reasoning, answer, calls)
    for cut in range(len(text) + 1):
        assert _split([text[:cut], text[cut:]]) == (reasoning, answer, calls), cut
    assert _split(list(text)) == (reasoning, answer, calls)


PIECES = st.sampled_from(
    [*HARMONY_MARKERS, "analysis", "final", "commentary", " to=functions.get_weather", "x", " "]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=30), st.booleans())
def test_any_run_of_markers_and_text_ends_and_leaves_no_marker(pieces: list[str], calls: bool):
    """Whatever a model writes (a random one writes markers anywhere), the parser returns, and neither the
    reasoning nor the answer holds a marker (a call's hand-over to the tool parser aside)."""
    parser = HarmonyParser(frozenset({"get_weather"}) if calls else frozenset())
    texts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    reasoning, answer = "".join(r for r, _ in texts), "".join(a for _, a in texts)
    answer = re.sub(r"<\|start\|>functions\.get_weather<\|message\|>|<\|call\|>", "", answer)
    assert not any(marker in reasoning + answer for marker in HARMONY_MARKERS), (reasoning, answer)


def test_without_tools_a_call_is_dropped_and_analysis_tokens_are_counted():
    assert _split([CALL], calls=False) == ("", "", [])
    parser = HarmonyParser()
    steps = ["<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>", "assistant"]
    steps += ["<|channel|>", "final", "<|message|>", "c"]
    for piece in steps:
        parser.count([0])
        parser.feed(piece)
    # The analysis message's tokens: from its <|message|> marker to its end marker
    assert parser.num_tokens == 4


def test_an_answer_cut_by_max_tokens_keeps_its_last_words_and_other_special_tokens_go():
    for words in ["I went", "Go to", "a <"]:
        parser = HarmonyParser(frozenset({"get_weather"}))
        tool_parser = ToolCallParser(detect_tool_template(HARMONY), TOOLS)
        _, answer = parser.feed("<|channel|>final<|message|>" + words)
        content = tool_parser.feed(answer) + tool_parser.feed(parser.finish()[1])
        rest, calls, reason = tool_parser.finish("length")
        assert (content + rest, calls, reason) == (words.rstrip(" <"), [], "length")
    parser = HarmonyParser(drop=("<|endoftext|>",))
    assert parser.feed("<|channel|>final<|message|>a<|endoftext|>b<|endoftext|>") == ("", "ab")


def test_a_harmony_model_takes_think_and_effort_but_no_budget():
    always = dict(fmt=None, reads_effort=True, always_reasons=True)
    check_reasoning(ReasoningRequest(think=True, effort="high"), **always)
    check_reasoning(ReasoningRequest(think=False), **always)
    with pytest.raises(ReasoningError) as e:
        check_reasoning(ReasoningRequest(think=True, budget=10), **always)
    assert e.value.field == "reasoning_budget"


def test_a_tool_without_a_description_renders():
    """The harmony template writes every tool's description (gpt-oss's fails on an undefined one)."""
    tokenizer = harmony_tokenizer()
    template = detect_tool_template(HARMONY, tokenizer)
    bare = parse_tools([{"type": "function", "function": {"name": "now"}}])
    conversation, tools = render_messages([{"role": "user", "content": "hi"}], bare, template, False)
    text = tokenizer.apply_chat_template(
        conversation, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "\n// \ntype now = " in text


def test_detection_needs_the_template_and_the_marker_tokens():
    tokenizer = harmony_tokenizer()
    assert detect_harmony(tokenizer, HARMONY)
    assert not detect_harmony(byte_level_tokenizer(), HARMONY)  # markers in pieces
    assert not detect_harmony(tokenizer, "{{ messages }}")
    assert detect_tool_template(HARMONY, tokenizer).format is ToolFormat.HARMONY
    assert detect_reasoning(tokenizer, HARMONY) is None  # no <think> section: its channels instead
    assert HARMONY_REASONING == {"start": "<|channel|>analysis<|message|>", "end": "<|end|>"}


def test_the_forced_call_grammar_takes_the_markers_as_tokens_and_reads_back():
    tokenizer = harmony_tokenizer()
    ll = llguidance.hf.from_tokenizer(tokenizer)
    template = detect_tool_template(HARMONY, tokenizer)
    grammar = tool_call_grammar(TOOLS, ToolChoice("required"), template, parallel=True)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return (
            matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
            and matcher.is_accepting()
        )

    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 3}'
    assert accepts(text)
    assert not accepts(text.replace('"days": 3', '"days": "3"'))  # the schema holds
    assert not accepts(text.replace("get_weather", "get_time"))
    assert not accepts(text.replace("<|channel|>", "<|channel|"))  # the marker, not its text in pieces
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert _split([decoded]) == ("", "", [("Oslo", 3)])


def test_a_json_answer_and_a_forced_call_may_follow_an_analysis():
    """In a harmony chat the grammar holds for the final message (or the call), after any analysis the model
    writes first; outside a chat it holds from the first token."""
    tokenizer = harmony_tokenizer()
    grammars = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    params = SamplingParams(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"}}})
    analysis = "<|channel|>analysis<|message|>Weigh {it}: < or >?<|end|><|start|>assistant"

    def accepts(matcher, text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    final = '<|channel|>final<|message|>{"ok": true}'
    for text, in_chat in [(analysis + final, True), (final, True), ('{"ok": true}', False)]:
        assert accepts(grammars.matcher(params, harmony=True), text) is in_chat, text
        assert accepts(grammars.matcher(params), text) is not in_chat, text
    assert not accepts(grammars.matcher(params, harmony=True), final.replace("true", '"yes"'))
    template = detect_tool_template(HARMONY, tokenizer)
    forced = SamplingParams(
        grammar=tool_call_grammar(TOOLS, ToolChoice("required"), template, parallel=False)
    )
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    assert accepts(grammars.matcher(forced), analysis + call) and accepts(grammars.matcher(forced), call)


def test_every_end_of_sequence_the_config_lists_stops_a_generation(tmp_path):
    """gpt-oss lists <|return|> and <|call|> (Gemma <eos> and <end_of_turn>): a call ends its generation too."""
    from conftest import save_tiny_checkpoint

    from kvd import LLM

    tokenizer = harmony_tokenizer()
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    save_tiny_checkpoint("gpt_oss", tmp_path, tokenizer=tokenizer, eos_token_id=ends)
    assert LLM(str(tmp_path), dtype="float32", kv_cache_memory="4M").engine.eos_token_ids == set(ends)

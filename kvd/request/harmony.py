"""OpenAI's harmony format (gpt-oss): an answer is a run of messages, each a header and its content,

    <|channel|>analysis<|message|>reasoning...<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

with a call to a function as a message to it: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{...}<|call|>` (the recipient may stand in the role's header instead). The markers are special tokens, so a harmony
chat's text is decoded with them kept, and `HarmonyParser` splits it: analysis to the reasoning, final (and
commentary to no one) to the answer, a call to the tool parser as `to=functions.NAME<|message|>ARGS<|call|>`,
messages to other recipients (built-in tools kvd does not run) dropped. Pure Python, as kvd.request.reasoning.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# What the tool parser reads: the call's open marker (the function's name follows) and its close; markers, so
# that no answer's text (from which they are all taken) can begin one.
CALL_OPEN = START + "functions."
CALL_CLOSE = CALL
_CLOSING = (END, CALL, RETURN, START)  # end a message (dropped)
_MARKERS = (*_CLOSING, CHANNEL, MESSAGE, CONSTRAIN)  # any other in a message's content begins a header
HARMONY_MARKERS = frozenset(_MARKERS)
# How a message's header begins (the first one right after the prompt's `<|start|>assistant`); output that begins
# otherwise is no message (a grammar's JSON, say) and is all answer.
_HEADER_STARTS = (CHANNEL, "to=", CONSTRAIN, "assistant", START, MESSAGE)
HARMONY_REASONING = {"start": CHANNEL + "analysis" + MESSAGE, "end": END}  # info.reasoning of a harmony model
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def detect_harmony(tokenizer: Any, chat_template: str | None) -> bool:
    """A harmony model: its template writes channels and its tokenizer has each marker as one token."""
    if CHANNEL not in (chat_template or "") or MESSAGE not in (chat_template or ""):
        return False
    return all(
        len(tokenizer.encode(m, add_special_tokens=False)) == 1 for m in (START, CHANNEL, MESSAGE, END)
    )


# A grammar's rule for the analysis a harmony answer may begin with (its content free up to its end marker),
# in llguidance's Lark with the markers as its special tokens: a forced call or a JSON answer comes after it.
ANALYSIS_RULE = 'analysis: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"'
FINAL_HEADER = '<|channel|> "final" <|message|>'  # the answer's message header, in the same terms


def call_grammar(tools: list[tuple[str, dict]]) -> str:
    """The grammar of one call, in the header kvd reads, to any of `tools` ((name, arguments schema) pairs),
    after the analysis the model may write first."""
    rules = [
        f'call_{i}: {json.dumps(name + " ")} <|constrain|> "json" <|message|> %json {json.dumps(schema)}'
        for i, (name, schema) in enumerate(tools)
    ]
    options = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = f'start: analysis? <|channel|> "commentary to=functions." ({options})'
    return "%llguidance {}\n" + "\n".join([start, ANALYSIS_RULE, *rules])


def answer_grammar(body: str) -> str:
    """The grammar of a final message whose content is `body` (a Lark expression), after the analysis."""
    return "%llguidance {}\n" + "\n".join(
        [f"start: analysis? {FINAL_HEADER} body", ANALYSIS_RULE, f"body: {body}"]
    )


def _route(header: str) -> str:
    """Where a message's content goes: "reasoning", "answer", "call" or "drop"."""
    recipient = _RECIPIENT.search(header)
    if recipient:
        return "call" if recipient.group(1).startswith("functions.") else "drop"
    channel = _CHANNEL.search(header)
    return "reasoning" if channel and channel.group(1) == "analysis" else "answer"


def _held_back(text: str) -> int:
    """Where the part of `text` that may begin a marker starts (len(text) if none does)."""
    start = text.rfind("<|")
    if start >= 0 and any(m.startswith(text[start:]) for m in _MARKERS):
        return start
    return len(text) - (text.endswith("<"))


class _Pieces:
    """Text by where it goes: the reasoning, or the answer (a call's text amid it, in order); dropped text aside."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.answer: list[str] = []

    def add(self, route: str, text: str) -> None:
        if route == "reasoning":
            self.reasoning.append(text)
        elif route != "drop":
            self.answer.append(text)

    def split(self) -> tuple[str, str]:
        return "".join(self.reasoning), "".join(self.answer)


class HarmonyParser:
    """Splits a harmony chat's text (markers kept) into its reasoning and its answer as it streams, and counts the
    tokens of analysis messages. `calls`: the request's tools, whose calls go to the answer (for the tool parser);
    a call to any other function is dropped. `drop`: the tokenizer's other special tokens, taken out where they
    come (an end of sequence's text, say)."""

    def __init__(self, calls: frozenset[str] = frozenset(), drop: tuple[str, ...] = ()) -> None:
        self.calls = calls
        self.drop = drop
        self.num_tokens = 0
        self._held = ""
        self._route: str | None = None  # None: reading a header
        self._counting = 0  # tokens of this step, counted once the text shows where they went

    def count(self, token_ids: Sequence[int]) -> None:
        self._counting = len(token_ids)

    def feed(self, text: str) -> tuple[str, str]:
        was = self._route
        out = _Pieces()
        self._held += text
        while self._held:
            if self._route is None:
                head = self._held.lstrip()
                if head and not any(h.startswith(head[: len(h)]) for h in _HEADER_STARTS):
                    self._route = "answer"  # no header: plain text
                    continue
                at = self._held.find(MESSAGE)
                if at < 0:
                    break
                header, self._held = self._held[:at], self._held[at + len(MESSAGE) :]
                self._route = _route(header)
                if self._route == "call":
                    name = _RECIPIENT.search(header).group(1)[len("functions.") :]
                    self._route = "call" if name in self.calls else "drop"
                if self._route == "call":
                    out.add("call", f"{CALL_OPEN}{name}{MESSAGE}")
                continue
            # Every marker and special token begins "<|": most steps' text has none to look for.
            markers = (*_MARKERS, *self.drop) if "<|" in self._held else ()
            ends = [(i, m) for m in markers if (i := self._held.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                out.add(self._route, self._held[:at])
                if marker in self.drop:
                    self._held = self._held[at + len(marker) :]
                    continue
                self._close(out)
                # A message's header follows (after <|start|>, whose role "assistant" is part of it); a header's
                # marker where content was stays for the header.
                self._held = self._held[at + len(marker) if marker in _CLOSING else at :]
                continue
            keep = _held_back(self._held)
            out.add(self._route, self._held[:keep])
            self._held = self._held[keep:]
            break
        if "reasoning" in (was, self._route):
            self.num_tokens += self._counting
        self._counting = 0
        return out.split()

    def _close(self, out: _Pieces) -> None:
        if self._route == "call":
            out.add("call", CALL_CLOSE)
        self._route = None

    def finish(self) -> tuple[str, str]:
        """The rest when the output ends: a message cut short keeps its text (a call its close)."""
        out = _Pieces()
        held, self._held = self._held, ""
        if self._route is None:
            return "", ""  # an unfinished header carries no text
        out.add(self._route, held)
        self._close(out)
        return out.split()

"""Reasoning models: the thinking section a chat template lets a model write before its answer.

A model reasons when its template knows a section like Qwen3's `<think> ... </think>` and its tokenizer has
each marker as one token that decodes to its text. The output's text is split into the reasoning and the
answer here, as it streams (`ReasoningParser`); the engine's `ReasoningGate` (kvd.engine.reasoning_gate) holds a
request's grammar back until the section ends. Pure Python (no torch): the protocol layer and the gateway use it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The markers of the section formats served: Qwen3, Qwen3.5, QwQ, DeepSeek-R1, SmolLM3 and their kin; and Gemma 4's
# thought channel, `<|channel>thought\n ... <channel|>` (its label is neither reasoning nor answer).
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"
CHANNEL_LABEL = "thought"
EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's thinking section: its markers, their token ids, and the tokens that are whitespace only (the
    output may start with some before it opens a section)."""

    start: str
    end: str
    start_id: int
    end_id: int
    whitespace_ids: frozenset[int] = frozenset()
    label: str = ""  # written right after the start marker: the channel's name, dropped from the reasoning

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt leaves a section open (templates that start the answer inside one, like Qwen3.5's): the
        generation prompt ends with the start marker, whitespace after it aside. A marker a client wrote in a
        message earlier in the prompt opens nothing."""
        for token in reversed(prompt_ids):
            if token not in self.whitespace_ids:
                return token == self.start_id
        return False

    def info(self) -> dict[str, str]:
        return {"start": self.start + self.label, "end": self.end}


def detect_reasoning(tokenizer: Any, chat_template: str | None) -> ReasoningFormat | None:
    """The model's thinking section, or None: its template must write the end marker, and its tokenizer must
    have both markers as single tokens that are not special (special tokens are left out of the output's text,
    which the section is split from)."""
    template = chat_template or ""
    if THINK_CLOSE in template:
        start, end, label = THINK_OPEN, THINK_CLOSE, ""
    elif CHANNEL_CLOSE in template and CHANNEL_OPEN + CHANNEL_LABEL in template:
        start, end, label = CHANNEL_OPEN, CHANNEL_CLOSE, CHANNEL_LABEL
    else:
        return None
    ids = []
    for marker in (start, end):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        added = tokenizer.added_tokens_decoder.get(encoded[0]) if len(encoded) == 1 else None
        if len(encoded) != 1 or (added is not None and added.special):
            return None
        ids.append(encoded[0])
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    whitespace = frozenset(i for i, text in enumerate(texts) if text and not text.strip())
    return ReasoningFormat(start, end, ids[0], ids[1], whitespace, label)


@dataclass(frozen=True)
class ReasoningRequest:
    """What a chat asks of the section: `think` on or off (None: the template's default), an effort for the
    templates that read one, and at most `budget` tokens of reasoning (the end marker forced then)."""

    think: bool | None = None
    effort: str | None = None
    budget: int | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: Qwen3's `enable_thinking`, gpt-oss's `reasoning_effort`."""
        kwargs: dict[str, Any] = {}
        if self.think is not None:
            kwargs["enable_thinking"] = self.think
        if self.effort is not None:
            kwargs["reasoning_effort"] = self.effort
        return kwargs

    @property
    def token_budget(self) -> int | None:
        """The section's token limit: none when thinking is off."""
        return 0 if self.think is False else self.budget


class ReasoningError(ValueError):
    """A reasoning field the model cannot honour; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def parse_reasoning(think: object, effort: object, budget: object) -> ReasoningRequest:
    """The request's reasoning fields checked: `think` a boolean, `reasoning_effort` one of EFFORTS,
    `reasoning_budget` a count of tokens."""
    if think is not None and not isinstance(think, bool):
        raise ReasoningError("think", "must be a boolean")
    if effort is not None and effort not in EFFORTS:
        raise ReasoningError("reasoning_effort", f"must be one of {', '.join(EFFORTS)}")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget < 2**31
    ):
        raise ReasoningError("reasoning_budget", "must be an integer in [0, 2**31)")
    return ReasoningRequest(think, effort, budget)


def check_reasoning(
    request: ReasoningRequest, fmt: ReasoningFormat | None, reads_effort: bool, always_reasons: bool = False
) -> None:
    """Refuse reasoning asked of a model whose template has no thinking section (think false is allowed); an
    effort needs a template that reads one (gpt-oss's) or a section (which it turns on). A model that
    `always_reasons` (harmony's analysis channel) takes think and effort but no budget, which it cannot keep."""
    if fmt is not None:
        return
    if always_reasons:
        if request.budget is not None:
            raise ReasoningError(
                "reasoning_budget", "this model's analysis channel cannot be cut at a budget; leave it unset"
            )
        return
    why = "this model's chat template has no thinking section; leave it unset"
    if request.think:
        raise ReasoningError("think", why)
    if request.budget is not None:
        raise ReasoningError("reasoning_budget", why)
    if request.effort is not None and not reads_effort:
        raise ReasoningError(
            "reasoning_effort", "this model's chat template takes no reasoning effort; leave it unset"
        )


class Phase(enum.Enum):
    """Where a chat's output tokens stand: before a section may open, inside one, or in the answer."""

    BEFORE = "before"
    THINKING = "thinking"
    ANSWER = "answer"


def next_phase(fmt: ReasoningFormat, phase: Phase, token: int) -> Phase:
    """The phase after `token`: a section opens only before the output's first word, and ends at its end
    token."""
    if phase is Phase.BEFORE:
        if token in fmt.whitespace_ids:
            return Phase.BEFORE
        return Phase.THINKING if token == fmt.start_id else Phase.ANSWER
    if phase is Phase.THINKING and token == fmt.end_id:
        return Phase.ANSWER
    return phase


class _State(enum.Enum):
    BEFORE = "before"  # the answer may open with a section
    THINKING = "thinking"
    AFTER = "after"  # the section ended: whitespace before the answer is dropped
    ANSWER = "answer"


class ReasoningParser:
    """Splits a chat's output text into its reasoning and its answer as the text streams (the markers and the
    whitespace around the reasoning dropped), and counts the section's tokens, its markers included."""

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self.fmt = fmt
        self.num_tokens = 0
        self._phase = Phase.THINKING if opened else Phase.BEFORE
        self._state = _State.THINKING if opened else _State.BEFORE
        self._held = ""  # text that may still be part of a marker, or whitespace whose side is not known yet
        self._started = False  # a word of reasoning came: whitespace before it is dropped
        self._labelled = not fmt.label  # the channel's label (if the format has one) is behind

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that `text` completes."""
        self._held += text
        reasoning, answer = [], []
        while self._held:
            held = self._held
            if self._state is _State.BEFORE:
                stripped = held.lstrip()
                if stripped.startswith(self.fmt.start):
                    self._held, self._state = stripped[len(self.fmt.start) :], _State.THINKING
                elif not stripped or self.fmt.start.startswith(stripped):
                    break  # whitespace or a marker's beginning: wait for more
                else:
                    self._state = _State.ANSWER
            elif self._state is _State.THINKING:
                if not self._labelled:
                    if self.fmt.label.startswith(held):
                        break  # the label's beginning: wait for more
                    self._labelled = True
                    if held.startswith(self.fmt.label):
                        self._held = held = held[len(self.fmt.label) :]
                if not self._started:
                    self._held = held = held.lstrip()
                    self._started = bool(held)
                end = held.find(self.fmt.end)
                if end >= 0:
                    reasoning.append(held[:end].rstrip())
                    self._held, self._state = held[end + len(self.fmt.end) :], _State.AFTER
                    continue
                keep = _held_back(held, self.fmt.end)
                reasoning.append(held[:keep])
                self._held = held[keep:]
                break
            elif self._state is _State.AFTER:
                self._held = held.lstrip()
                if self._held:
                    self._state = _State.ANSWER
            else:
                answer.append(held)
                self._held = ""
        return "".join(reasoning), "".join(answer)

    def count(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            before, self._phase = self._phase, next_phase(self.fmt, self._phase, token)
            self.num_tokens += before is Phase.THINKING or self._phase is Phase.THINKING

    def finish(self) -> tuple[str, str]:
        """What is held when the output ends: an unfinished section's last reasoning, or the answer's rest."""
        held, self._held = self._held, ""
        if self._state is _State.THINKING:
            return ("" if not self._labelled else held.rstrip()), ""  # unlabelled: a beginning of the label
        if self._state is _State.AFTER:
            return "", ""
        return "", held  # the answer, or what began like a marker and ended there


def _held_back(text: str, marker: str) -> int:
    """Where the part of `text` that must wait begins: trailing whitespace (the reasoning's end is stripped)
    and a tail that begins the marker."""
    keep = len(text)
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            keep = len(text) - size
            break
    return len(text[:keep].rstrip())

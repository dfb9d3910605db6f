"""A chat's constraint when its model may reason first: the grammar (structured output, a forced tool call)
holds for the answer only, which begins after the thinking section's end token, and a token budget bounds the
section (its end token is the only one allowed once the budget is spent).

The gate stands where the engine keeps a request's llguidance matcher and answers the same calls (masks,
tokens consumed, stopped, drafts validated), so sampling, the output path and speculative drafts need no
change. Its state follows the request's own tokens only: a request's output is the same alone or batched.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import replace

import llguidance

from kvd.request.reasoning import Phase, ReasoningFormat, next_phase


class ReasoningGate:
    def __init__(
        self,
        fmt: ReasoningFormat,
        opened: bool,
        budget: int | None,
        grammar: llguidance.LLMatcher | None,
        eos_ids: Sequence[int] = (),
    ) -> None:
        # With a grammar, the answer starts at the first token that opens no section, whitespace too: the grammar
        # takes every token of the answer.
        self.fmt = fmt if grammar is None else replace(fmt, whitespace_ids=frozenset())
        self.budget = budget  # None: no limit; 0: no reasoning (a section may not open, an open one ends)
        self.grammar = grammar
        # A grammar still to hold (a schema, a forced call) may not be skipped by ending inside the section.
        self.eos_ids = tuple(eos_ids) if grammar is not None else ()
        self.phase = Phase.THINKING if opened else Phase.BEFORE
        self.num_thinking = 0  # tokens written inside the section

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        """Write the allowed tokens' bits at `ptr` (`size` bytes, token t at bit t % 32 of word t // 32)."""
        words = (ctypes.c_uint32 * (size // 4)).from_address(ptr)
        if self.phase is Phase.THINKING:
            if self._spent():
                ctypes.memset(ptr, 0, size)
                _set(words, self.fmt.end_id, True)
            else:
                ctypes.memset(ptr, 0xFF, size)
                for token in self.eos_ids:
                    _set(words, token, False)
            return
        if self.grammar is not None:
            self.grammar.unsafe_compute_mask_ptr(ptr, size)
        else:
            ctypes.memset(ptr, 0xFF, size)
        if self.phase is Phase.BEFORE:
            _set(words, self.fmt.start_id, self.budget != 0)

    def consume_token(self, token: int) -> bool:
        before, self.phase = self.phase, next_phase(self.fmt, self.phase, token)
        self.num_thinking += before is Phase.THINKING and self.phase is Phase.THINKING
        if _answers(before, self.phase) and self.grammar is not None:
            return self.grammar.consume_token(token)
        return True

    def is_stopped(self) -> bool:
        return self.phase is Phase.ANSWER and self.grammar is not None and self.grammar.is_stopped()

    def is_error(self) -> bool:
        return self.phase is Phase.ANSWER and self.grammar is not None and self.grammar.is_error()

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the gate allows from here (a speculative draft's valid part)."""
        phase, count = self.phase, self.num_thinking
        for i, token in enumerate(tokens):
            if phase is Phase.THINKING and self._spent(count) and token != self.fmt.end_id:
                return i
            if phase is Phase.BEFORE and token == self.fmt.start_id and self.budget == 0:
                return i
            if phase is Phase.THINKING and token in self.eos_ids:
                return i
            before, phase = phase, next_phase(self.fmt, phase, token)
            count += before is Phase.THINKING and phase is Phase.THINKING
            if _answers(before, phase):
                rest = list(tokens[i:])
                return i + (self.grammar.validate_tokens(rest) if self.grammar is not None else len(rest))
        return len(tokens)

    def _spent(self, count: int | None = None) -> bool:
        used = self.num_thinking if count is None else count
        return self.budget is not None and used >= self.budget


def _answers(before: Phase, after: Phase) -> bool:
    """The token that moved the phase from `before` to `after` is the answer's: neither a section's marker nor
    inside one."""
    return before is not Phase.THINKING and after is not Phase.THINKING


def _set(words: ctypes.Array, token: int, allowed: bool) -> None:
    if token >= len(words) * 32:
        return
    bit = 1 << (token % 32)
    words[token // 32] = (words[token // 32] | bit) if allowed else (words[token // 32] & (0xFFFFFFFF ^ bit))


def gate(
    fmt: ReasoningFormat | None,
    prompt_ids: Sequence[int],
    budget: int | None,
    grammar: llguidance.LLMatcher | None,
    eos_ids: Sequence[int] = (),
) -> ReasoningGate | llguidance.LLMatcher | None:
    """A chat's constraint: the grammar alone where nothing is gated (no section, or neither a grammar nor a
    budget to hold), else a gate around it."""
    if fmt is None or (grammar is None and budget is None):
        return grammar
    return ReasoningGate(fmt, fmt.opened_by(prompt_ids), budget, grammar, eos_ids)

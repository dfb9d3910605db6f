"""Incremental detokenization with stop strings: streamed pieces concatenate to the full decoded text, and the
tokens handed out with them are those of that text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens of context decoded before the new ones, so that a token's leading space or merged bytes come out right.
_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text, never emitting half of a multi-byte UTF-8 character."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        # Text that could still turn out to be the start of a stop string is held back from streaming.
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once stopped
        self.starts: list[int] = []  # where each generated token's text begins in `text`
        self.released = 0  # generated tokens handed out (take_tokens)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Decode newly generated tokens; sets `stopped` and truncates `text` when a stop string appears."""
        if self.stopped:
            return
        self.starts += [len(self.text)] * len(token_ids)
        self.token_ids.extend(token_ids)
        new_text = self._decode_new(final=False)
        if new_text:
            self._append(new_text)

    def finish(self) -> None:
        """Flush tokens still held for an incomplete character (the sequence ended)."""
        if not self.stopped:
            rest = self._decode_new(final=True)
            if rest:
                self._append(rest)

    def take_delta(self, finished: bool) -> str:
        """The text not yet handed out; while unfinished, keep back what may begin a stop string."""
        end = (
            len(self.text) if finished or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        )
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def take_tokens(self, finished: bool) -> int:
        """How many more generated tokens go out with the text taken so far (call after take_delta). With stop
        strings a token waits until its text starts going out, and one whose text begins inside the stop string
        that ended the output never does: the tokens handed out are those of the text, as its logprobs must be."""
        if not self.stop or (finished and not self.stopped):
            end = len(self.starts)
        else:  # starts and emitted only grow: continue from the last token handed out
            end = self.released
            while end < len(self.starts) and self.starts[end] < self.emitted:
                end += 1
        count, self.released = end - self.released, end
        return count

    def _decode_new(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _CONTEXT_TOKENS)
        self.read_offset = len(self.token_ids)
        # Keep the decode window short: drop ids before the context window.
        if self.prefix_offset > 4 * _CONTEXT_TOKENS:
            del self.token_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return full[len(prefix) :]

    def _append(self, new_text: str) -> None:
        start = max(0, len(self.text) - self.holdback)
        self.text += new_text
        # The earliest match in the text wins, whatever the order of the stop strings (at one place, the first
        # listed).
        matches = [(pos, i) for i, s in enumerate(self.stop) if (pos := self.text.find(s, start)) != -1]
        if matches:
            pos, i = min(matches)
            self.text, self.stop_string, self.stopped = self.text[:pos], self.stop[i], True

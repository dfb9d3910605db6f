"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a sequence's last n tokens.

Text a model is asked to edit, quote or answer from repeats in its output; where the last few tokens generated
occurred before (in the prompt or the output), the tokens that followed them then are a likely continuation now.
Drafts cost no model: the engine verifies them in one step (kvd.engine.speculative) and keeps what the model
itself would have produced.
"""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram (n_min <= n <= n_max) of a growing token list last ended, for one sequence.

    Indexed incrementally: each call adds the n-grams ending at the positions appended since the last one, so a
    step costs O(new tokens x n) rather than a scan of the whole context. Keys are the n-grams' hashes (an int
    per entry instead of a tuple); a collision only proposes a draft the verification then rejects."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[int, int] = {}  # hash of an n-gram -> the index just past its latest occurrence
        self._indexed = 0  # n-grams ending at indices 1 .. _indexed - 1 are in _ends

    def propose(self, token_ids: list[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest suffix found
        (n from n_max down to n_min); [] if none occurred. `token_ids` only grows between calls."""
        end = len(token_ids)
        self._index(token_ids, end)
        if most < 1:
            return []
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            start = self._ends.get(hash(tuple(token_ids[end - n : end])))
            if start is not None:
                return token_ids[start : start + most]
        return []

    def _index(self, token_ids: list[int], end: int) -> None:
        """Add the n-grams ending before `end` (the current suffix itself is not its own earlier occurrence)."""
        for e in range(max(self._indexed, 1), end):
            for n in range(self.n_min, min(self.n_max, e) + 1):
                self._ends[hash(tuple(token_ids[e - n : e]))] = e
        self._indexed = max(self._indexed, end)

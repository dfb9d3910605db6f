"""Speculative decoding that cannot change an answer: n-gram drafts verified in the step that decodes.

A decoding sequence's draft (kvd.engine.ngram) joins its step as extra decode rows (kvd.engine.model_runner), so
each row's logits are the bits a plain decode step would have given at that position. The engine then samples
the rows in order, exactly as plain decoding would sample one token per step: the same sampler, the same
penalties over the tokens so far, the grammar advanced token by token, a seeded request's generator drawn once
per token. While the token sampled equals the draft's next, the next row stands (its input was that token);
the first difference ends the run. The tokens a request receives are therefore the ones it gets without
speculation, greedy or sampled; a draft only decides how many arrive per step. For a sampled request this is
the rejection rule that keeps the target distribution, for a draft that proposes one token with certainty:
accept it with the target's probability of it, else draw from the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.engine.draft_odds import DraftOdds
from kvd.engine.engine_args import EngineArgs
from kvd.engine.engine_request import EngineRequest
from kvd.engine.ngram import NgramIndex


@dataclass
class SpeculativeCounts:
    """Totals since start: tokens drafted, and those the model's own tokens confirmed."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0  # verification runs (drafts of at least one token)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_drafts += drafted > 0

    def summary(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_rejected_tokens": self.num_draft_tokens - self.num_accepted_tokens,
            # Tokens a verification run adds besides the one a plain step gives.
            "mean_accepted_length": self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }


class Speculator:
    """Drafts for the engine's decoding sequences (the scheduler's drafter) and the counts of their fate."""

    def __init__(self, args: EngineArgs, max_model_len: int) -> None:
        self.num_tokens = args.speculative_tokens
        self.ngram_min, self.ngram_max = args.ngram_min, args.ngram_max
        self.max_model_len = max_model_len
        self.counts = SpeculativeCounts()

    def start(self, request: EngineRequest) -> None:
        """Speculate for a new request: its n-gram index and its draft odds."""
        request.ngrams = NgramIndex(self.ngram_min, self.ngram_max)
        request.draft_odds = DraftOdds()

    def record(self, request: EngineRequest, drafted: int, accepted: int) -> None:
        """A draft's fate: counted, and in the request's odds (its next draft's length)."""
        self.counts.record(drafted, accepted)
        request.num_draft_tokens += drafted
        request.num_accepted_tokens += accepted
        request.draft_odds.record(drafted, accepted)

    def draft(self, request: EngineRequest, most: int) -> list[int]:
        """Up to `most` tokens to verify after the request's next token: none where it opted out, none past
        its max_tokens or the context, only tokens its grammar allows in order."""
        if request.ngrams is None:
            return []
        seq, params = request.seq, request.params
        # A run yields its draft's accepted tokens and one more, and stops at the context's end: the draft's
        # last token is worth a row only if both limits leave room for the token after it.
        most = min(
            most,
            self.num_tokens,
            params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - len(seq) - 1,
        )
        draft = request.ngrams.propose(seq.token_ids, request.draft_odds.length(most))
        if draft and request.matcher is not None:
            draft = draft[: request.matcher.validate_tokens(draft)]
        if not draft:
            request.draft_odds.rest()
        return draft

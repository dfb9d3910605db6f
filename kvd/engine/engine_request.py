"""The engine's record of one request: its sequence and everything sampling and output need beside it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import llguidance
import torch

from kvd.engine.detokenizer import IncrementalDetokenizer
from kvd.engine.draft_odds import DraftOdds
from kvd.engine.ngram import NgramIndex
from kvd.engine.pooling import EmbeddingState
from kvd.engine.prompt_logprobs import PromptLogprobs
from kvd.engine.sampler import SampledToken
from kvd.engine.sequence import Sequence
from kvd.request.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One request under the id its caller chose (opaque: any hashable value)."""

    request_id: Hashable
    seq: Sequence
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None for embed requests, which produce no text
    generator: torch.Generator | None
    num_cached_tokens: int = 0
    matcher: llguidance.LLMatcher | None = None  # structured output: the grammar's state after its tokens
    prompt_logprobs: PromptLogprobs | None = None
    embedding: EmbeddingState | None = None  # set for embed requests
    # Sampled tokens waiting for their text to go out (with stop strings; see IncrementalDetokenizer.take_tokens).
    pending: list[SampledToken] = field(default_factory=list)
    ngrams: NgramIndex | None = None  # speculating: where its drafts come from (kvd.engine.speculative)
    draft_odds: DraftOdds | None = None  # how long its next draft should be
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

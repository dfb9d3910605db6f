"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds and logprobs on tensors."""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import torch

from kvd.engine.grammar import apply_masks
from kvd.kernels import cpu_native
from kvd.request.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence that samples this step.

    `token_ids` is the sequence's own list (prompt, then output), not a copy: only penalties read it, so the
    per-step cost of a row stays independent of the sequence length.
    """

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    num_prompt_tokens: int
    matcher: llguidance.LLMatcher | None = None  # structured output: only tokens it allows may be sampled

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # log_softmax of the raw logits at the sampled token
    top_logprobs: list[tuple[int, float]] | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """Sample one token per row of `logits` ([N, V], float32)."""
    raw = logits  # never written: the caller's tensor
    logprobs = _logprobs(logits, rows)
    if any(r.params.has_penalties for r in rows):
        logits = _apply_penalties(logits, rows)  # a new tensor
    if any(r.params.logit_bias for r in rows):
        logits = _apply_logit_bias(logits.clone() if logits is raw else logits, rows)
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    if constrained:  # last, so that nothing lifts a masked token back
        matchers = [rows[i].matcher for i in constrained]
        logits = apply_masks(logits.clone() if logits is raw else logits, constrained, matchers)
    greedy_ids = _argmax(logits)
    if all(r.params.greedy for r in rows):
        token_ids = greedy_ids
    else:
        token_ids = torch.where(_greedy_mask(rows, logits.device), greedy_ids, _random_sample(logits, rows))
    ids = token_ids.tolist()
    if logprobs is None:
        return [SampledToken(t) for t in ids]
    return _with_logprobs(ids, logprobs, rows)


def _greedy_mask(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    return torch.tensor([r.params.greedy for r in rows], device=device)


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    # Greedy rows get temperature 1 here; their sample is discarded.
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device).unsqueeze(1)
    logits = logits / temps
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        logits = _top_k_top_p(logits, rows)
    probs = logits.softmax(dim=-1)
    if any(r.params.min_p > 0.0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    # argmax(p / q) with q ~ Exp(1) draws from p; a seeded row draws q from its own generator, so its tokens do
    # not depend on what else shares the batch.
    noise = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i] = torch.empty(probs.shape[1], device=device).exponential_(generator=row.generator)
    return _argmax(probs / noise)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [N, V], natively on a CPU (the same answers, ties and NaN included)."""
    if cpu_native.supports(x) and x.dtype == torch.float32 and x.shape[-1] > 0:
        return cpu_native.argmax(x)
    return x.argmax(dim=-1)


def _ranked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x sorted by value, largest first, equal values by token id: the one tie rule, greedy's
    (argmax answers the first of equal values), so top_k=1 or a tiny top_p keeps greedy's token and the top
    logprobs list tied tokens in id order."""
    return x.sort(dim=-1, descending=True, stable=True)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device).clamp(max=vocab)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64, device=device)
    sorted_logits, order = _ranked(logits)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    # float64: a float32 running sum over a 50k vocabulary drifts by ~1e-5, enough to stop short of top_p 0.999.
    probs = sorted_logits.masked_fill(drop, float("-inf")).double().softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first token always stays.
    mass_before = probs.cumsum(dim=-1).roll(1, dims=-1)
    mass_before[:, 0] = 0.0
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[1]
    outputs = _padded([r.output_token_ids for r in rows], vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(
        1, outputs, torch.ones_like(outputs, dtype=torch.float32)
    )[:, :vocab]
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
    if (rep != 1.0).any():
        prompts = _padded([r.prompt_token_ids for r in rows], vocab, device)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompts, True)
        seen = seen[:, :vocab] | (counts > 0)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    return logits - presence * (counts > 0) - frequency * counts


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            tokens = torch.tensor(list(row.params.logit_bias), device=logits.device)
            biases = torch.tensor(list(row.params.logit_bias.values()), device=logits.device)
            logits[i, tokens] += biases
    return logits


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids padded with `pad` (an extra column that callers slice off)."""
    width = max(1, max(len(x) for x in lists))
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for i, ids in enumerate(lists):
        if ids:
            out[i, : len(ids)] = torch.tensor(ids)
    return out.to(device)


def _logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    if all(r.params.logprobs is None for r in rows):
        return None
    return logits.log_softmax(dim=-1)


def _with_logprobs(ids: list[int], logprobs: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    top_n = max(r.params.logprobs or 0 for r in rows)
    chosen = logprobs.gather(1, torch.tensor(ids, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = (t[:, :top_n] for t in _ranked(logprobs)) if top_n else (None, None)
    out = []
    for i, (token, row) in enumerate(zip(ids, rows, strict=True)):
        n = row.params.logprobs
        if n is None:
            out.append(SampledToken(token))
            continue
        top = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True)) if n else []
        out.append(SampledToken(token, chosen[i], top))
    return out

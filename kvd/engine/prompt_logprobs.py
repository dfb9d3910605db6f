"""Prompt logprobs: each prompt token's log-probability under the model given the tokens before it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvd.engine.sampler import SampledToken


@dataclass
class PromptLogprobs:
    """Filled chunk by chunk as the prompt is computed; entry 0 stays None (nothing precedes the first token)."""

    num_top: int
    prompt: list[int]
    entries: list[SampledToken | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.entries = [None] * len(self.prompt)

    def positions_wanted(self, start: int, end: int) -> range:
        """The positions in [start, end) whose logits predict a prompt token."""
        return range(start, min(end, len(self.prompt) - 1))

    def add(self, start: int, logits: torch.Tensor) -> None:
        """Logits of positions start, start+1, ...: each scores the prompt token after it.

        After a preemption the prompt is computed again and gives the same rows (batch invariance), so
        entries are written in place rather than appended."""
        logprobs = logits.log_softmax(dim=-1)
        targets = torch.tensor(self.prompt[start + 1 : start + 1 + logits.shape[0]], device=logits.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(self.num_top, dim=-1) if self.num_top else (None, None)
        for i, (token, logprob) in enumerate(zip(targets.tolist(), chosen, strict=True)):
            top = list(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True)) if self.num_top else []
            self.entries[start + 1 + i] = SampledToken(token, logprob, top)

"""LogitsRecorder: wraps the engine's real sampler and keeps each sampled row's logits, for bitwise comparisons."""

from __future__ import annotations

import pytest
import torch

from kvd.engine import llm_engine


class LogitsRecorder:
    """Keeps each sampled row's logits under the tokens its sequence had then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        sample = llm_engine.sample

        def recording(logits, rows):
            for i, row in enumerate(rows):
                self.rows[tuple(row.token_ids)] = logits[i].clone()
            return sample(logits, rows)

        monkeypatch.setattr(llm_engine, "sample", recording)

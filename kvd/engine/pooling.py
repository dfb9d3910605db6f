"""Embeddings: how a request's final hidden states pool into one vector, and the vector they give."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class EmbeddingState:
    """The final hidden states an embed request's prompt chunks produced so far."""

    pooling: str  # "mean" or "last"
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, position: int, hidden: torch.Tensor) -> None:
        """The rows of a chunk starting at `position`; a chunk at 0 starts over (a preempted request is
        recomputed from its first token)."""
        if position == 0:
            self.rows.clear()
        self.rows.append(hidden.float().cpu())

    def vector(self) -> list[float]:
        """The L2-normalised pooled vector; summed once over all positions, so chunking cannot change it."""
        hidden = torch.cat(self.rows) if self.pooling == "mean" else self.rows[-1][-1:]
        pooled = hidden.mean(dim=0)
        return torch.nn.functional.normalize(pooled, dim=0).tolist()


def choose_pooling(setting: str, model_path: Path, model_name: str) -> tuple[str, str]:
    """(pooling, why): the setting, else what the checkpoint's sentence-transformers config says, else the
    last token for Qwen3-Embedding-style models (their name says so) and the mean of all tokens otherwise."""
    if setting != "auto":
        return setting, "set by --pooling"
    config = model_path / "1_Pooling" / "config.json" if model_path.is_dir() else None
    if config is not None and config.is_file():
        modes = json.loads(config.read_text())
        if modes.get("pooling_mode_lasttoken"):
            return "last", "the checkpoint's 1_Pooling/config.json asks for the last token"
        if modes.get("pooling_mode_mean_tokens"):
            return "mean", "the checkpoint's 1_Pooling/config.json asks for the mean"
    if "embedding" in model_name.lower():
        return "last", "an embedding model of a causal LM family (Qwen3-Embedding style) pools its last token"
    return "mean", "a generative model: the mean of its final hidden states"

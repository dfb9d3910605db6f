"""Batch invariance: a request's logits do not depend on what else shares its step (docs/architecture.md,
"Determinism"). The layers that have a faster path which rounds differently carry a `batch_invariant` switch;
this sets it for one model, so two models in one process may differ."""

from __future__ import annotations

from torch import nn


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """On (the default): every kernel computes a row in one order whatever the batch; off: the faster paths."""
    for module in model.modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = on
    backend = getattr(model, "attention_backend", None)
    if hasattr(type(backend), "batch_invariant"):
        backend.batch_invariant = on

"""Batch invariance: a request's logits do not depend on what else shares its step (docs/architecture.md,
"Determinism"). The layers that have a faster path which rounds differently carry a `batch_invariant` switch;
this sets it for one model, so two models in one process may differ."""

from __future__ import annotations

import torch
from torch import nn

from kvd.kernels import cpu_native
from kvd.model.layers.linear import Linear


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """On (the default): every kernel computes a row in one order whatever the batch; off: the faster paths.

    Called once, after loading: on a CPU with AMX, turning it on lays bf16 linear weights out in tile order, which
    only kvd's kernel reads (as fast as oneDNN's bf16 GEMM for prefill, and the same order for every batch).
    """
    tiles = on and cpu_native.tiles_available()
    for module in model.modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = on
        weight = getattr(module, "weight", None)
        if tiles and isinstance(module, Linear) and _tileable(weight):
            module.weight.data = cpu_native.pack_tiles(weight.data)
            module.tiles = True
    backend = getattr(model, "attention_backend", None)
    if hasattr(type(backend), "batch_invariant"):
        backend.batch_invariant = on


def _tileable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 32 == 0
    )

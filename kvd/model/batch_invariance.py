"""Batch invariance: a request's logits do not depend on what else shares its step (docs/architecture.md,
"Determinism"). The layers that have a faster path which rounds differently carry a `batch_invariant` switch;
this sets it for one model, so two models in one process may differ."""

from __future__ import annotations

from torch import nn

from kvd.kernels import cpu_native
from kvd.model.layers.linear import KernelOrder


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """On (the default): every kernel computes a row in one order whatever the batch; off: the faster paths.

    Called once, after loading: turning it on lays the float linears' weights (and the embedding table, the
    output projection of a tied model) out in the order of kvd's own kernels (float32 in panels, bf16 in AMX
    tiles or AVX-512 BF16 pairs where the CPU has them), which only those kernels read: every output is then one
    fixed chain of sums whatever the batch, at GEMM speed for prefill. A projection that a quantized copy replaces
    (`output_proj`) stays in rows: a tied table then only looks embeddings up, which rows serve faster.
    """
    replaced = _replaced_output(model)
    for module in model.modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = on
        if module is replaced:
            continue
        if on and isinstance(module, KernelOrder) and cpu_native.packable(module.weight):
            module.weight.data = cpu_native.pack(module.weight.data)
            module.tiles = True
    backend = getattr(model, "attention_backend", None)
    if hasattr(type(backend), "batch_invariant"):
        backend.batch_invariant = on


def _replaced_output(model: nn.Module) -> nn.Module | None:
    """The float output projection (tied table or lm_head) whose work a quantized copy does, if one does."""
    return None if getattr(model, "output_proj", None) is None else model.float_output()

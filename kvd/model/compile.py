"""torch.compile of the model's elementwise-heavy pieces, for CUDA: norms (with their fused residual add)
and the MLP (gate/up, SiLU-and-multiply, down), so each fuses into a few kernels instead of one per op.

Attention stays outside (its backend runs its own kernels). Compiled with dynamic shapes: one graph serves
every token count, so neither prefill chunks nor CUDA-graph batch sizes trigger recompiles.
"""

from __future__ import annotations

import functools

import torch

from kvd.model.decoder import MLP, CausalLM
from kvd.model.layers.norm import RMSNorm

# Compiled per function (not per module through nn.Module.compile, whose shared _call_impl would pool every
# module class and dtype under one recompile limit); the instances are arguments, so layers share a graph.
_HOT_METHODS = {RMSNorm: ("forward", "add_and_norm"), MLP: ("forward",)}


def compile_hot_paths(model: CausalLM, backend: str = "inductor") -> None:
    """Replace, in place, each RMSNorm's forward and add_and_norm and each MLP's forward by compiled ones."""
    for cls, names in _HOT_METHODS.items():
        for name in names:
            compiled = torch.compile(getattr(cls, name), dynamic=True, fullgraph=True, backend=backend)
            for module in model.modules():
                if isinstance(module, cls):
                    setattr(module, name, functools.partial(compiled, module))

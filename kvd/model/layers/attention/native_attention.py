"""The native attention backend (CPU): kvd's kernels store K/V and attend tokens in the pool itself.

Each query reads its sequence's blocks where they lie (kvd.kernels.cpu_native), instead of gathering them into a
workspace for SDPA as the torch backend does. With batch invariance (the default) every token of a step, decode
or prefill, is one query of that kernel over its own causal context: a prompt token's output is then the same
whether its prompt ran alone, in a batch, in chunks or over a cached prefix, and the same as if it had been
decoded. Without it, prefill tokens go through the torch backend's SDPA path (faster for long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.kernels import cpu_native
from kvd.model.layers.attention.attention_base import AttentionBackend, StepLayout, host_to_device
from kvd.model.layers.attention.torch_attention import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    decode_rows,
)


@dataclass
class NativeDecodePlan:
    rows: torch.Tensor | None  # long [n]: batch rows of the decode tokens; None = every row, in order
    block_tables: torch.Tensor  # int32 [n, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [n]
    window: int | None  # StepLayout.window


class NativeAttentionBackend(TorchAttentionBackend):
    name = "native"
    batch_invariant = True  # set per model by kvd.model.batch_invariance

    def build_metadata(self, layout: StepLayout, device: torch.device | str) -> TorchAttentionMetadata:
        if not self.batch_invariant:
            return super().build_metadata(layout, device)
        base = AttentionBackend.build_metadata(self, layout, device)
        # One query per row: row j of sequence s sits at position ctx - n + j and sees that many tokens + 1.
        table_rows, lens = [], []
        for s, (n, ctx) in enumerate(zip(layout.query_lens, layout.context_lens, strict=True)):
            table_rows.extend([s] * n)
            lens.extend(range(ctx - n + 1, ctx + 1))
        rows = host_to_device(table_rows, torch.long, device)
        plan = NativeDecodePlan(
            None,
            base.block_tables.index_select(0, rows),
            host_to_device(lens, torch.int32, device),
            layout.window,
        )
        return TorchAttentionMetadata(**vars(base), write_slots=base.slot_mapping, decode=plan)

    def decode_plan(
        self, layout: StepLayout, seqs: list[int], starts: list[int], device: torch.device | str
    ) -> NativeDecodePlan:
        width = max(len(layout.block_tables[s]) for s in seqs)
        tables = [layout.block_tables[s] + [0] * (width - len(layout.block_tables[s])) for s in seqs]
        return NativeDecodePlan(
            decode_rows(layout, seqs, starts, device),
            host_to_device(tables, torch.int32, device).view(len(seqs), width),
            host_to_device([layout.context_lens[s] for s in seqs], torch.int32, device),
            layout.window,
        )

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn: TorchAttentionMetadata
    ) -> None:
        cpu_native.store_kv(k, v, kv_cache, attn.slot_mapping)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: NativeDecodePlan,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return cpu_native.paged_attention(
            q, kv_cache, plan.block_tables, plan.context_lens, scale, plan.window, sinks
        )

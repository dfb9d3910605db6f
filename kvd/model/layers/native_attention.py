"""The native attention backend (CPU): kvd's kernels store K/V and attend decode tokens in the pool itself.

Decode reads each sequence's blocks where they lie (kvd.kernels.cpu_native), instead of gathering them into a
workspace for SDPA as the torch backend does; prefill tokens still go through the torch backend's SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.kernels import cpu_native
from kvd.model.layers.attention_base import StepLayout, host_to_device
from kvd.model.layers.torch_attention import TorchAttentionBackend, TorchAttentionMetadata, decode_rows


@dataclass
class NativeDecodePlan:
    rows: torch.Tensor | None  # long [n]: batch rows of the decode tokens; None = every row, in order
    block_tables: torch.Tensor  # int32 [n, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [n]


class NativeAttentionBackend(TorchAttentionBackend):
    name = "native"

    def decode_plan(
        self, layout: StepLayout, seqs: list[int], starts: list[int], device: torch.device | str
    ) -> NativeDecodePlan:
        width = max(len(layout.block_tables[s]) for s in seqs)
        tables = [layout.block_tables[s] + [0] * (width - len(layout.block_tables[s])) for s in seqs]
        return NativeDecodePlan(
            decode_rows(layout, seqs, starts, device),
            host_to_device(tables, torch.int32, device).view(len(seqs), width),
            host_to_device([layout.context_lens[s] for s in seqs], torch.int32, device),
        )

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn: TorchAttentionMetadata
    ) -> None:
        cpu_native.store_kv(k, v, kv_cache, attn.slot_mapping)

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: NativeDecodePlan, scale: float
    ) -> torch.Tensor:
        return cpu_native.paged_decode_attention(q, kv_cache, plan.block_tables, plan.context_lens, scale)

"""The triton attention backend: Triton kernels store K/V and attend the decode tokens.

Prefill tokens (several new tokens of one sequence) go through the torch backend's SDPA path over the same pool;
decode is where the paged kernel pays, and the pure-decode step is what CUDA graphs replay.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kvd.kernels.paged_decode_attention import default_num_splits, paged_decode_attention
from kvd.kernels.store_kvcache import store_kvcache
from kvd.model.layers.attention.attention_base import AttentionMetadata, StepLayout, host_to_device
from kvd.model.layers.attention.graph_decode import GraphDecodeBackend
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend, TorchAttentionMetadata


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # long [n]: batch rows of the decode tokens; None = every row, in order
    block_tables: torch.Tensor  # int32 [n, max_blocks]
    context_lens: torch.Tensor  # int32 [n]
    num_splits: int
    window: int | None  # StepLayout.window


@dataclass
class PrefillGroup:
    rows: torch.Tensor | None  # long: batch rows of the prefill tokens; None = every row, in order
    metadata: TorchAttentionMetadata  # of these sequences alone, writing nothing (K/V are stored already)


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    decode: DecodeGroup | None = None
    prefill: PrefillGroup | None = None


class TritonAttentionBackend(GraphDecodeBackend):
    name = "triton"
    metadata_cls = TritonAttentionMetadata
    # Decode with splits sized by each sequence's own context (kvd.model.batch_invariance sets it per model).
    batch_invariant = True

    def __init__(self) -> None:
        self._prefill_backend = TorchAttentionBackend()

    def build_metadata(self, layout: StepLayout, device: torch.device | str) -> TritonAttentionMetadata:
        base = super().build_metadata(layout, device)
        decode = [s for s, n in enumerate(layout.query_lens) if n == 1]
        prefill = [s for s, n in enumerate(layout.query_lens) if n > 1]
        starts = layout.query_starts
        return TritonAttentionMetadata(
            **vars(base),
            decode=_decode_group(layout, base, decode, starts, device) if decode else None,
            prefill=self._prefill_group(layout, prefill, starts, device) if prefill else None,
        )

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        max_context_len: int,
    ) -> TritonAttentionMetadata:
        num_seqs = context_lens.shape[0]
        device = context_lens.device
        splits = default_num_splits(num_seqs, max_context_len, _num_sms(device))
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
            max_query_len=1,
            max_context_len=max_context_len,
            block_size=block_size,
            decode=DecodeGroup(None, block_tables, context_lens, splits, None),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_metadata(attn)
        store_kvcache(k, v, kv_cache, attn.slot_mapping)
        decode, prefill = attn.decode, attn.prefill
        if prefill is None and decode.rows is None:
            return self._decode(q, kv_cache, decode, scale, sinks)
        if decode is None and prefill.rows is None:
            return self._prefill_backend.forward(q, k, v, kv_cache, prefill.metadata, scale, sinks)
        out = torch.empty_like(q)
        if decode is not None:
            out.index_copy_(0, decode.rows, self._decode(q[decode.rows], kv_cache, decode, scale, sinks))
        if prefill is not None:
            rows = prefill.rows
            attended = self._prefill_backend.forward(
                q[rows], k[rows], v[rows], kv_cache, prefill.metadata, scale, sinks
            )
            out.index_copy_(0, rows, attended)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            q,
            kv_cache,
            group.block_tables,
            group.context_lens,
            scale,
            num_splits=group.num_splits,
            batch_invariant=self.batch_invariant,
            window=group.window,
            sinks=sinks,
        )

    def _prefill_group(
        self, layout: StepLayout, seqs: list[int], starts: list[int], device: torch.device | str
    ) -> PrefillGroup:
        query_lens = [layout.query_lens[s] for s in seqs]
        sub_layout = StepLayout(
            block_tables=[layout.block_tables[s] for s in seqs],
            context_lens=[layout.context_lens[s] for s in seqs],
            query_lens=query_lens,
            slot_mapping=[-1] * sum(query_lens),
            block_size=layout.block_size,
            window=layout.window,
        )
        metadata = self._prefill_backend.build_metadata(sub_layout, device)
        if len(seqs) == len(layout.query_lens):
            return PrefillGroup(None, metadata)
        rows = [r for s in seqs for r in range(starts[s], starts[s + 1])]
        return PrefillGroup(host_to_device(rows, torch.long, device), metadata)


def _decode_group(
    layout: StepLayout,
    base: AttentionMetadata,
    seqs: list[int],
    starts: list[int],
    device: torch.device | str,
) -> DecodeGroup:
    max_context_len = max(layout.context_lens[s] for s in seqs)
    splits = default_num_splits(len(seqs), max_context_len, _num_sms(torch.device(device)))
    if len(seqs) == base.num_seqs:
        return DecodeGroup(None, base.block_tables, base.context_lens, splits, layout.window)
    index = host_to_device(seqs, torch.long, device)
    rows = host_to_device([starts[s] for s in seqs], torch.long, device)
    return DecodeGroup(rows, base.block_tables[index], base.context_lens[index], splits, layout.window)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Parallel units the decode kernel spreads over: multiprocessors on CUDA, cores in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1

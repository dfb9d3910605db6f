"""The flash-attn backend (CUDA, fp16/bf16): paged varlen attention for steps with prefill, paged
flash_attn_with_kvcache for pure decode. K/V are written by the Triton store kernel.

flash-attn is imported when the backend is built (not when this module is), and the backend takes stand-ins
for its two functions, so the metadata and the calls are testable on a host without it. Its paged path needs
a block size that is a multiple of 256.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvd.kernels.store_kvcache import store_kvcache
from kvd.model.layers.attention.attention_base import (
    AttentionBackendError,
    AttentionBackendUnavailableError,
    AttentionMetadata,
    StepLayout,
    host_to_device,
    resolve_block_size,
)
from kvd.model.layers.attention.graph_decode import GraphDecodeBackend


@dataclass(frozen=True)
class FlashAttnOps:
    """The two flash-attn entry points the backend calls (flash_attn's, or stand-ins with the same contract)."""

    varlen: Callable[..., torch.Tensor]  # flash_attn_varlen_func
    with_kvcache: Callable[..., torch.Tensor]  # flash_attn_with_kvcache


def load_flash_attn_ops() -> FlashAttnOps:
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as e:
        raise AttentionBackendUnavailableError(
            f"the flash-attn attention backend needs the flash-attn package ({e}); install it on a CUDA host "
            "with `pip install flash-attn --no-build-isolation` (or kvd[cuda]), or pick --attention-backend "
            "triton or torch"
        ) from e
    return FlashAttnOps(flash_attn_varlen_func, flash_attn_with_kvcache)


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    cu_seqlens_k: torch.Tensor | None = None  # int32 [S + 1]: cumulative context lengths
    is_decode: bool = False  # every sequence has exactly one new token


class FlashAttentionBackend(GraphDecodeBackend):
    name = "flash-attn"
    metadata_cls = FlashAttentionMetadata
    # Decode without flash-attn's split heuristic, which picks the split count by batch size (batch invariance).
    batch_invariant = True

    def __init__(self, ops: FlashAttnOps | None = None) -> None:
        self.ops = ops or load_flash_attn_ops()

    def build_metadata(self, layout: StepLayout, device: torch.device | str) -> FlashAttentionMetadata:
        resolve_block_size(self.name, layout.block_size)  # raises unless a multiple of 256
        base = super().build_metadata(layout, device)
        cu_seqlens_k = [0]
        for n in layout.context_lens:
            cu_seqlens_k.append(cu_seqlens_k[-1] + n)
        return FlashAttentionMetadata(
            **vars(base),
            cu_seqlens_k=host_to_device(cu_seqlens_k, torch.int32, device),
            is_decode=base.max_query_len == 1,
        )

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        max_context_len: int,
    ) -> FlashAttentionMetadata:
        resolve_block_size(self.name, block_size)
        num_seqs = context_lens.shape[0]
        return FlashAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=context_lens.device),
            max_query_len=1,
            max_context_len=max_context_len,
            block_size=block_size,
            is_decode=True,  # decode reads context_lens; cu_seqlens_k is for varlen steps only
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
        if sinks is not None:
            raise AttentionBackendError(
                "flash-attn has no attention sinks: run this model with --attention-backend triton"
            )
        store_kvcache(k, v, kv_cache, attn.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # each [num_blocks, block_size, kv_heads, head_dim]
        if attn.is_decode:
            out = self.ops.with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=attn.context_lens,
                block_table=attn.block_tables,
                softmax_scale=scale,
                causal=True,
                num_splits=1 if self.batch_invariant else 0,  # 0: flash-attn's heuristic
                **_window_size(attn.window),
            )
            return out.squeeze(1)
        # Causal masking in flash-attn aligns each sequence's queries with the end of its keys, which is
        # what a chunk over a cached prefix needs.
        return self.ops.varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=attn.query_start_loc,
            cu_seqlens_k=attn.cu_seqlens_k,
            max_seqlen_q=attn.max_query_len,
            max_seqlen_k=attn.max_context_len,
            softmax_scale=scale,
            causal=True,
            block_table=attn.block_tables,
            **_window_size(attn.window),
        )


def _window_size(window: int | None) -> dict[str, tuple[int, int]]:
    """flash-attn's argument for a sliding-window layer: a query sees itself and the window - 1 keys before."""
    return {} if window is None else {"window_size": (window - 1, 0)}

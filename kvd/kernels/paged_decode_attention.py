"""Paged decode attention: one query token per sequence over its context in the paged KV pool.

GQA: a program takes one (sequence, kv head, split) and all the query heads that share that kv head, so each
K/V tile is loaded once per group. Long contexts are split across programs (flash-decoding): each split writes
its normalized partial output and log-sum-exp, and a second kernel merges the splits. Every shape and the grid
depend on host-side values fixed per batch size only (the context lengths are read on the device), so a CUDA
graph can replay a launch with new block tables and context lengths. Triton is imported on the first launch.
"""

from __future__ import annotations

import functools
import os

import torch

from kvd.kernels.store_kvcache import KernelInputError

BLOCK_N = 64  # context tokens per tile
MAX_SPLITS = 16
# Batch-invariant decoding: every launch has MAX_SPLITS splits and a sequence's split size follows from its own
# context (at least this many tokens), so its partial sums and their merge never depend on the batch.
INVARIANT_SPLIT_TOKENS = 256
# A program's tiles are [16 query rows x 64 tokens x head_dim]: 4 warps cover them, and 2 stages keep the next
# K/V tile's load in flight during this one's dots (decode is bound by those loads, not by the math).
NUM_WARPS = 4
NUM_STAGES = 2


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch definition, one sequence at a time in float32 (`sinks` [heads]: a logit per head in each
    softmax's denominator).

    q [S, heads, head_dim]; kv_cache [2, num_blocks, block_size, kv_heads, head_dim]; block_tables int [S, W];
    context_lens int [S]. Sequence s attends to its first context_lens[s] pool tokens, the last `window` of them
    when given. -> [S, heads, head_dim].
    """
    num_heads, kv_heads, block_size = q.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty_like(q)
    for s, ctx in enumerate(context_lens.tolist()):
        blocks = block_tables[s, : -(-ctx // block_size)].long()
        first = max(0, ctx - window) if window else 0
        kv = kv_cache[:, blocks].flatten(1, 2)[:, first:ctx]
        k, v = kv.float().repeat_interleave(num_heads // kv_heads, 2)
        scores = torch.einsum("hd,chd->hc", q[s].float(), k) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.float()[:, None]), dim=1)
        probs = scores.softmax(-1)[:, : k.shape[0]]
        out[s] = torch.einsum("hc,chd->hd", probs, v).to(q.dtype)
    return out


def default_num_splits(num_seqs: int, max_context_len: int, num_sms: int) -> int:
    """Splits enough for a program per multiprocessor, never more than the longest context has tiles."""
    wanted = -(-num_sms // max(num_seqs, 1))
    tiles = -(-max_context_len // BLOCK_N)
    return max(1, min(MAX_SPLITS, wanted, tiles))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as paged_decode_attention_reference, as Triton kernels; writes into `out` when given.

    A sequence with context length 0 gets zeros (CUDA-graph padding rows should use length 1 instead).
    `batch_invariant`: MAX_SPLITS splits of a size set by each sequence's own context (num_splits is ignored),
    so a sequence's output is bitwise the same whatever else the launch holds. `window`: each sequence attends
    its last `window` tokens only (a sliding-window layer); the blocks before them are not read. `sinks`: float32
    [heads], a logit per head in each softmax's denominator (joined where the splits merge, so there are two at
    least).
    """
    if batch_invariant:
        num_splits = MAX_SPLITS
    if sinks is not None:
        num_splits = max(num_splits, 2)
    _check_inputs(q, kv_cache, block_tables, context_lens, num_splits)
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = num_heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    head_dim_pad = 1 << (head_dim - 1).bit_length()
    if num_splits == 1:
        partial, lse = out, out  # written in place, already normalized; lse is not written
        partial_strides = (out.stride(0), out.stride(1), 0)
    else:
        partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_strides = partial.stride()[:3]
    split_kernel, merge_kernel = _kernels()
    split_kernel[(num_seqs, kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        context_lens,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        *partial_strides,
        kv_cache.stride(0),
        kv_cache.stride(1),
        scale,
        INVARIANT_SPLIT_TOKENS if batch_invariant else 0,
        window or 0,
        GROUP=group,
        GROUP_PAD=max(16, 1 << (group - 1).bit_length()),  # tl.dot wants at least 16 rows
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        KV_HEADS=kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        # On a GPU, 16-bit q/K/V feed tensor cores as they are (fp32 accumulation, probabilities rounded to
        # V's dtype, as flash-attn does); fp32 models compute in full fp32 ("ieee", never tf32). Triton's
        # interpreter computes a bf16 tl.dot wrongly (fp16 rightly), so there bf16 is widened to fp32 first.
        COMPUTE_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreting()),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        merge_kernel[(num_seqs, num_heads)](
            partial,
            lse,
            sinks if sinks is not None else lse,
            out,
            *partial.stride()[:3],
            out.stride(0),
            out.stride(1),
            num_splits=num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=max(2, 1 << (num_splits - 1).bit_length()),
            HAS_SINKS=sinks is not None,
            num_warps=1,  # one [splits, head_dim] tile per program: a single warp covers it
        )
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int,
) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-1] != q.shape[-1]:
        raise KernelInputError(
            f"q {tuple(q.shape)} must be [seqs, heads, head_dim] and kv_cache {tuple(kv_cache.shape)} "
            "[2, num_blocks, block_size, kv_heads, head_dim] with the same head_dim"
        )
    if q.shape[1] % kv_cache.shape[3]:
        raise KernelInputError(
            f"{q.shape[1]} query heads do not group evenly over {kv_cache.shape[3]} kv heads"
        )
    if not kv_cache.is_contiguous() or q.stride(2) != 1:
        raise KernelInputError("kv_cache must be contiguous and q dense in head_dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or block_tables.stride(1) != 1:
        raise KernelInputError(f"block_tables must be a row-major [{q.shape[0]}, max_blocks] tensor")
    if context_lens.shape != (q.shape[0],):
        raise KernelInputError(f"context_lens must be [{q.shape[0]}], got {tuple(context_lens.shape)}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise KernelInputError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        q_ptr,
        cache_ptr,
        table_ptr,
        ctx_ptr,
        out_ptr,
        lse_ptr,
        q_stride_seq,
        q_stride_head,
        table_stride,
        out_stride_seq,
        out_stride_head,
        out_stride_split,
        kv_stride,  # from K's half of the pool to V's
        block_stride,
        scale,
        min_split_tokens,  # 0, or the least tokens a split takes (batch invariance)
        window,  # 0, or the tokens a sliding-window layer sees: the context's last `window`
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        KV_HEADS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        COMPUTE_FP32: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)  # a runtime value: one compiled kernel serves every split count
        ctx = tl.load(ctx_ptr + seq)
        first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
        # Each split takes whole tiles, so only the last tile of a sequence is ragged; with min_split_tokens
        # (batch invariance) the size depends on this sequence alone.
        per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N, min_split_tokens)
        start = first + split * per_split
        end = tl.minimum(start + per_split, ctx)

        rows = tl.arange(0, GROUP_PAD)
        cols = tl.arange(0, HEAD_DIM_PAD)
        heads = kv_head * GROUP + rows
        row_mask = rows < GROUP
        col_mask = cols < HEAD_DIM
        q = tl.load(
            q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if COMPUTE_FP32:
            q = q.to(tl.float32)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for tile in range(start, end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            pos_mask = pos < end
            block = tl.load(table_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=pos_mask, other=0)
            token = block.to(tl.int64) * block_stride + (pos % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM)
            kv_offsets = token[:, None] + kv_head * HEAD_DIM + cols[None, :]
            kv_mask = pos_mask[:, None] & col_mask[None, :]
            k = tl.load(cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if COMPUTE_FP32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = tl.where(pos_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            probs = tl.exp(scores - m_new[:, None])
            rescale = tl.exp(m - m_new)
            denom = denom * rescale + tl.sum(probs, 1)
            v = tl.load(cache_ptr + kv_stride + kv_offsets, mask=kv_mask, other=0.0)
            if COMPUTE_FP32:
                v = v.to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
            m = m_new

        has_tokens = denom > 0  # a split past the end of a short context saw nothing
        partial = tl.where(has_tokens[:, None], acc / tl.where(has_tokens, denom, 1.0)[:, None], 0.0)
        dst = out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + split * out_stride_split
        tl.store(dst + cols[None, :], partial, mask=row_mask[:, None] & col_mask[None, :])
        if num_splits > 1:
            lse = tl.where(has_tokens, m + tl.log(tl.where(has_tokens, denom, 1.0)), float("-inf"))
            tl.store(lse_ptr + (seq * KV_HEADS * GROUP + heads) * num_splits + split, lse, mask=row_mask)

    @triton.jit
    def merge_kernel(
        partial_ptr,
        lse_ptr,
        sinks_ptr,  # float32 [heads]: each head's sink logit, read only with HAS_SINKS
        out_ptr,
        partial_stride_seq,
        partial_stride_head,
        partial_stride_split,
        out_stride_seq,
        out_stride_head,
        num_splits,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        cols = tl.arange(0, HEAD_DIM_PAD)
        split_mask = splits < num_splits
        lse_row = (
            lse_ptr + (seq * tl.num_programs(1) + head) * num_splits
        )  # lse is a dense [S, heads, splits]
        lse = tl.load(lse_row + splits, mask=split_mask, other=float("-inf"))
        top = tl.max(lse, 0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head)
            top = tl.maximum(top, sink)
        weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(weights, 0)
        if HAS_SINKS:
            total += tl.exp(sink - top)
        partial = tl.load(
            partial_ptr
            + seq * partial_stride_seq
            + head * partial_stride_head
            + splits[:, None] * partial_stride_split
            + cols[None, :],
            mask=split_mask[:, None] & (cols < HEAD_DIM)[None, :],
            other=0.0,
        )
        merged = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
        dst = out_ptr + seq * out_stride_seq + head * out_stride_head + cols
        tl.store(dst, merged, mask=cols < HEAD_DIM)

    return split_kernel, merge_kernel

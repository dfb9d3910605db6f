"""Grouped expert matmuls for a mixture of experts on the GPU (Triton): one launch multiplies every chosen
(token, expert) row by its expert's weight, the rows grouped by expert so each expert's weight tiles are read once
for all of its rows (the CUDA counterpart of kvd_moe_forward's grouping on the CPU).

The rows are the step's (token, slot) pairs, slot s of token t being row t x top_k + s. `plan_rows` lays them out
by expert in blocks of BLOCK_M rows (each expert's rows padded to whole blocks, -1 marking padding), with the expert
of each block, using device ops alone: the grid depends only on the number of rows and experts, so no host sync and
nothing a CUDA graph could not replay. A program computes BLOCK_M rows x BLOCK_N outputs of one expert, summing k in
BLOCK_K tiles in one order; every row's outputs come from its own row of inputs and its expert's weight alone, in
tiles whose sizes never depend on the batch, so a token's result is the same whatever shares its experts (batch
invariance). Triton is imported on the first launch.
"""

from __future__ import annotations

import functools

import torch

from kvd.kernels.store_kvcache import KernelInputError

BLOCK_M = 16  # rows a program: an expert's rows are padded to whole blocks of it
BLOCK_N = 64
BLOCK_K = 32


def plan_rows(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded_rows int32 [P], block_expert int32 [P / BLOCK_M]) for expert ids [T, top_k]: the rows t x top_k + s
    grouped by expert (in row order within one), each expert's run padded with -1 to whole blocks, then unused blocks
    (expert num_experts). P = T x top_k + num_experts x (BLOCK_M - 1), rounded up to whole blocks."""
    flat = ids.flatten()
    rows = flat.numel()
    capacity = -(-(rows + num_experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, in row order within one
    expert_start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(rows, device=ids.device) - expert_start[sorted_experts]
    padded_rows = torch.full((capacity,), -1, dtype=torch.int32, device=ids.device)
    padded_rows[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_first = torch.arange(0, capacity, BLOCK_M, device=ids.device)
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), block_first, right=True)
    return padded_rows, block_expert.to(torch.int32)


def grouped_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, per_token: bool
) -> torch.Tensor:
    """The torch definition: row r = t x top_k + s of the output is x[t] (per_token) or x[r] times expert
    ids[t, s]'s weight [N, K] transposed, plus its bias [N]; in float32, rounded to x's dtype."""
    top_k = ids.shape[1]
    out = torch.empty(ids.numel(), weight.shape[1], dtype=x.dtype, device=x.device)
    for r, e in enumerate(ids.flatten().tolist()):
        row = x[r // top_k if per_token else r].float() @ weight[e].float().T
        out[r] = (row if bias is None else row + bias[e].float()).to(x.dtype)
    return out


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor],
    per_token: bool,
) -> torch.Tensor:
    """Same result as grouped_linear_reference for the experts' weights [E, N, K] (biases [E, N] or None), the rows
    laid out by `plan` (plan_rows(ids, E)); x [T, K] (per_token: every slot of a token reads its row) or [T x top_k,
    K]. -> [T x top_k, N] in x's dtype."""
    _check_inputs(x, weight, bias, ids, per_token)
    num_experts, n, k = weight.shape
    rows, top_k = ids.numel(), ids.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    padded_rows, block_expert = plan
    if rows == 0:
        return out
    grid = (block_expert.numel(), -(-n // BLOCK_N))
    _kernel()[grid](
        x,
        weight,
        bias if bias is not None else weight,  # not read without HAS_BIAS
        out,
        padded_rows,
        block_expert,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        NUM_EXPERTS=num_experts,
        ROW_DIVISOR=top_k if per_token else 1,
        HAS_BIAS=bias is not None,
        FLOAT32=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, per_token: bool
) -> None:
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise KernelInputError(
            f"x must be [rows, K] and the weights [experts, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if ids.dim() != 2 or x.shape[0] != (ids.shape[0] if per_token else ids.numel()):
        raise KernelInputError(
            f"x has {x.shape[0]} rows for expert ids {tuple(ids.shape)} (per_token={per_token})"
        )
    if bias is not None and bias.shape != weight.shape[:2]:
        raise KernelInputError(f"biases {tuple(bias.shape)} are not [experts, N] = {tuple(weight.shape[:2])}")
    if x.stride(1) != 1 or weight.stride(2) != 1 or x.dtype != weight.dtype:
        raise KernelInputError("x and the weights must be row-contiguous and of one dtype")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_linear_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        rows_ptr,
        block_expert_ptr,
        N,
        K,
        x_stride,
        w_expert_stride,
        w_row_stride,
        out_stride,
        NUM_EXPERTS: tl.constexpr,
        ROW_DIVISOR: tl.constexpr,  # the row of x a (token, slot) row reads: row // ROW_DIVISOR
        HAS_BIAS: tl.constexpr,
        FLOAT32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < NUM_EXPERTS:
            rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
            valid = rows >= 0
            inputs = tl.where(valid, rows // ROW_DIVISOR, 0)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_base = w_ptr + expert.to(tl.int64) * w_expert_stride
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(
                    x_ptr + inputs.to(tl.int64)[:, None] * x_stride + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K),
                    other=0.0,
                )
                w = tl.load(
                    w_base + cols[None, :] * w_row_stride + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K),
                    other=0.0,
                )
                if FLOAT32:  # float32 weights multiply in float32 (tl.dot's default would round them to tf32)
                    acc += tl.dot(a, w, input_precision="ieee")
                else:
                    acc += tl.dot(a, w)
            if HAS_BIAS:
                acc += tl.load(b_ptr + expert * N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))

    return grouped_linear_kernel

"""store_kvcache: write each new token's K and V into its slot of a layer's paged pool; slot -1 is skipped.

The pool is the layer's [2, num_blocks, block_size, kv_heads, head_dim] tensor, so slot = block * block_size +
offset addresses one [kv_heads, head_dim] row of K (and of V). Triton is imported on the first launch only.
"""

from __future__ import annotations

import functools

import torch


class KernelInputError(ValueError):
    """Tensors handed to a kernel do not have the shapes, dtypes or layout it needs; the message says which."""


def store_kvcache_reference(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The torch definition: k, v [T, kv_heads, head_dim] land at kv_cache's slots slot_mapping [T]."""
    valid = slot_mapping >= 0
    slots = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    slots[0, slot_mapping[valid]] = k[valid]
    slots[1, slot_mapping[valid]] = v[valid]


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same result as store_kvcache_reference, one Triton program per token (no host sync: graph-safe)."""
    _check_inputs(k, v, kv_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    width = num_heads * head_dim
    _kernel()[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(0),
        WIDTH=width,
        BLOCK=1 << (width - 1).bit_length(),  # tl.arange needs a power of two
    )


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise KernelInputError(
            f"k and v must both be [tokens, kv_heads, head_dim], got {k.shape} and {v.shape}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-2:] != k.shape[1:]:
        raise KernelInputError(
            f"kv_cache {tuple(kv_cache.shape)} is not [2, num_blocks, block_size, {k.shape[1]}, {k.shape[2]}]"
        )
    if not kv_cache.is_contiguous():
        raise KernelInputError("kv_cache must be contiguous (allocate it with allocate_kv_cache)")
    # Rows may be strided (k and v are slices of the fused qkv projection), each row itself must be dense.
    for name, x in (("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise KernelInputError(f"each token's {name} must be a dense [kv_heads, head_dim] block")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.long:
        raise KernelInputError(
            f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
        raise KernelInputError(f"k/v dtype {k.dtype} differs from the pool's {kv_cache.dtype}")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def store_kvcache_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
        k_stride,
        v_stride,
        kv_stride,  # elements from K's half of the pool to V's
        WIDTH: tl.constexpr,  # kv_heads * head_dim
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            cols = tl.arange(0, BLOCK)
            mask = cols < WIDTH
            dst = cache_ptr + slot * WIDTH + cols
            tl.store(dst, tl.load(k_ptr + token * k_stride + cols, mask=mask), mask=mask)
            tl.store(dst + kv_stride, tl.load(v_ptr + token * v_stride + cols, mask=mask), mask=mask)

    return store_kvcache_kernel

"""The Triton kernels against their torch references: on CUDA when there is one, else in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first built, on first launch
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

from kvd.kernels.paged_decode_attention import (  # noqa: E402
    BLOCK_N,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kvd.kernels.store_kvcache import KernelInputError, store_kvcache, store_kvcache_reference  # noqa: E402

# (query heads, kv heads): GQA ratios 1, 3 and 8.
HEADS = {"ratio1": (4, 4), "ratio3": (6, 2), "ratio8": (8, 1)}


def random_tables(
    context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator, extra_columns: int = 2
) -> torch.Tensor:
    """Disjoint shuffled block tables, padded with valid but foreign block ids that must never be read."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-c // block_size) for c in context_lens) + extra_columns
    tables = torch.full((len(context_lens), width), perm[-1], dtype=torch.int32)
    for s, ctx in enumerate(context_lens):
        n = -(-ctx // block_size)
        tables[s, :n] = torch.tensor([perm.pop(0) for _ in range(n)], dtype=torch.int32)
    return tables


def fused_slices(num_tokens: int, num_heads: int, kv_heads: int, head_dim: int, dtype, gen) -> tuple:
    """q, k, v as the model hands them over: strided slices of one fused [T, heads + 2 kv_heads, D] tensor."""
    fused = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return fused.split([num_heads, kv_heads, kv_heads], dim=1)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (3, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kvcache_matches_reference(block_size, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(block_size + kv_heads)
    num_blocks, num_tokens = 6, 37
    _, k, v = fused_slices(num_tokens, 2, kv_heads, head_dim, dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows: not written
    slots = slots.to(DEVICE)
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    expected = pool.clone()
    store_kvcache_reference(k, v, expected, slots)
    store_kvcache(k, v, pool, slots)
    assert torch.equal(pool, expected)
    assert not torch.equal(expected, pool.new_zeros(pool.shape))


def test_store_kvcache_rejects_mismatched_pool():
    k = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(KernelInputError, match="kv_cache"):
        store_kvcache(k, k, torch.zeros(2, 4, 16, 2, 32, device=DEVICE), torch.zeros(3, dtype=torch.long))
    with pytest.raises(KernelInputError, match="slot_mapping"):
        store_kvcache(k, k, torch.zeros(2, 4, 16, 2, 64, device=DEVICE), torch.zeros(3, dtype=torch.int32))


def contexts_for(block_size: int) -> list[int]:
    """One token, just under, at and just over block boundaries, and a few blocks long."""
    return [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_paged_decode_matches_reference(heads, head_dim, block_size):
    num_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(num_heads * head_dim + block_size)
    context_lens = contexts_for(block_size)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    tables = random_tables(context_lens, block_size, num_blocks, gen).to(DEVICE)
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    q, _, _ = fused_slices(len(context_lens), num_heads, kv_heads, head_dim, torch.float32, gen)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = paged_decode_attention_reference(q, pool, tables, lens, scale)
    # Splits of a few tiles each, and more splits than the short contexts have tiles (empty splits).
    for num_splits in (1, 3):
        out = paged_decode_attention(q, pool, tables, lens, scale, num_splits=num_splits)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=f"num_splits={num_splits}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_decode_half_precision(dtype):
    """16-bit dots as on the GPU (fp16 in the interpreter too; its bf16 tl.dot is wrong, so bf16 is widened)."""
    gen = torch.Generator().manual_seed(7)
    context_lens = [3, 40, 100]
    tables = random_tables(context_lens, 16, 16, gen).to(DEVICE)
    pool = torch.randn(2, 16, 16, 2, 64, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(3, 6, 64, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, pool, tables, lens, 0.125, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.float(),
        paged_decode_attention_reference(q, pool, tables, lens, 0.125).float(),
        rtol=2e-2,
        atol=2e-2,
    )


def test_paged_decode_zero_context_gives_zeros_and_leaves_other_rows_alone():
    gen = torch.Generator().manual_seed(3)
    tables = random_tables([20, 1], 16, 8, gen).to(DEVICE)
    pool = torch.randn(2, 8, 16, 2, 64, generator=gen).to(DEVICE)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    for num_splits in (1, 2):
        alone = paged_decode_attention(
            q[:1], pool, tables[:1], torch.tensor([20], dtype=torch.int32, device=DEVICE), 0.1
        )
        lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
        out = paged_decode_attention(q, pool, tables, lens, 0.1, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[:1], alone, rtol=1e-5, atol=1e-5)


def test_batch_invariant_decode_gives_each_sequence_the_same_bits_in_any_batch():
    """Split sizes follow each sequence's own context: alone, or beside any others, the same output bits."""
    gen = torch.Generator().manual_seed(11)
    context_lens = [700, 5, 64, 1500, 300]  # one split for short contexts, several for long ones
    num_blocks = sum(-(-c // 16) for c in context_lens) + 2
    tables = random_tables(context_lens, 16, num_blocks, gen).to(DEVICE)
    pool = torch.randn(2, num_blocks, 16, 2, 64, generator=gen).to(DEVICE)
    q = torch.randn(len(context_lens), 6, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    batched = paged_decode_attention(q, pool, tables, lens, 0.125, batch_invariant=True)
    torch.testing.assert_close(batched, paged_decode_attention_reference(q, pool, tables, lens, 0.125))
    for s in range(len(context_lens)):
        one = slice(s, s + 1)
        alone = paged_decode_attention(q[one], pool, tables[one], lens[one], 0.125, batch_invariant=True)
        assert torch.equal(alone, batched[one]), f"sequence {s} (context {context_lens[s]})"
        pair = [s, (s + 1) % len(context_lens)]
        beside = paged_decode_attention(q[pair], pool, tables[pair], lens[pair], 0.125, batch_invariant=True)
        assert torch.equal(beside[:1], batched[one])


def test_paged_decode_writes_into_out():
    gen = torch.Generator().manual_seed(5)
    tables = random_tables([30], 16, 4, gen).to(DEVICE)
    pool = torch.randn(2, 4, 16, 1, 64, generator=gen).to(DEVICE)
    q = torch.randn(1, 2, 64, generator=gen).to(DEVICE)
    lens = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    assert paged_decode_attention(q, pool, tables, lens, 0.125, out=out) is out
    torch.testing.assert_close(out, paged_decode_attention_reference(q, pool, tables, lens, 0.125))


def test_paged_decode_rejects_bad_inputs():
    q = torch.zeros(2, 6, 64, device=DEVICE)
    pool = torch.zeros(2, 4, 16, 4, 64, device=DEVICE)
    tables = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(KernelInputError, match="group evenly"):
        paged_decode_attention(q, pool, tables, lens, 1.0)
    with pytest.raises(KernelInputError, match="num_splits"):
        paged_decode_attention(q[:, :4], pool, tables, lens, 1.0, num_splits=0)


def test_default_num_splits():
    assert default_num_splits(num_seqs=1, max_context_len=10 * BLOCK_N, num_sms=132) == 10  # capped by tiles
    assert default_num_splits(num_seqs=1, max_context_len=10_000, num_sms=132) == 16  # capped by MAX_SPLITS
    assert default_num_splits(num_seqs=64, max_context_len=10_000, num_sms=132) == 3
    assert default_num_splits(num_seqs=256, max_context_len=10_000, num_sms=132) == 1
    assert default_num_splits(num_seqs=4, max_context_len=1, num_sms=132) == 1

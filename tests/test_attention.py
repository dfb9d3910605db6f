"""The torch and native (CPU kernels) attention backends against a dense per-sequence reference, over every batch
shape they plan for."""

from __future__ import annotations

import random

import pytest
import torch

from kvd.model.layers.attention import AttentionMetadataError, build_attention_metadata
from kvd.model.layers.attention.native_attention import NativeAttentionBackend
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 8


def reference(q, keys, values, context_len, scale):
    """Dense causal attention of one sequence's last q.shape[0] tokens over keys/values [context_len, kv, d]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("qhd,hkd->hqk", q.float(), k.float()) * scale
    positions = torch.arange(context_len - q.shape[0], context_len)
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v.float())


BACKENDS = {
    "one_gather": lambda: TorchAttentionBackend(),
    "gather_per_sequence": lambda: TorchAttentionBackend(gather_chunk_bytes=1),
    "native": lambda: NativeAttentionBackend(),
}


def run_case(
    seqs, num_heads=4, num_kv_heads=2, dtype=torch.float32, seed=0, slot_override=None, backend="native"
):
    """seqs: list of (cached_len, new_len). Returns (backend output, reference output, pool, metadata, data)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    pool = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=dtype)
    flat = pool.view(2, -1, num_kv_heads, HEAD_DIM)
    tables, qs, ks, vs, full_k, full_v = [], [], [], [], [], []
    for cached, new in seqs:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)])
        k = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        flat[0, slots[:cached]] = k[:cached]  # the cached prefix is already in the pool
        flat[1, slots[:cached]] = v[:cached]
        tables.append(table)
        qs.append(torch.randn(new, num_heads, HEAD_DIM, generator=gen).to(dtype))
        ks.append(k[cached:])
        vs.append(v[cached:])
        full_k.append(k)
        full_v.append(v)
    backend = BACKENDS[backend]()
    attn = build_attention_metadata(
        tables, [c + n for c, n in seqs], [n for _, n in seqs], BLOCK_SIZE, "cpu", backend, slot_override
    )
    scale = HEAD_DIM**-0.5
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), pool, attn, scale)
    expected = torch.cat(
        [reference(q, k, v, k.shape[0], scale) for q, k, v in zip(qs, full_k, full_v, strict=True)]
    )
    return out, expected, pool, attn, (torch.cat(ks), torch.cat(vs))


CASES = {
    "decode": [(7, 1), (12, 1), (0, 1), (30, 1)],
    "decode_equal_contexts": [(6, 1), (6, 1), (6, 1)],  # no mask needed
    "single_prefill": [(0, 13)],
    "equal_prefills": [(0, 6), (0, 6), (0, 6)],
    "varlen_prefills": [(0, 3), (0, 17), (0, 9)],
    "prefill_over_cached_prefix": [(8, 5)],
    "chunks_over_cached_parts": [(8, 5), (5, 11), (0, 7)],
    "mixed": [(9, 1), (0, 6), (4, 1), (12, 7), (0, 2)],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_dense_reference(case, heads, backend):
    """gather_per_sequence: the torch decode path gathers and attends one sequence at a time; native reads the
    pool in place."""
    out, expected, *_ = run_case(CASES[case], *heads, backend=backend)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["one_gather", "native"])
def test_new_kv_lands_in_the_mapped_slots(backend):
    _, _, pool, attn, (k, v) = run_case(CASES["mixed"], backend=backend)
    flat = pool.view(2, -1, *pool.shape[-2:])
    assert torch.equal(flat[0, attn.slot_mapping], k)
    assert torch.equal(flat[1, attn.slot_mapping], v)


@pytest.mark.parametrize("backend", ["one_gather", "native"])
def test_slot_minus_one_is_not_written(backend):
    seqs = [(0, 6)]
    slots = run_case(seqs)[3].slot_mapping.tolist()
    _, _, pool, attn, (k, _) = run_case(seqs, slot_override=[*slots[:2], -1, *slots[3:]], backend=backend)
    flat = pool.view(2, -1, *pool.shape[-2:])
    assert torch.count_nonzero(flat[:, slots[2]]) == 0
    written = [r for r in range(6) if r != 2]
    assert torch.equal(flat[0, attn.slot_mapping[written]], k[written])


@pytest.mark.parametrize("backend", ["one_gather", "native"])
def test_bfloat16_close_to_float32_reference(backend):
    out, expected, *_ = run_case(CASES["mixed"], dtype=torch.bfloat16, backend=backend)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_plan_uses_fast_paths():
    """Pure decode and uniform prefill batches need no row shuffling; cached prefixes need a gather."""
    decode = run_case(CASES["decode_equal_contexts"], backend="one_gather")[3]
    assert decode.prefill is None and decode.decode.rows is None and decode.decode.gather.visible is None
    prefill = run_case(CASES["equal_prefills"], backend="one_gather")[3]
    assert prefill.decode is None and prefill.prefill.pad_index is None and prefill.prefill.gather is None
    cached = run_case(CASES["prefill_over_cached_prefix"], backend="one_gather")[3]
    assert cached.prefill.gather is not None


@pytest.mark.parametrize(
    ("tables", "context_lens", "query_lens", "match"),
    [
        ([[0]], [3, 4], [1], "one per sequence"),
        ([[0]], [3], [4], "query length"),
        ([[0]], [3], [0], "query length"),
        ([[0]], [6], [1], "needs 2 blocks"),
    ],
)
def test_invalid_steps_raise(tables, context_lens, query_lens, match):
    with pytest.raises(AttentionMetadataError, match=match):
        build_attention_metadata(tables, context_lens, query_lens, BLOCK_SIZE, "cpu")


def test_host_to_device_keeps_values_and_dtype_on_cpu():
    from kvd.model.layers.attention import host_to_device

    out = host_to_device([[3, 1], [2, 7]], torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [[3, 1], [2, 7]]

"""The GPU path, checked on CPU: backend selection, the triton and flash-attn backends against the torch one,
CUDA-graph batch padding, compiled hot paths and KV sizing. Without CUDA, Triton runs in its interpreter
(TRITON_INTERPRET=1, set before triton is first used); with CUDA everything runs there. flash-attn, which a CPU
host cannot install, is stood in for by torch implementations of the documented contract of its two functions
(and, on a CUDA host that has it, checked for real as well).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before triton is first used: kernels built in this process interpret
    os.environ.setdefault("TRITON_INTERPRET", "1")

from greedy_helper import greedy_generate

from kvd.engine.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphRunner,
    capture_sizes,
    padded_batch_size,
)
from kvd.engine.gpu_memory import (
    RUNTIME_RESERVE_BYTES,
    DeviceMemory,
    kv_cache_budget,
    profile_steps,
    run_profile_step,
)
from kvd.kernels.paged_decode_attention import paged_decode_attention_reference
from kvd.model.layers.attention import build_attention_metadata, selector
from kvd.model.layers.attention.flash_attention import (
    FlashAttentionBackend,
    FlashAttentionMetadata,
    FlashAttnOps,
    load_flash_attn_ops,
)
from kvd.model.layers.attention.native_attention import NativeAttentionBackend
from kvd.model.layers.attention.selector import (
    AttentionBackendError,
    AttentionBackendUnavailableError,
    resolve_backend_name,
    resolve_block_size,
    select_attention_backend,
)
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend
from kvd.model.layers.attention.triton_attention import TritonAttentionBackend
from kvd.model.layers.kv_cache import KVGroups, allocate_kv_cache
from kvd.model.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
CUDA = torch.device("cuda")  # for selection, which is pure logic: no CUDA call is made
CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def installed(monkeypatch):
    """installed({"triton", ...}): pretend exactly these optional packages are importable."""

    def set_packages(names: set[str]) -> None:
        monkeypatch.setattr(selector, "_installed", lambda package: package in names)

    return set_packages


@pytest.mark.parametrize(
    ("packages", "device", "dtype", "expected"),
    [
        ({"triton", "flash_attn"}, CPU, torch.bfloat16, "native"),
        (set(), CPU, torch.float32, "native"),
        (set(), CPU, torch.float16, "torch"),  # the native kernels take float32 and bfloat16
        ({"triton", "flash_attn"}, CUDA, torch.bfloat16, "flash-attn"),
        ({"triton", "flash_attn"}, CUDA, torch.float16, "flash-attn"),
        ({"triton", "flash_attn"}, CUDA, torch.float32, "triton"),  # flash-attn has no fp32
        ({"triton"}, CUDA, torch.bfloat16, "triton"),
        (set(), CUDA, torch.bfloat16, "torch"),
    ],
)
def test_auto_picks_the_best_available(installed, packages, device, dtype, expected):
    installed(packages)
    assert resolve_backend_name("auto", device, dtype) == expected


def test_flash_attn_is_not_picked_for_heads_wider_than_it_takes(installed):
    """Gemma 4's full layers have heads of 512 values; flash-attn 2 takes up to 256."""
    installed({"flash_attn", "triton"})
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 256) == "flash-attn"
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 512) == "triton"
    with pytest.raises(AttentionBackendError, match="heads of up to 256 values; this model has 512"):
        resolve_backend_name("flash-attn", CUDA, torch.bfloat16, 512)


def test_explicit_backends_that_cannot_run_say_why(installed, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    installed({"triton"})
    assert resolve_backend_name("torch", CUDA, torch.float32) == "torch"
    assert resolve_backend_name("triton", CUDA, torch.float32) == "triton"
    with pytest.raises(AttentionBackendError, match="runs on CUDA"):
        resolve_backend_name("triton", CPU, torch.float32)
    with pytest.raises(AttentionBackendUnavailableError, match="pip install flash-attn"):
        resolve_backend_name("flash-attn", CUDA, torch.bfloat16)
    with pytest.raises(AttentionBackendError, match="float16 or bfloat16"):
        resolve_backend_name("flash-attn", CUDA, torch.float32)
    with pytest.raises(AttentionBackendError, match="runs on CUDA"):
        resolve_backend_name("flash-attn", CPU, torch.bfloat16)
    with pytest.raises(AttentionBackendError, match="unknown attention backend 'flash'"):
        resolve_backend_name("flash", CUDA, torch.bfloat16)
    installed(set())
    with pytest.raises(AttentionBackendUnavailableError, match="pip install triton"):
        resolve_backend_name("triton", CUDA, torch.float32)


def test_triton_runs_on_cpu_only_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    selection = select_attention_backend("triton", CPU, torch.float32)
    assert isinstance(selection.backend, TritonAttentionBackend) and selection.block_size == 16
    assert isinstance(select_attention_backend("auto", CPU, torch.float32).backend, NativeAttentionBackend)


def test_native_backend_runs_on_the_cpu_only(monkeypatch):
    assert isinstance(select_attention_backend("native", CPU, torch.bfloat16).backend, NativeAttentionBackend)
    with pytest.raises(AttentionBackendError, match="on the CPU in float32 or bfloat16"):
        resolve_backend_name("native", CUDA, torch.float32)
    with pytest.raises(AttentionBackendError, match="on the CPU in float32 or bfloat16"):
        resolve_backend_name("native", CPU, torch.float16)
    monkeypatch.setattr(selector.cpu_native, "available", lambda: False)  # as on a host without a C compiler
    assert resolve_backend_name("auto", CPU, torch.float32) == "torch"
    with pytest.raises(AttentionBackendUnavailableError, match="C compiler"):
        resolve_backend_name("native", CPU, torch.float32)


def test_the_cli_offers_every_backend():
    from kvd.engine.engine_args import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == selector.BACKEND_NAMES


def test_block_size_defaults_and_rules():
    assert [resolve_block_size(n, None) for n in ("torch", "native", "triton", "flash-attn")] == [
        16,
        16,
        16,
        256,
    ]
    assert resolve_block_size("flash-attn", 512) == 512
    assert resolve_block_size("torch", 4) == 4
    with pytest.raises(AttentionBackendError, match="multiple of 256"):
        resolve_block_size("flash-attn", 16)
    with pytest.raises(AttentionBackendError, match="positive"):
        resolve_block_size("triton", 0)


def test_flash_attn_backend_imports_lazily_with_a_clear_error():
    if selector._installed("flash_attn"):  # a GPU host with flash-attn: the real functions load
        assert FlashAttentionBackend().ops.varlen.__name__ == "flash_attn_varlen_func"
    else:
        with pytest.raises(AttentionBackendUnavailableError, match="pip install flash-attn"):
            FlashAttentionBackend()


# ---------------------------------------------------------------------------------------------------------------
# Backends against the torch one, on the same batch and pool
# ---------------------------------------------------------------------------------------------------------------


def dense_attention(q, keys, values, scale, window=None, sinks=None):
    """q [n, H, D] = the last n of keys/values' [ctx, KV, D] positions, causal (each query seeing its last
    `window` positions when given; `sinks` [H]: a logit per head in the softmax, with no value); float32."""
    group = q.shape[1] // keys.shape[1]
    k, v = (x.float().repeat_interleave(group, 1) for x in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    ctx, n = keys.shape[0], q.shape[0]
    positions = torch.arange(ctx, device=q.device)
    hidden = positions[None, :] > positions[ctx - n :, None]
    if window is not None:
        hidden |= positions[None, :] <= positions[ctx - n :, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float()[:, None, None].expand(-1, n, 1)), dim=-1)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :ctx], v)


def gather_paged(cache, table, length):
    """A sequence's first `length` rows of a [num_blocks, page, KV, D] cache."""
    page = cache.shape[1]
    return cache[table[: -(-length // page)].long()].flatten(0, 1)[:length]


def check_flash_args(k_cache, block_table, *int32_tensors):
    """flash-attn's documented requirements on the paged cache and index tensors."""
    assert k_cache.dim() == 4 and k_cache.shape[1] % 256 == 0, "paged KV: [num_blocks, 256k, kv_heads, d]"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert all(t.dtype == torch.int32 for t in int32_tensors)


def flash_varlen_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    block_table=None,
    window_size=(-1, -1),
):
    """flash_attn_varlen_func with a paged cache: causal masks align each sequence's queries to its keys' end."""
    check_flash_args(k, block_table, cu_seqlens_q, cu_seqlens_k)
    assert causal
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in itertools.pairwise(starts_q))
    assert max_seqlen_k == max(b - a for a, b in itertools.pairwise(starts_k))
    for s in range(len(starts_q) - 1):
        length = starts_k[s + 1] - starts_k[s]
        keys, values = gather_paged(k, block_table[s], length), gather_paged(v, block_table[s], length)
        rows = slice(starts_q[s], starts_q[s + 1])
        window = None if window_size[0] < 0 else window_size[0] + 1
        out[rows] = dense_attention(q[rows], keys, values, softmax_scale, window).to(q.dtype)
    return out


def flash_with_kvcache_reference(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    num_splits=0,
    window_size=(-1, -1),
):
    """flash_attn_with_kvcache over a paged cache for one new token per sequence: q [B, 1, H, D]."""
    check_flash_args(k_cache, block_table, cache_seqlens)
    assert num_splits == 1  # batch invariance: no split count chosen by batch size
    assert q.dim() == 4 and q.shape[1] == 1
    pool = torch.stack((k_cache, v_cache))
    window = None if window_size[0] < 0 else window_size[0] + 1
    return paged_decode_attention_reference(q[:, 0], pool, block_table, cache_seqlens, softmax_scale, window)[
        :, None
    ]


REFERENCE_FLASH_OPS = FlashAttnOps(flash_varlen_reference, flash_with_kvcache_reference)

# (cached tokens, new tokens) per sequence
BATCHES = {
    "decode": [(7, 1), (40, 1), (0, 1), (300, 1)],
    "prefill": [(0, 13), (0, 5)],
    "prefill_over_cached_prefix": [(16, 9), (3, 30)],
    "mixed": [(9, 1), (0, 6), (260, 1), (20, 7)],
}


def make_batch(seqs, block_size, num_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    """A pool holding each sequence's cached prefix, and the step's q/k/v and block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    pool = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    flat = pool.view(2, -1, num_kv_heads, head_dim)
    tables = []
    for cached, new in seqs:
        table = [perm.pop() for _ in range(-(-(cached + new) // block_size))]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached)]
        flat[:, slots] = torch.randn(2, cached, num_kv_heads, head_dim, generator=gen).to(dtype)
        tables.append(table)
    total = sum(n for _, n in seqs)
    fused = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = fused.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return pool.to(DEVICE), tables, (q, k, v)


def run_backend(backend, seqs, block_size, pool, tables, qkv, window=None, sinks=None):
    """The backend over one step; with a window, a sliding layer's attention."""
    pool = pool.clone()
    groups = KVGroups((), (), (window,))  # every layer in one group with this window
    attn = build_attention_metadata(
        tables, [c + n for c, n in seqs], [n for _, n in seqs], block_size, DEVICE, backend, kv_groups=groups
    )
    return backend.forward(*qkv, pool, attn, 0.25, sinks), pool, attn


WINDOWS = [None, 5, 24]  # none; narrower than any prompt here; wider than some contexts, narrower than others
SINKS = torch.linspace(-2.0, 5.0, 6, device=DEVICE)  # the batches' six query heads' sink logits


@pytest.mark.parametrize(("window", "sinks"), [(w, None) for w in WINDOWS] + [(None, SINKS), (5, SINKS)])
@pytest.mark.parametrize("batch", BATCHES)
def test_torch_backend_matches_dense_attention(batch, window, sinks):
    seqs = BATCHES[batch]
    pool, tables, qkv = make_batch(seqs, 16)
    out, out_pool, _ = run_backend(TorchAttentionBackend(), seqs, 16, pool, tables, qkv, window, sinks)
    k_cache, v_cache = out_pool[0], out_pool[1]
    row = 0
    for (cached, new), table in zip(seqs, tables, strict=True):
        table = torch.tensor(table)
        keys, values = gather_paged(k_cache, table, cached + new), gather_paged(v_cache, table, cached + new)
        want = dense_attention(qkv[0][row : row + new], keys, values, 0.25, window, sinks)
        torch.testing.assert_close(out[row : row + new].float(), want, rtol=1e-5, atol=1e-5)
        row += new


@pytest.mark.parametrize(("window", "sinks"), [(w, None) for w in WINDOWS] + [(None, SINKS), (5, SINKS)])
@pytest.mark.parametrize("batch", BATCHES)
def test_triton_backend_matches_torch_backend(batch, window, sinks):
    seqs = BATCHES[batch]
    pool, tables, qkv = make_batch(seqs, 16)
    expected, expected_pool, _ = run_backend(
        TorchAttentionBackend(), seqs, 16, pool, tables, qkv, window, sinks
    )
    out, out_pool, attn = run_backend(TritonAttentionBackend(), seqs, 16, pool, tables, qkv, window, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(out_pool, expected_pool)
    assert (attn.decode is not None) == any(n == 1 for _, n in seqs)
    assert (attn.prefill is not None) == any(n > 1 for _, n in seqs)


def flash_variants() -> dict[str, tuple[FlashAttnOps, torch.dtype, float]]:
    """name -> (ops, dtype, tolerance): the stand-ins everywhere, the real flash-attn where it runs."""
    variants = {"reference": (REFERENCE_FLASH_OPS, torch.float32, 1e-4)}
    if DEVICE.type == "cuda" and selector._installed("flash_attn"):
        variants["flash_attn"] = (load_flash_attn_ops(), torch.bfloat16, 2e-2)
    return variants


FLASH_VARIANTS = flash_variants()


@pytest.mark.parametrize("variant", FLASH_VARIANTS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("batch", BATCHES)
def test_flash_backend_matches_torch_backend(batch, window, variant):
    ops, dtype, tol = FLASH_VARIANTS[variant]
    seqs = BATCHES[batch]
    pool, tables, qkv = make_batch(seqs, 256, dtype=dtype)
    expected, expected_pool, torch_attn = run_backend(
        TorchAttentionBackend(), seqs, 256, pool, tables, qkv, window
    )
    out, out_pool, attn = run_backend(FlashAttentionBackend(ops), seqs, 256, pool, tables, qkv, window)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert torch.equal(out_pool, expected_pool)
    # The same batch yields the same shared metadata, plus the cumulative key lengths flash-attn takes.
    assert isinstance(attn, FlashAttentionMetadata)
    for field in ("slot_mapping", "block_tables", "context_lens", "query_start_loc"):
        assert torch.equal(getattr(attn, field), getattr(torch_attn, field)), field
    assert (attn.max_query_len, attn.max_context_len) == (
        torch_attn.max_query_len,
        torch_attn.max_context_len,
    )
    assert attn.cu_seqlens_k.tolist() == [0, *torch.tensor([c + n for c, n in seqs]).cumsum(0).tolist()]
    assert attn.is_decode == all(n == 1 for _, n in seqs)


def test_flash_backend_refuses_attention_sinks_naming_the_backend_that_has_them():
    seqs = BATCHES["decode"]
    pool, tables, qkv = make_batch(seqs, 256)
    with pytest.raises(AttentionBackendError, match=r"no attention sinks.*--attention-backend triton"):
        run_backend(FlashAttentionBackend(REFERENCE_FLASH_OPS), seqs, 256, pool, tables, qkv, sinks=SINKS)


def test_flash_backend_rejects_small_blocks():
    with pytest.raises(AttentionBackendError, match="multiple of 256"):
        build_attention_metadata([[0]], [3], [3], 16, DEVICE, FlashAttentionBackend(REFERENCE_FLASH_OPS))


def test_backends_reject_foreign_metadata():
    pool, tables, qkv = make_batch(BATCHES["decode"], 16)
    torch_attn = build_attention_metadata(tables, [8, 41, 1, 301], [1] * 4, 16, DEVICE)
    for backend in (TritonAttentionBackend(), FlashAttentionBackend(REFERENCE_FLASH_OPS)):
        with pytest.raises(TypeError, match="build_attention_metadata"):
            backend.forward(*qkv, pool, torch_attn, 0.25)


# ---------------------------------------------------------------------------------------------------------------
# Whole model: greedy tokens with each backend equal the torch backend's
# ---------------------------------------------------------------------------------------------------------------

PROMPT = [(7 * i + 3) % 256 for i in range(37)]  # crosses block boundaries of 16


@pytest.fixture(scope="module")
def qwen3_folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


def load(folder, backend):
    return load_model(folder, dtype=torch.float32, device=DEVICE, attention_backend=backend).model


@pytest.mark.parametrize(
    ("make_backend", "block_size"),
    [(TritonAttentionBackend, 16), (lambda: FlashAttentionBackend(REFERENCE_FLASH_OPS), 256)],
    ids=["triton", "flash-attn"],
)
def test_model_greedy_tokens_match_torch_backend(qwen3_folder, make_backend, block_size):
    expected = greedy_generate(load(qwen3_folder, None), PROMPT, 6, block_size=block_size)
    assert greedy_generate(load(qwen3_folder, make_backend()), PROMPT, 6, block_size=block_size) == expected


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs: capture sizes, padding, and the captured step itself (run eagerly here)
# ---------------------------------------------------------------------------------------------------------------


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 4 + 16
    assert capture_sizes(4096)[-1] == MAX_CAPTURE_SIZE == 512  # larger decode batches run eagerly


def test_padded_batch_size():
    sizes = capture_sizes(40)  # [1, 2, 4, 8, 16, 32, 48]
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 33, 48)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        32,
        48,
        48,
    ]
    assert padded_batch_size(49, sizes) is None


def test_decode_buffers_pad_with_skipped_slots_and_the_null_block():
    buffers = DecodeBuffers.allocate(max_batch=8, max_blocks=4, device=DEVICE, null_block=99)
    assert buffers.block_tables.eq(99).all() and buffers.slot_mapping.eq(-1).all()  # padding before any fill
    buffers.fill(
        [11, 12, 13, 14, 15], [[5, 2], [7], [1, 3, 4], [6], [8]], [20, 3, 33, 2, 2], 16, batch_size=8
    )
    buffers.fill([11, 12, 13], [[5, 2], [7], [1, 3, 4]], [20, 3, 33], block_size=16, batch_size=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [19, 2, 32, 0]
    assert buffers.slot_mapping[:4].tolist() == [2 * 16 + 3, 7 * 16 + 2, 4 * 16 + 0, -1]
    assert buffers.context_lens[:4].tolist() == [20, 3, 33, 1]
    # Block 0 is a real block: a padding row (or a table's unused column) must never point at it.
    assert buffers.block_tables[:4, :3].tolist() == [[5, 2, 99], [7, 99, 99], [1, 3, 4], [99, 99, 99]]


@pytest.mark.parametrize(
    ("make_backend", "block_size"),
    [(TritonAttentionBackend, 16), (lambda: FlashAttentionBackend(REFERENCE_FLASH_OPS), 256)],
    ids=["triton", "flash-attn"],
)
def test_graph_step_on_padded_buffers_matches_eager_step(qwen3_folder, make_backend, block_size):
    """What a graph captures (the model over padded static buffers) equals the eager step on real rows,
    and padding rows write nothing to the pool (values agree to rounding: a batch of 4 is not one of 3)."""
    model = load(qwen3_folder, make_backend())
    pool = allocate_kv_cache(model.config, 8, block_size, torch.float32, DEVICE)
    model.bind_kv_cache(pool)
    prompts = [PROMPT[:20], PROMPT[:3], PROMPT[5:37]]
    tables = [[3, 1], [6], [0, 5, 2]] if block_size == 16 else [[3], [6], [0]]
    lens = [len(p) for p in prompts]
    with torch.inference_mode():
        attn = build_attention_metadata(tables, lens, lens, block_size, DEVICE, model.attention_backend)
        ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
        model(ids, torch.cat([torch.arange(n, device=DEVICE) for n in lens]), attn)
        next_ids, next_lens = [1, 2, 3], [n + 1 for n in lens]
        before = [t.clone() for t in pool]
        decode = build_attention_metadata(
            tables, next_lens, [1, 1, 1], block_size, DEVICE, model.attention_backend
        )
        expected = model(torch.tensor(next_ids, device=DEVICE), torch.tensor(lens, device=DEVICE), decode)
        eager_pool = [t.clone() for t in pool]
        for t, saved in zip(pool, before, strict=True):
            t.copy_(saved)
        runner = DecodeGraphRunner(model, block_size, 5, max_model_len=64, device=DEVICE, null_block=7)
        assert runner.sizes == [1, 2, 4, 8] and padded_batch_size(3, runner.sizes) == 4
        runner.buffers.fill(next_ids, tables, next_lens, block_size, batch_size=4)
        out = runner.forward_static(4)
    assert out.shape[0] == 4 and torch.isfinite(out).all()
    torch.testing.assert_close(out[:3], expected, rtol=1e-4, atol=1e-4)
    written = runner.buffers.slot_mapping[:3]
    assert runner.buffers.slot_mapping[3] == -1
    for layer, eager, old in zip(pool, eager_pool, before, strict=True):
        flat, eager, old = (t.view(2, -1, *t.shape[-2:]) for t in (layer, eager, old))
        torch.testing.assert_close(flat[:, written], eager[:, written], rtol=1e-5, atol=1e-5)
        flat[:, written] = old[:, written]
        assert torch.equal(flat, old)  # nothing else was written


def test_model_runner_refuses_positions_past_the_rotary_table(qwen3_folder):
    from kvd.engine.model_runner import MaxModelLenError, ModelRunner

    model = load(qwen3_folder, None)
    make = dict(num_blocks=4, block_size=16, dtype=torch.float32, device=DEVICE, max_num_seqs=4)
    with pytest.raises(MaxModelLenError, match="more than the 256 positions"):
        ModelRunner(model, model.config, max_model_len=257, enforce_eager=True, **make)
    runner = ModelRunner(model, model.config, max_model_len=256, enforce_eager=True, **make)
    assert (
        runner.kv_caches[0].shape[1] == 5 and runner.null_block == 4
    )  # the null block is past the manager's


def test_graph_runner_refuses_the_torch_backend(qwen3_folder):
    with pytest.raises(TypeError, match="cannot be captured"):
        DecodeGraphRunner(load(qwen3_folder, None), 16, 4, 64, DEVICE, null_block=0)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile of the hot paths, and KV pool sizing
# ---------------------------------------------------------------------------------------------------------------


def test_compiled_hot_paths_give_the_same_tokens_without_recompiling(qwen3_folder):
    """aot_eager runs dynamo and functionalization, as on CUDA, without inductor's slow CPU codegen."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kvd.model.compile import compile_hot_paths

    model = load(qwen3_folder, None)
    expected = greedy_generate(model, PROMPT, 5)
    torch._dynamo.reset()
    counters.clear()
    compile_hot_paths(model, backend="aot_eager")
    assert greedy_generate(model, PROMPT, 5) == expected
    # norm, add_and_norm and MLP; each once for one token (sizes 0 and 1 are specialized) and once for many.
    assert counters["stats"]["unique_graphs"] <= 6


def test_kv_cache_budget_counts_only_this_process():
    gib = 2**30
    baseline = DeviceMemory(total=100 * gib, free=70 * gib, torch_reserved=0)  # 30 GiB held by others
    # Loading and profiling: weights 10 GiB, peak 14 GiB; 1 GiB appeared outside torch (workspaces).
    after = DeviceMemory(total=100 * gib, free=59 * gib, torch_reserved=10 * gib)
    budget = kv_cache_budget(0.5, baseline, after, torch_peak=14 * gib, torch_now=10 * gib, reserve=0)
    assert budget == 50 * gib - 14 * gib - 1 * gib  # others' 30 GiB are not charged to the fraction
    # But the pool never takes more than is free, less the activations' headroom.
    assert kv_cache_budget(0.9, baseline, after, 14 * gib, 10 * gib, reserve=0) == 59 * gib - 4 * gib
    # What is made after sizing (graph pools, compiled kernels) is held back in both cases.
    assert kv_cache_budget(0.5, baseline, after, 14 * gib, 10 * gib) == budget - RUNTIME_RESERVE_BYTES
    assert kv_cache_budget(0.9, baseline, after, 14 * gib, 10 * gib) == 55 * gib - RUNTIME_RESERVE_BYTES


def test_profile_steps_include_the_longest_chunk_over_the_longest_prefix():
    fresh, chunked = profile_steps(
        block_size=16, max_num_batched_tokens=100, max_num_seqs=4, max_model_len=40
    )
    assert (fresh.context_lens, fresh.query_lens) == ([40, 40, 20], [40, 40, 20])
    assert fresh.tables == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # A chunk over a cached prefix takes the gather-and-mask path, whose memory grows with chunk x context.
    assert (chunked.context_lens, chunked.query_lens, chunked.tables) == ([40], [39], [[0, 1, 2]])
    _, long_context = profile_steps(16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=4096)
    assert (long_context.context_lens, long_context.query_lens) == ([4096], [64])


def test_profile_step_runs_the_largest_batches_and_releases_its_pool(qwen3_folder):
    model = load(qwen3_folder, None)
    per_block = 2 * 16 * model.config.num_key_value_heads * model.config.head_dim * 4
    scratch = run_profile_step(
        model, block_size=16, max_num_batched_tokens=100, max_num_seqs=4, max_model_len=40
    )
    blocks = 3 + 3 + 2  # sequences of 40, 40 and 20 tokens
    assert scratch == blocks * per_block * model.config.num_hidden_layers
    assert all(layer.self_attn.kv_cache.shape[1] == 1 for layer in model.model.layers)
    # A max_model_len past the model's positions (256) is profiled at 256: no position past the rotary table.
    scratch = run_profile_step(model, 16, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=10**6)
    assert scratch == (256 // 16) * per_block * model.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------------------
# The engine with a chosen backend, and the GPU benchmark script's smoke run
# ---------------------------------------------------------------------------------------------------------------


def test_engine_with_the_triton_backend_generates_the_torch_backends_tokens(qwen3_folder):
    from kvd import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [PROMPT[:20], PROMPT[3:37]]
    tokens = {}
    for name in ("torch", "triton"):
        llm = LLM(
            str(qwen3_folder),
            dtype="float32",
            device=DEVICE.type,
            attention_backend=name,
            enforce_eager=True,  # graphs and compile are checked by benchmarks/gpu_bench.py on a GPU
            kv_cache_memory=2**22,
        )
        assert llm.engine.info()["attention_backend"] == name and llm.engine.info()["block_size"] == 16
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"] and all(len(t) == 4 for t in tokens["torch"])


def test_engine_rejects_a_backend_that_cannot_run(qwen3_folder):
    from kvd import LLM

    with pytest.raises(AttentionBackendError, match="runs on CUDA"):
        LLM(str(qwen3_folder), device="cpu", attention_backend="flash-attn", kv_cache_memory=2**22)
    with pytest.raises(AttentionBackendError, match="unknown attention backend 'flashattn'"):
        LLM(str(qwen3_folder), attention_backend="flashattn", kv_cache_memory=2**22)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ('device = "cuda"', "CUDA is not available" if not torch.cuda.is_available() else None),
        ("gpu-memory-utilization = 1.5", r"gpu_memory_utilization must be in \(0, 1\]"),
        ('attention-backend = "flash-attn"\nenforce-eager = true', "flash-attn backend runs on CUDA"),
    ],
    ids=["cuda-absent", "utilization", "backend"],
)
def test_serve_takes_the_gpu_settings_from_flags_and_config(qwen3_folder, tmp_path, capsys, settings, error):
    """The settings reach the engine (its checks answer), as one clear line and exit status 2."""
    from kvd.cli import main

    if error is None:
        pytest.skip("this host has CUDA")
    config = tmp_path / "kvd.toml"
    config.write_text(f'model = "{qwen3_folder}"\n{settings}\n')
    listen = ["--listen", f"ipc://{tmp_path}/kvd.sock"]
    assert main(["serve", "--config", str(config), *listen]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvd serve: ") and "Traceback" not in err
    assert re.search(error, err), err


SMOKE_ARGS = ("--device", "cpu", "--tiny", "--backends", "torch", "--json")


def test_gpu_bench_smoke_run_on_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_bench", "parity", "invariance", "throughput", *SMOKE_ARGS],
        cwd=ROOT,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"]
    parity = [(r["backend"], r["dtype"], r["identical"], r["ok"]) for r in result["parity"]]
    assert parity[0] == ("torch", "float32", "4/4", True) and parity[1][:2] == ("torch", "bfloat16")
    # The native backend's claim (tests/test_batch_invariance.py) holds in the benchmark's measure too.
    invariance = result["invariance"]
    assert [(r["dtype"], r["mode"]) for r in invariance] == [("float32", "eager"), ("bfloat16", "eager")]
    if invariance[0]["backend"] == "native":
        assert all(r["same_tokens"] == r["same_logprobs"] == 8 for r in invariance), invariance
    # Every request ran to its max_tokens (ignore_eos) in both modes; without CUDA no step replays a graph.
    rows = result["throughput"]
    # auto: the native backend on a CPU.
    assert [(r["mode"], r["attention_backend"]) for r in rows] == [("graphs", "native"), ("eager", "native")]
    assert all(r["output_tokens"] == result["expected_output_tokens"] for r in rows)
    assert all(r["graph_steps"] == 0 and r["eager_steps"] >= r["output_tokens"] / 8 for r in rows)

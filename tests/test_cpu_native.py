"""kvd's native CPU kernels against torch references, and how they are built, cached and switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvd.kernels import cpu_native
from kvd.model.layers.rotary import RotaryEmbedding, RotaryRows, apply_rotary

ROOT = Path(__file__).resolve().parent.parent
DTYPES = [torch.float32, torch.bfloat16]


def _qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as the model has them: strided views of one projection output [T, (H + 2 KV) * D]."""
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    return [t.view(tokens, -1, head_dim) for t in fused.split(sizes, dim=-1)]


def _attention_reference(q, pool, tables, lens, scale, window=None, sinks=None):
    """float64 attention; `sinks` [H]: a logit per query head in the softmax's denominator (a column of its own,
    whose value is nothing)."""
    block_size, group = pool.shape[2], q.shape[1] // pool.shape[3]
    flat = pool.view(2, -1, *pool.shape[-2:]).double()
    out = []
    for s, ctx in enumerate(lens.tolist()):
        first = max(0, ctx - window) if window else 0
        slots = [tables[s, t // block_size].item() * block_size + t % block_size for t in range(first, ctx)]
        k = flat[0, slots].repeat_interleave(group, dim=1)
        v = flat[1, slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s].double(), k) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None]), dim=1)
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1)[:, : len(slots)], v))
    return torch.stack(out)


def _assert_matches_reference_and_alone(q, pool, tables, lens, window=None, sinks=None):
    """The native attention of every row against the torch reference, and bit for bit the same row alone."""
    scale = q.shape[-1] ** -0.5
    got = cpu_native.paged_attention(q, pool, tables, lens, scale, window, sinks)
    tolerance = 1e-5 if q.dtype == torch.float32 else 1e-2
    want = _attention_reference(q, pool, tables, lens, scale, window, sinks)
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    for s in range(len(lens)):
        alone = cpu_native.paged_attention(
            q[s : s + 1], pool, tables[s : s + 1], lens[s : s + 1], scale, window, sinks
        )
        assert torch.equal(alone, got[s : s + 1]), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 8), (6, 1, 12)])
@pytest.mark.parametrize("lens", [[1, 16, 17, 100, 37], [1, 16, 17, 100, 37, 5, 64, 33, 90, 2, 48, 71]])
def test_paged_attention_reads_the_pool_in_place(dtype, heads, kv_heads, head_dim, lens):
    """Contexts of 1 token, exactly one block, across blocks, scattered block ids; q strided as in the model;
    head sizes 64 and 128 run the SIMD paths (16 keys per sum and the keys past them), 12 the non-SIMD tail.
    Twelve sequences take the whole-sequence work items, each streaming the next one's blocks in: every
    sequence's output has the same bits as when it is attended to alone."""
    torch.manual_seed(head_dim)
    block_size = 16
    num_blocks = sum(-(-ctx // block_size) for ctx in lens) + 3
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    lens = torch.tensor(lens, dtype=torch.int32)
    order = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(lens), 7, dtype=torch.int32)
    for s, ctx in enumerate(lens.tolist()):
        for b in range(-(-ctx // block_size)):
            tables[s, b] = order.pop()
    q = _qkv_views(len(lens), heads, kv_heads, head_dim, dtype)[0]
    got = cpu_native.paged_attention(q, pool, tables, lens, head_dim**-0.5)
    want = _attention_reference(q, pool, tables, lens, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    for s in range(len(lens)):
        alone = cpu_native.paged_attention(
            q[s : s + 1], pool, tables[s : s + 1], lens[s : s + 1], head_dim**-0.5
        )
        assert torch.equal(alone, got[s : s + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [5, 7, 2])
def test_odd_blocks_and_contexts_pair_their_last_key_with_nothing(dtype, block_size):
    """With AVX-512 BF16 a bf16 pool's values are summed by key pairs within a block: a block of odd size, or a
    context ending inside a pair, leaves its last key alone (zero weight and values beside it, never the next
    slot's, which holds a NaN here). Every row matches the reference and has the same bits alone."""
    torch.manual_seed(block_size)
    heads, kv_heads, head_dim = 9, 3, 64
    lens = torch.tensor([1, 2, 3, block_size, block_size + 1, 2 * block_size - 1, 33, 34], dtype=torch.int32)
    width = -(-34 // block_size)
    num_blocks = len(lens) * width
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    tables = torch.randperm(num_blocks).to(torch.int32).view(len(lens), width)
    for s, ctx in enumerate(lens.tolist()):  # the slot after each context: a NaN value no row may read
        if ctx % block_size:
            pool[1, tables[s, ctx // block_size], ctx % block_size] = float("nan")
    q = _qkv_views(len(lens), heads, kv_heads, head_dim, dtype)[0]
    _assert_matches_reference_and_alone(q, pool, tables, lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (8, 2, 128, 32), (14, 2, 64, 16)]
)
@pytest.mark.parametrize(
    ("window", "with_sinks"), [(None, False), (7, False), (20, False), (None, True), (7, True)]
)
def test_a_prompts_rows_attend_as_each_row_alone(
    dtype, heads, kv_heads, head_dim, block_size, window, with_sinks
):
    """A prompt's rows (contexts 1 .. 40) and a later chunk of another prompt (21 .. 45) among decode rows: on a
    CPU with AMX, a bf16 pool's rows take bf16 tiles (a prompt's rows in chunks of up to 16, 7 query heads a kv
    head: several sets of 16). With a sliding window, each row sees its last `window` tokens, which start inside a
    block. With attention sinks, each query head's own logit joins its softmax's denominator (some large enough to
    outweigh every key). Every row matches the reference and has the same bits alone."""
    torch.manual_seed(heads + head_dim)
    num_blocks = 24
    tables = torch.randperm(num_blocks).to(torch.int32)[:15].view(5, 3)
    tables = tables.repeat_interleave(torch.tensor([40, 25, 1, 1, 1]), dim=0)
    lens = torch.tensor([*range(1, 41), *range(21, 46), 48, 17, 33], dtype=torch.int32)
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    q = _qkv_views(len(lens), heads, kv_heads, head_dim, dtype)[0]
    sinks = torch.linspace(-3.0, 6.0, heads) if with_sinks else None
    _assert_matches_reference_and_alone(q, pool, tables, lens, window, sinks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 12])
def test_a_window_reads_no_block_before_the_one_it_starts_in(dtype, head_dim):
    """A sliding layer's table entries before its window may name any block (one that the layer gave back): here
    a block of NaN keys and values, which no row may read, while the window's first block holds tokens before the
    window too (finite, weighted zero)."""
    torch.manual_seed(head_dim)
    block_size, window, heads, kv_heads = 4, 6, 6, 2
    pool = torch.randn(2, 12, block_size, kv_heads, head_dim).to(dtype)
    pool[:, 0] = float("nan")
    lens = torch.tensor([*range(9, 17), 23, 13], dtype=torch.int32)  # a prompt's rows, then two decode rows
    tables = torch.zeros(len(lens), 6, dtype=torch.int32)
    for s, ctx in enumerate(lens.tolist()):
        live = (ctx - window) // block_size  # the block holding the window's first token
        tables[s, live : -(-ctx // block_size)] = torch.arange(1 + live, 1 + -(-ctx // block_size))
    q = _qkv_views(len(lens), heads, kv_heads, head_dim, dtype)[0]
    got = cpu_native.paged_attention(q, pool, tables, lens, head_dim**-0.5, window)
    assert torch.isfinite(got).all()
    clean = pool.clone()
    clean[:, 0] = 0  # what the reference reads there is masked out anyway
    _assert_matches_reference_and_alone(q, clean, tables, lens, window)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_later_rows_non_finite_value_leaves_the_earlier_rows_as_alone(bad):
    """A prompt's rows share value tiles on a CPU with AMX: an infinite or NaN value of row 10's own key (outside
    rows 0-9's contexts) must not reach them (a zero weight times infinity is NaN), while rows 10 on see it."""
    torch.manual_seed(5)
    block_size, kv_heads, head_dim = 16, 3, 64
    pool = torch.randn(2, 4, block_size, kv_heads, head_dim).to(torch.bfloat16)
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32).repeat(20, 1)
    lens = torch.arange(21, 41, dtype=torch.int32)  # rows of one prompt: contexts 21 .. 40
    pool[1, 0, 30 - block_size, 1, 7] = bad  # key 30 (block 0 of the table's second entry), kv head 1
    q = _qkv_views(len(lens), 9, kv_heads, head_dim, torch.bfloat16)[0]
    got = cpu_native.paged_attention(q, pool, tables, lens, head_dim**-0.5)
    assert got[:10].isfinite().all() and not got[10:, 3:6].isfinite().all()
    for s in range(len(lens)):
        alone = cpu_native.paged_attention(
            q[s : s + 1], pool, tables[s : s + 1], lens[s : s + 1], head_dim**-0.5
        )
        torch.testing.assert_close(alone, got[s : s + 1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_rows_of_their_own_strides_and_skips_minus_one(dtype):
    """k normalized apart (contiguous) while v is still a view of the projection: each has its own stride."""
    _, k, v = _qkv_views(5, 4, 2, 8, dtype)
    k = k.contiguous()
    pool = torch.zeros(2, 6, 4, 2, 8, dtype=dtype)
    slots = torch.tensor([3, 22, -1, 0, 9])
    cpu_native.store_kv(k, v, pool, slots)
    flat = pool.view(2, -1, 2, 8)
    written = slots >= 0
    assert torch.equal(flat[0, slots[written]], k[written])
    assert torch.equal(flat[1, slots[written]], v[written])
    assert torch.count_nonzero(flat[:, [s for s in range(24) if s not in slots.tolist()]]) == 0


# Head size 40: two eight-pair SIMD steps and four pairs past them, on the scalar loop; rotating 24 of its 40 values
# (partial rotary): one step and four pairs, the last 16 values left as they are.
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (40, 40), (40, 24)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bit_identical_to_the_torch_ops(dtype, head_dim, rotary_dim):
    rotary = RotaryEmbedding(rotary_dim, 4096, 10000.0, None).to(dtype)
    positions = torch.tensor([0, 1, 17, 300, 4095])
    q = _qkv_views(5, 9, 3, head_dim, dtype)[0]
    cos, sin = rotary.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    want = apply_rotary(q.clone(), RotaryRows(cos, sin))
    rows = rotary.lookup(positions)
    assert rows.table is not None  # the native path
    before = q.clone()
    got = apply_rotary(q, rows)
    assert torch.equal(got, want)
    assert got.data_ptr() == q.data_ptr()  # in place, in the projection output
    assert torch.equal(got[..., rotary_dim:], before[..., rotary_dim:])
    assert not torch.equal(got[1:, :, :rotary_dim], before[1:, :, :rotary_dim])  # position 0 is the identity


def test_add_rms_norm_matches_torch_in_float32():
    torch.manual_seed(0)
    x, residual, weight = torch.randn(33, 576), torch.randn(33, 576), torch.rand(576) + 0.5
    want_residual = residual + x
    want = F.rms_norm(want_residual, (576,), weight, 1e-5)
    got, got_residual = cpu_native.add_rms_norm(x, residual, weight, 1e-5)
    assert got_residual is residual and torch.equal(residual, want_residual)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(cpu_native.NativeKernelError, match="mixed dtypes"):
        cpu_native.add_rms_norm(x.bfloat16(), residual.bfloat16(), weight, 1e-5)


def _hf_bf16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in bfloat16: normalize in float32, round, then scale by the bf16 weight."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)


def test_bf16_norms_round_as_transformers_does():
    """The float32 sum of squares runs in another order than torch's: allow one bf16 step, on few values."""
    torch.manual_seed(0)
    x, residual = torch.randn(33, 576).bfloat16(), torch.randn(33, 576).bfloat16()
    weight = (torch.rand(576) + 0.5).bfloat16()
    want_residual = residual + x  # torch rounds the bf16 sum to nearest even, as the kernel does
    want = _hf_bf16_rms_norm(want_residual, weight, 1e-5)
    got, got_residual = cpu_native.add_rms_norm(x, residual, weight, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(got_residual, want_residual)
    differ = (got != want).float().mean().item()
    assert differ < 0.01, f"{differ:.2%} of values differ"
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    q = _qkv_views(7, 4, 2, 32, torch.bfloat16)[0]
    head_weight = (torch.rand(32) + 0.5).bfloat16()
    torch.testing.assert_close(
        cpu_native.rms_norm(q, head_weight, 1e-6),
        _hf_bf16_rms_norm(q, head_weight, 1e-6),
        rtol=1e-2,
        atol=1e-2,
    )


GATES = {  # the native gated activation -> torch's definition of its activation
    cpu_native.silu_mul: F.silu,
    cpu_native.gelu_tanh_mul: lambda g: F.gelu(g.double(), approximate="tanh").float(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", GATES, ids=lambda k: k.__name__)
def test_gated_activations_match_torch_on_views_of_one_projection(dtype, kernel):
    torch.manual_seed(0)
    gate_up = (torch.randn(9, 2 * 100) * 6).to(dtype)  # 100: SIMD lanes and a scalar tail; large |g| too
    gate, up = gate_up.split(100, dim=-1)
    before = gate_up.clone()
    want = (GATES[kernel](gate.float()).to(dtype).float() * up.float()).to(dtype)
    got = kernel(gate, up)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(gate_up, before)  # out of place: the projection output is left as it was
    if (
        dtype == torch.bfloat16
    ):  # the activation rounded to bf16, then the product: exactly, lanes and tail alike
        act = kernel(gate.float(), torch.ones_like(gate, dtype=torch.float32))
        assert torch.equal(got, (act.to(dtype).float() * up.float()).to(dtype))
    with pytest.raises(cpu_native.NativeKernelError, match="one stride"):
        kernel(gate.contiguous(), up)
    # One row's stride is any (a decode step's gate beside a row of a wider table, as Gemma 4's per-layer input):
    # the kernel takes it, with the row's bits of the batch.
    wide = torch.zeros(1, 3 * 100, dtype=dtype)
    wide[:, 100:200] = up[:1]
    assert torch.equal(kernel(gate[:1].contiguous(), wide[:, 100:200]), got[:1])


def test_rms_norm_of_heads_and_of_rows_matches_torch():
    torch.manual_seed(0)
    q = _qkv_views(7, 4, 2, 32, torch.float32)[0]  # per-head norm of a strided view, as Qwen3's q_norm
    weight = torch.rand(32) + 0.5
    torch.testing.assert_close(
        cpu_native.rms_norm(q, weight, 1e-6), F.rms_norm(q, (32,), weight, 1e-6), rtol=1e-6, atol=1e-6
    )
    rows, weight = torch.randn(5, 96), torch.rand(96)
    torch.testing.assert_close(
        cpu_native.rms_norm(rows, weight, 1e-6), F.rms_norm(rows, (96,), weight, 1e-6), rtol=1e-6, atol=1e-6
    )


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from kvd.kernels import cpu_native as c, native_build as b; print(c.available()); print(b.library_path())"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_built_once_per_host_then_loaded_from_the_cache(tmp_path):
    first = _probe({"KVD_CACHE_DIR": str(tmp_path)})
    assert first.stdout.splitlines()[0] == "True", first.stderr
    built = Path(first.stdout.splitlines()[1])
    assert built.parent == tmp_path / "native" and built.suffix == ".so"
    stamp = built.stat().st_mtime_ns
    second = _probe({"KVD_CACHE_DIR": str(tmp_path)})
    assert second.stdout.splitlines()[1] == str(built) and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temporary files left behind


def test_without_a_compiler_kvd_says_so_and_runs_plain_torch(tmp_path):
    proc = _probe({"KVD_CACHE_DIR": str(tmp_path), "CC": "/bin/false"})
    assert proc.stdout.splitlines()[0] == "False"
    assert "plain-torch CPU paths run instead" in proc.stderr
    assert _probe({"KVD_NATIVE": "0"}).stdout.splitlines()[0] == "False"


def _pool_and_query(dtype=torch.float32):
    pool = torch.randn(2, 4, 16, 2, 8).to(dtype)
    return pool, torch.randn(2, 4, 8).to(dtype)


@pytest.mark.parametrize(
    ("tables", "lens"),
    [
        ([[0, 1], [2, 4]], [20, 17]),  # block 4 of a 4-block pool
        ([[0, 1], [2, -1]], [20, 17]),  # a negative block id
        ([[0, 1], [2, 3]], [20, 33]),  # a context longer than its table covers
        ([[0, 1], [2, 3]], [20, 0]),  # an empty context
    ],
)
def test_attention_refuses_indices_outside_the_pool(tables, lens):
    pool, q = _pool_and_query()
    tables, lens = torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        cpu_native.paged_attention(q, pool, tables, lens, 0.3)


def test_attention_checks_dtypes_and_layouts():
    pool, q = _pool_and_query()
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    cpu_native.paged_attention(q, pool, tables, lens, 0.3)  # valid as given
    bad = {
        "pool dtype": (q, pool.bfloat16(), tables, lens),
        "table dtype": (q, pool, tables.long(), lens),
        "strided table": (q, pool, torch.tensor([[0, 9, 1], [2, 9, 3]], dtype=torch.int32)[:, ::2], lens),
        "lens per sequence": (q, pool, tables, lens[:1]),
        "strided pool": (q, pool.transpose(1, 2), tables, lens),
    }
    for what, args in bad.items():
        with pytest.raises(cpu_native.NativeKernelError):
            cpu_native.paged_attention(*args, 0.3)
            pytest.fail(f"{what} was accepted")


@pytest.mark.parametrize("slot", [96, 10**12, -2])
def test_store_refuses_a_slot_outside_the_pool_and_writes_nothing(slot):
    k = torch.randn(3, 2, 8)
    pool = torch.zeros(2, 6, 16, 2, 8)
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        cpu_native.store_kv(k, k, pool, torch.tensor([0, slot, 5]))
    assert torch.count_nonzero(pool) == 0  # not even the valid slots before the bad one
    with pytest.raises(cpu_native.NativeKernelError, match="int64"):
        cpu_native.store_kv(k, k, pool, torch.tensor([0, 1, 5], dtype=torch.int32))


def test_rotary_refuses_a_position_past_its_table():
    rotary = RotaryEmbedding(64, 128, 10000.0, None)
    q = torch.randn(2, 3, 64)
    before = q.clone()
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        cpu_native.rotary(q, rotary.cos_sin_cache, torch.tensor([5, 128]))
    assert torch.equal(q, before)


def test_dequantize_refuses_rows_past_the_weight():
    codes = torch.zeros(8, 32, dtype=torch.int8)
    weight = cpu_native.linear_weight(8, codes, torch.ones(8, 1, dtype=torch.float16))
    cpu_native.dequantize(weight, 4, torch.empty(4, 32))
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        cpu_native.dequantize(weight, 5, torch.empty(4, 32))


def test_the_layer_loop_checks_its_indices_before_any_layer_runs():
    """Null weights: the call can only succeed without touching them, so refusing is the check's doing."""
    shape = cpu_native.ModelShape(16, 2, 1, 8, 8, 32, 4, 16, 64, 1e-6, 0.35, 0, 0, 0)
    empty = cpu_native.LinearWeight(0, 0, 0, 0, 0, 0, 0, 32, 0, 0)
    cos_sin = torch.zeros(64, 16)
    layer = cpu_native.LayerWeights(
        0, 0, 0, 0, 0, 0, cos_sin.data_ptr(), (empty,), empty, (empty,), empty, 0, 0, 0, 0, 0, 0, 0
    )
    hidden, residual = torch.zeros(2, 16), torch.zeros(2, 16)
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([17, 3], dtype=torch.int32)

    def run(layers, positions=(3, 16), slots=(16, 34), tables=tables, lens=lens, groups=1, recurrent=None):
        group = (torch.tensor(slots), tables)
        cpu_native.decode_layers(
            shape, layers, hidden, residual, torch.tensor(positions), [group] * groups, lens, recurrent
        )

    run(())  # valid indices, no layer: nothing to do
    for bad in (
        {"slots": (16, 64)},
        {"positions": (3, 64)},
        {"lens": torch.tensor([17, 40], dtype=torch.int32)},
        {"tables": torch.tensor([[0, 1], [4, 3]], dtype=torch.int32)},
    ):
        with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
            run((layer,), **bad)
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        run((layer._replace(kv_group=1),))  # a KV group the call did not give
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        run((layer._replace(kv_group=1),), groups=2, slots=(16, 99))  # every group's indices are checked
    # A Gated DeltaNet layer (4 state slots) after an attention layer: its step is checked before either runs.
    _, delta = cpu_native.recurrent_struct(
        cpu_native.RecurrentWeights(
            *([(empty,)] * 4), empty, 0, 0, 0, 0, 0, 0, num_slots=4, key_heads=1, value_heads=1, key_dim=8,
            value_dim=8, conv_kernel=4, tiled=0,
        )
    )  # fmt: skip
    layers = (layer, layer._replace(recurrent=delta))

    def step(starts=(0, 1, 2), slots=(0, 1), sources=(0, 1)):
        none = torch.zeros(0, dtype=torch.int64)
        return (*map(torch.tensor, (starts, slots, sources)), torch.zeros(3, dtype=torch.int64), none, none)

    for bad in (None, step(slots=(0, 4)), step(slots=(1, 1)), step(sources=(1, 0)), step(starts=(0, 1, 3))):
        with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
            run(layers, recurrent=bad)


def test_the_struct_views_are_read_from_the_header():
    """Field names and order come from cpu_kernels.h: the C names, not a hand-written mirror."""
    assert cpu_native.LinearWeight._fields == (
        "qs",
        "d",
        "mn",
        "qh",
        "bias",
        "n",
        "k",
        "bits",
        "tiles",
        "ggml",
    )
    header = (ROOT / "kvd" / "kernels" / "cpu_kernels.h").read_text()
    for struct in (cpu_native.LinearWeight, cpu_native.LayerWeights, cpu_native.ModelShape):
        for name in struct._fields:
            assert name in header


@pytest.mark.skipif(
    not cpu_native.bf16_kernel_order(),
    reason="this CPU has neither AMX tiles (that Linux grants) nor AVX-512 BF16",
)
def test_bf16_weights_in_tile_order_match_torch_at_every_row_count():
    """AMX bf16 tiles or AVX-512 BF16 pairs: as close to float64 as torch's own bf16 matmul, and each row the same
    in any batch (300 rows: two chunks of activation tiles, the second ending in a part tile, and on AVX-512 BF16
    four work items of rows and 80 outputs, a whole group of four panels and a part one; a bias added in float32)."""
    torch.manual_seed(0)
    weight, x = torch.randn(80, 64).bfloat16(), torch.randn(300, 64).bfloat16()
    tiles = cpu_native.pack(weight)  # kept alive: the view below holds only its address
    packed = cpu_native.linear_weight(16, tiles, tiles=True)
    got = cpu_native.linear(x, packed)
    want = F.linear(x.double(), weight.double())
    assert (got.double() - want).abs().max() <= (F.linear(x, weight).double() - want).abs().max() * 1.01
    for rows in (1, 14, 15, 16, 17, 33, 48, 257):
        assert torch.equal(cpu_native.linear(x[:rows].contiguous(), packed), got[:rows])
    assert torch.equal(cpu_native.linear(x[290:].contiguous(), packed), got[290:])
    bias = torch.randn(80)
    biased = cpu_native.linear(x, cpu_native.linear_weight(16, tiles, bias=bias, tiles=True))
    want_biased = want + bias.double()
    tolerance = (got.double() - want).abs().max() + want_biased.abs().max() * 2**-8  # one bf16 rounding more
    assert (biased.double() - want_biased).abs().max() <= tolerance
    assert not torch.equal(biased, got)
    with pytest.raises(cpu_native.NativeKernelError, match="not whole"):
        cpu_native.pack(torch.zeros(24, 64, dtype=torch.bfloat16))  # 24 rows: not whole tiles
    assert torch.equal(cpu_native.unpack(tiles), weight)
    ids = torch.tensor([0, 79, 17, 17, 40])
    assert torch.equal(cpu_native.unpack_rows(tiles, ids), weight[ids])  # an embedding lookup


def test_float32_weights_in_panel_order_match_torch_at_every_row_count():
    """Panels of 16 outputs: each output one fused multiply-add chain over K, the same in any batch."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(37, 40)
    panels = cpu_native.pack(weight)  # kept alive: the view below holds only its address
    assert torch.equal(cpu_native.unpack(panels), weight)
    ids = torch.tensor([[95, 0], [16, 31]])
    assert torch.equal(cpu_native.unpack_rows(panels, ids), weight[ids])
    packed = cpu_native.linear_weight(32, panels, bias=bias, tiles=True)
    got = cpu_native.linear(x, packed)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    for rows in (1, 3, 4, 5, 36):
        assert torch.equal(cpu_native.linear(x[:rows].contiguous(), packed), got[:rows])
    with pytest.raises(cpu_native.NativeKernelError, match="32-bit weight"):
        cpu_native.linear(x.bfloat16(), cpu_native.linear_weight(32, panels, tiles=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_weights_in_rows_are_their_float32_values(dtype):
    """A GGUF F16 matrix in rows: each value widened exactly as it is read, so the outputs are those of the same
    values in float32 rows, bit for bit (rounded to bf16 for bf16 activations), at every row count (K 100: SIMD
    steps and a tail of four)."""
    torch.manual_seed(0)
    weight, bias, x = (torch.randn(37, 100) * 0.1).half(), torch.randn(37), torch.randn(21, 100).to(dtype)
    half = cpu_native.linear_weight(16, weight, bias=bias)
    wide = weight.float()  # kept alive: the views hold only addresses
    got = cpu_native.linear(x, half)
    same = cpu_native.linear(x.float(), cpu_native.linear_weight(32, wide, bias=bias))  # bf16 x: widened too
    assert torch.equal(got, same.to(dtype))
    torch.testing.assert_close(got.float(), F.linear(x.float(), wide, bias), rtol=1e-2, atol=1e-2)
    for rows in (1, 4, 5, 20):
        assert torch.equal(cpu_native.linear(x[:rows].contiguous(), half), got[:rows])
    with pytest.raises(cpu_native.NativeKernelError, match="fp16 weight is bits 16, in rows"):
        cpu_native.linear_weight(16, weight, tiles=True)
    with pytest.raises(cpu_native.NativeKernelError, match="a float weight's rows are its values"):
        cpu_native.dequantize(half, 0, torch.empty(1, 100))


@pytest.mark.parametrize("n", [1, 7, 16, 23, 49152])
def test_argmax_answers_as_torch_does_ties_and_nan_included(n):
    """Each row's first largest value, the first NaN where there is one (the sampler's greedy pick): rows shorter
    than the SIMD pass, a tail after it, and a vocabulary's width."""
    torch.manual_seed(n)
    x = torch.randn(9, n)
    x[1] = 0.5  # all equal: the first
    x[2] = float("-inf")  # all masked: the first
    x[3, n // 2] = float("nan")
    x[3, n - 1] = float("nan")
    x[4, n - 1] = float("nan")  # in the tail
    x[5, n - 1] = float("inf")
    x[6, n // 3] = x[6, n - 1] = 100.0  # a tie far apart
    x[7, 0] = float("nan")
    assert torch.equal(cpu_native.argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_native.argmax(x[:, : max(1, n // 2)]), x[:, : max(1, n // 2)].argmax(dim=-1))
    with pytest.raises(cpu_native.NativeKernelError, match="float32"):
        cpu_native.argmax(x.bfloat16())
    with pytest.raises(cpu_native.NativeKernelError, match="n >= 1"):
        cpu_native.argmax(torch.zeros(3, 0))

"""The 8-bit KV pool: its rows against a torch quantization, its attention against a torch reference over the
same codes, the same bits alone and in a batch, and the engine's checks of the setting."""

from __future__ import annotations

import pytest
import torch

from kvd import LLM, SamplingParams
from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.kernels import cpu_native
from kvd.kernels.cpu_native import NativeKernelError

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="the 8-bit KV pool is read by kvd's native kernels (a C compiler)"
)
DTYPES = [torch.float32, torch.bfloat16]


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (x x 127 / its row's largest magnitude, rounded half to even) and scales, as the kernels make them."""
    mx = x.float().abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.full_like(mx, 127.0) / mx, torch.zeros_like(mx))
    return torch.round(x.float() * inv), mx / 127.0


def _pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    row = cpu_native.kv8_row_bytes(head_dim)
    return torch.zeros(2, num_blocks, block_size, kv_heads, row, dtype=torch.int8)


def _rows(pool: torch.Tensor, slots: torch.Tensor, head_dim: int):
    """(key codes, key scales, value codes, value scales) of the pool's slots."""
    flat = pool.view(2, -1, *pool.shape[-2:])[:, slots]
    codes, scales = flat[..., :head_dim], flat[..., head_dim:].contiguous().view(torch.float32)
    return codes[0].view(torch.uint8).int() - 128, scales[0], codes[1].int(), scales[1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_quantizes_each_head_row_and_skips_minus_one(dtype):
    """Keys as code + 128, values signed, each row's scale after its codes; a row of zeros has scale 0."""
    kv_heads, head_dim = 2, 12
    k, v = torch.randn(6, kv_heads, head_dim).to(dtype), torch.randn(6, kv_heads, head_dim).to(dtype)
    k[2, 1] = 0
    pool = _pool(4, 4, kv_heads, head_dim)
    slots = torch.tensor([5, 0, 15, -1, 9, 3])
    cpu_native.store_kv(k, v, pool, slots)
    written = slots >= 0
    kc, ks, vc, vs = _rows(pool, slots[written], head_dim)
    want_kc, want_ks = _quantize(k[written])
    want_vc, want_vs = _quantize(v[written])
    assert torch.equal(kc, want_kc.int()) and torch.equal(ks, want_ks)
    assert torch.equal(vc, want_vc.int()) and torch.equal(vs, want_vs)
    assert ks[2, 1].item() == 0 and kc[2, 1].abs().sum() == 0
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert torch.count_nonzero(pool.view(2, 16, -1)[:, untouched]) == 0


def _reference(q, pool, tables, lens, scale, head_dim, window=None, sinks=None):
    """Float64 attention over the pool's dequantized rows, the query heads quantized as the kernel does."""
    block_size, kv_heads = pool.shape[2], pool.shape[3]
    group = q.shape[1] // kv_heads
    qc, qs = _quantize(q)
    out = []
    for s, ctx in enumerate(lens.tolist()):
        first = max(0, ctx - window) if window else 0
        slots = torch.tensor(
            [tables[s, t // block_size].item() * block_size + t % block_size for t in range(first, ctx)]
        )
        kc, ks, vc, vs = _rows(pool, slots, head_dim)
        k = (kc * ks).double().repeat_interleave(group, dim=1)
        v = (vc * vs).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", (qc[s] * qs[s]).double(), k) * scale
        if sinks is not None:  # a logit per query head in the denominator, with no value
            scores = torch.cat((scores, sinks.double()[:, None]), dim=1)
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1)[:, : len(slots)], v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 32), (14, 2, 64, 16), (4, 4, 8, 16), (6, 1, 12, 16)],
)
@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (19, False), (None, True)])
def test_attention_over_the_codes_matches_torch_and_each_row_alone(
    dtype, heads, kv_heads, head_dim, block_size, window, with_sinks
):
    """A prompt's rows (contexts 1 .. 40), a later chunk of another prompt (contexts 21 .. 45) and decode rows of
    other sequences over shuffled blocks; head sizes 64 and 128 take the VNNI scores (16 keys a sum and the keys
    past them) where the CPU has them and a prompt's rows AMX tiles (up to 16 rows a chunk, 7 query heads a kv
    head: several sets of 16 query heads), 8 and 12 the plain loops. Every row has the same bits alone as in the
    batch."""
    torch.manual_seed(heads * head_dim)
    num_blocks = 24
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = order[:15].view(5, 3).repeat_interleave(torch.tensor([40, 25, 1, 1, 1]), dim=0)
    lens = torch.tensor([*range(1, 41), *range(21, 46), 48, 17, 33], dtype=torch.int32)
    pool = _pool(num_blocks, block_size, kv_heads, head_dim)
    slots = torch.arange(num_blocks * block_size)
    kv = torch.randn(2, len(slots), kv_heads, head_dim).to(dtype)
    cpu_native.store_kv(kv[0], kv[1], pool, slots)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    sinks = torch.linspace(-3.0, 6.0, heads) if with_sinks else None
    got = cpu_native.paged_attention(q, pool, tables, lens, head_dim**-0.5, window, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    want = _reference(q, pool, tables, lens, head_dim**-0.5, head_dim, window, sinks)
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    for s in range(len(lens)):
        alone = cpu_native.paged_attention(
            q[s : s + 1], pool, tables[s : s + 1], lens[s : s + 1], head_dim**-0.5, window, sinks
        )
        assert torch.equal(alone, got[s : s + 1]), s


def test_a_nan_key_reaches_the_output_as_in_a_float_pool():
    pool = _pool(1, 4, 1, 64)
    k, v = torch.randn(2, 4, 1, 64).unbind(0)
    k[1, 0, 5] = float("nan")
    cpu_native.store_kv(k, v, pool, torch.arange(4))
    q = torch.randn(2, 1, 64)
    out = cpu_native.paged_attention(
        q, pool, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32), 0.125
    )
    assert not out[0].isnan().any() and out[1].isnan().all()


def test_a_pool_row_that_does_not_fit_the_heads_is_refused():
    q = torch.randn(1, 4, 64)
    wrong = torch.zeros(2, 2, 16, 2, 64, dtype=torch.int8)  # no room for the scales
    with pytest.raises(NativeKernelError, match="does not fit"):
        cpu_native.paged_attention(
            q, wrong, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 0.125
        )
    with pytest.raises(NativeKernelError, match="does not fit"):
        cpu_native.store_kv(q[:, :2], q[:, :2], wrong, torch.tensor([0]))


def test_the_setting_names_itself_when_wrong(tiny_checkpoint):
    with pytest.raises(EngineArgsError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp8")
    folder = str(tiny_checkpoint("llama"))
    with pytest.raises(
        EngineArgsError, match=r"int8 needs the native CPU attention \(this engine runs torch attention\)"
    ):
        LLM(folder, kv_cache_dtype="int8", attention_backend="torch", kv_cache_memory=2**22)
    with pytest.raises(EngineArgsError, match="batch invariance"):
        LLM(folder, kv_cache_dtype="int8", batch_invariant=False, kv_cache_memory=2**22)


def test_the_engine_reports_the_pool_and_halves_its_bytes(tiny_checkpoint):
    """The same budget holds twice the blocks of a bf16 pool (and a little less, for the scales); the
    outputs stay close to the bf16 pool's: the first greedy tokens agree."""
    folder = str(tiny_checkpoint("qwen2"))
    engines = {
        kv: LLM(folder, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=2**22, max_num_seqs=4)
        for kv in ("auto", "int8")
    }
    info = {kv: llm.engine.info() for kv, llm in engines.items()}
    assert info["auto"]["kv_cache_dtype"] == "bfloat16" and info["int8"]["kv_cache_dtype"] == "int8"
    head_dim = engines["int8"].engine.config.head_dim
    ratio = info["int8"]["num_blocks"] / info["auto"]["num_blocks"]
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.02)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(5, 60))
    tokens = {kv: llm.generate([prompt], params, use_tqdm=False)[0].token_ids for kv, llm in engines.items()}
    assert tokens["int8"][:2] == tokens["auto"][:2]

"""GGUF's super-block types (Q4_K, Q5_K, Q6_K, IQ4_XS) multiplied in place by the native kernels: against gguf's own
dequantization and a float64 matmul, exact in the integer part, batch invariant, and refused when malformed; each
in the file's layout and in the packed one (kvd_super_pack), which gives the same bits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvd.kernels import cpu_native, native_build

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels built")

TYPES = sorted(cpu_native.SUPER_TYPES)
# Where each type keeps its fp16 multipliers in a block (the rest of the bytes may be anything at all).
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Rows of random super-blocks: every code, scale and high bit random, the fp16 multipliers finite."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for at in HALVES[name]:
        halves = (rng.random((rows, k // block)) * 0.02 + 1e-4).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


LAYOUTS = ["file", "packed"]


def packs(name: str, rows: int) -> bool:
    """Whether this build packs the type: its AVX-512 VNNI outer products read Q4_K, Q5_K and Q6_K packed (a
    whole group of 16 rows at least)."""
    isa = native_build.isa(native_build.library())
    return "avx512" in isa and "vnni" in isa and name != "IQ4_XS" and rows >= 16


def weight(
    name: str, raw: np.ndarray, bias: torch.Tensor | None = None, layout: str = "file"
) -> cpu_native.LinearWeight:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    data, k = torch.from_numpy(raw.copy()), raw.shape[1] // size * block
    weight.keep.append(data)  # the view holds an address, not the tensor
    packed = layout == "packed" and cpu_native.pack_super(cpu_native.SUPER_TYPES[name], data, k)
    assert packed == (layout == "packed" and packs(name, raw.shape[0]))
    return cpu_native.super_weight(cpu_native.SUPER_TYPES[name], data, k, bias, packed=packed)


weight.keep = []


def reference(raw: np.ndarray, name: str, x: torch.Tensor) -> np.ndarray:
    """float64 x_q @ W^T: the activations quantized as the kernels define it (int8 per 256, scale = the largest
    magnitude / 127 in float32, nearest-even codes), the weight as gguf dequantizes it."""
    w = gguf.quants.dequantize(raw, GGMLQuantizationType[name]).astype(np.float64)
    m, k = x.shape
    xs = x.float().numpy().reshape(m, k // 256, 256)
    d = np.abs(xs).max(axis=-1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    codes = np.rint(xs * inv[..., None]).astype(np.float64)
    xq = (codes * d[..., None].astype(np.float64)).reshape(m, k)
    return xq @ w.T


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_ggufs(name, layout):
    raw = random_blocks(name, 35, 768)  # two whole groups of 16 rows and three rows after them
    expected = gguf.quants.dequantize(raw, GGMLQuantizationType[name])
    w = weight(name, raw, layout=layout)
    out = cpu_native.dequantize(w, 0, torch.empty(35, 768))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)
    rows = cpu_native.dequantize(w, 15, torch.empty(18, 768, dtype=torch.bfloat16))
    assert torch.equal(rows, torch.from_numpy(expected[15:33]).bfloat16())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 64, 65, 130])
def test_linear_matches_a_float64_reference(name, rows, layout):
    raw = random_blocks(name, 37, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(37)
    y = cpu_native.linear(x, weight(name, raw, bias, layout))
    expected = reference(raw, name, x) + bias.double().numpy()
    # Exact integer sums; the float steps round a few times per super-block.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y.double().numpy(), expected, rtol=0, atol=scale * 2e-6)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_and_in_any_batch_in_either_layout(name, dtype):
    raw = random_blocks(name, 40, 1024, seed=3)
    file, packed = weight(name, raw), weight(name, raw, layout="packed")
    x = (torch.randn(150, 1024, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    together = cpu_native.linear(x, file)
    for first, count in [
        (0, 1),
        (7, 1),
        (3, 2),
        (3, 3),
        (3, 4),
        (3, 5),
        (60, 9),
        (149, 1),
        (10, 100),
        (0, 150),
    ]:
        for w in (file, packed):
            assert torch.equal(
                cpu_native.linear(x[first : first + count], w), together[first : first + count]
            )


@pytest.mark.parametrize("name", TYPES)
def test_packing_moves_whole_groups_and_leaves_the_rest(name):
    """The packed bytes are a permutation of each whole group's bytes; rows after the last group are untouched;
    a type or build without a packed layout leaves every byte; a row size that is not the type's is refused."""
    raw = random_blocks(name, 37, 512, seed=4)
    data = torch.from_numpy(raw.copy())
    packed = cpu_native.pack_super(cpu_native.SUPER_TYPES[name], data, 512)
    assert packed == packs(name, 37)
    after = data.numpy()
    assert (after[32:] == raw[32:]).all()
    if packed:
        assert not (after[:16] == raw[:16]).all()
        for g in (0, 1):
            group = slice(16 * g, 16 * g + 16)
            assert (np.sort(after[group], axis=None) == np.sort(raw[group], axis=None)).all()
    else:
        assert (after == raw).all()
    with pytest.raises(cpu_native.NativeKernelError):
        cpu_native.pack_super(cpu_native.SUPER_TYPES[name], data[:, :-2].contiguous(), 512)
    if name == "IQ4_XS":
        with pytest.raises(cpu_native.NativeKernelError, match="no packed layout"):
            cpu_native.super_weight(cpu_native.SUPER_TYPES[name], data, 512, packed=True)
    small = torch.from_numpy(raw[:15].copy())
    assert not cpu_native.pack_super(cpu_native.SUPER_TYPES[name], small, 512)  # no whole group
    assert (small.numpy() == raw[:15]).all()


def test_odd_rows_and_many_blocks_per_row():
    """Weight rows that fill no group of any size, and rows of 16 super-blocks."""
    raw = random_blocks("Q4_K", 3, 4096, seed=9)
    x = torch.randn(5, 4096, generator=torch.Generator().manual_seed(2))
    y = cpu_native.linear(x, weight("Q4_K", raw))
    expected = reference(raw, "Q4_K", x)
    np.testing.assert_allclose(y.double().numpy(), expected, rtol=0, atol=np.abs(expected).max() * 2e-6)


def test_malformed_weights_are_refused():
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(cpu_native.NativeKernelError, match="type 2"):
        cpu_native.super_weight(2, raw, 256)  # Q4_0: not a super-block type
    with pytest.raises(cpu_native.NativeKernelError, match="multiple of 256"):
        cpu_native.super_weight(cpu_native.SUPER_TYPES["Q4_K"], raw, 300)
    with pytest.raises(cpu_native.NativeKernelError, match="uint8"):
        cpu_native.super_weight(cpu_native.SUPER_TYPES["Q4_K"], raw.float(), 256)
    w = cpu_native.super_weight(cpu_native.SUPER_TYPES["Q4_K"], raw, 256)
    with pytest.raises(cpu_native.NativeKernelError, match="features"):
        cpu_native.linear(torch.zeros(1, 512), w)


def test_packing_from_the_files_rows_is_packing_in_place():
    raw = random_blocks("Q6_K", 40, 512, seed=5)
    t = cpu_native.SUPER_TYPES["Q6_K"]
    in_place, copied = torch.from_numpy(raw.copy()), torch.empty(40, raw.shape[1], dtype=torch.uint8)
    assert cpu_native.pack_super(t, in_place, 512) == cpu_native.pack_super(t, copied, 512, source=raw)
    assert torch.equal(in_place, copied)
    with pytest.raises(cpu_native.NativeKernelError, match="source"):
        cpu_native.pack_super(t, copied, 512, source=raw[:39])


@pytest.mark.parametrize("rows", [(24, 40), (32, 20), (16, 16, 5), (7,)])
def test_a_stack_of_matrices_packs_as_one(rows):
    """GGUFLinear stacks a projection's matrices (q, k, v) into one part: packed matrix by matrix from the file
    where the stack's groups of 16 rows fall within one matrix, else stacked, then packed; either way the same
    outputs as the file's rows stacked."""
    from kvd.model.layers.gguf_linear import GGUFLinear

    raws = [random_blocks("Q4_K", n, 512, seed=n) for n in rows]
    linear = GGUFLinear(
        512, [(f"m{i}", r, GGMLQuantizationType.Q4_K) for i, r in enumerate(raws)], None, torch.float32
    )
    assert linear.specs[0].tiles == packs("Q4_K", sum(rows))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(linear(x), cpu_native.linear(x, weight("Q4_K", np.concatenate(raws))))

"""GGUF's super-block types (Q4_K, Q5_K, Q6_K, IQ4_XS) multiplied in place by the native kernels: against gguf's own
dequantization and a float64 matmul, exact in the integer part, batch invariant, and refused when malformed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvd.kernels import cpu_native

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


def weight(name: str, raw: np.ndarray, bias: torch.Tensor | None = None) -> cpu_native.LinearWeight:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    data = torch.from_numpy(raw.copy())
    weight.keep.append(data)  # the view holds an address, not the tensor
    return cpu_native.super_weight(cpu_native.SUPER_TYPES[name], data, raw.shape[1] // size * block, bias)


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


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_ggufs(name):
    raw = random_blocks(name, 19, 768)
    expected = gguf.quants.dequantize(raw, GGMLQuantizationType[name])
    out = cpu_native.dequantize(weight(name, raw), 0, torch.empty(19, 768))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)
    rows = cpu_native.dequantize(weight(name, raw), 5, torch.empty(3, 768, dtype=torch.bfloat16))
    assert torch.equal(rows, torch.from_numpy(expected[5:8]).bfloat16())


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 130])
def test_linear_matches_a_float64_reference(name, rows):
    raw = random_blocks(name, 37, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(37)
    y = cpu_native.linear(x, weight(name, raw, bias))
    expected = reference(raw, name, x) + bias.double().numpy()
    # Exact integer sums; the float steps round a few times per super-block.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y.double().numpy(), expected, rtol=0, atol=scale * 2e-6)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(name, dtype):
    raw = random_blocks(name, 24, 1024, seed=3)
    w = weight(name, raw)
    x = (torch.randn(150, 1024, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    together = cpu_native.linear(x, w)
    for first, count in [(0, 1), (7, 1), (3, 5), (60, 9), (149, 1), (10, 100)]:
        assert torch.equal(cpu_native.linear(x[first : first + count], w), together[first : first + count])


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

"""GGUF's 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) in kvd's 4-, 5- and 8-bit blocks, multiplied
by the native kernels: against gguf's own dequantization and a float64 matmul (the integer part exact), at row
counts that take each path (eight weight rows at a time, VNNI outer products, AMX tiles where the CPU has them),
with an odd block count and weight rows that are no whole group, and batch invariant."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from kvd.kernels import cpu_native
from kvd.model.layers.gguf_linear import BLOCK_TYPES, MXFP4_EXPONENTS, GGUFLinear

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels built")

TYPES = sorted(BLOCK_TYPES, key=lambda q: q.name)
# Where each type keeps its fp16 multipliers in a block (every other byte may be anything at all).
HALVES = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.IQ4_NL: (0,),
    Q.MXFP4: (),
}
N, K = 37, 9 * 32  # two groups of 16 and five rows more; an odd last block


def random_blocks(qtype: Q, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Rows of random blocks: every code and fifth bit random, the fp16 multipliers finite."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for at in HALVES[qtype]:
        halves = ((rng.random((rows, k // block)) - 0.5) * 0.04).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, k // block, 2)
    if qtype == Q.MXFP4:  # its exponent byte: scales 2^-24 .. 2^15, those kvd holds exactly (held_exactly)
        raw[:, :, 0] = rng.integers(MXFP4_EXPONENTS[0], MXFP4_EXPONENTS[1] + 1, size=(rows, k // block))
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: Q, x: torch.Tensor) -> np.ndarray:
    """float64 x_q @ W^T: the activations quantized as the kernels define it (int8 per 32, scale = the largest
    magnitude / 127 in float32, nearest-even codes), the weight as gguf dequantizes it."""
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    m, k = x.shape
    xs = x.float().numpy().reshape(m, k // 32, 32)
    d = np.abs(xs).max(axis=-1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    xq = (np.rint(xs * inv[..., None]).astype(np.float64) * d[..., None].astype(np.float64)).reshape(m, k)
    return xq @ w.T


@pytest.fixture(scope="module", params=TYPES, ids=lambda q: q.name)
def layer(request):
    qtype = request.param
    raw = random_blocks(qtype, N, K, seed=int(qtype))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    return qtype, raw, bias, GGUFLinear(K, [("w", raw, qtype)], bias, torch.float32)


def test_the_kernels_dequantize_as_gguf_does(layer):
    qtype, raw, _, linear = layer
    out = cpu_native.dequantize(linear.part_weight(0), 0, torch.empty(N, K))
    np.testing.assert_array_equal(out.numpy(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 64, 65, 130, 2048])
def test_linear_matches_a_float64_reference(layer, rows):
    qtype, raw, bias, linear = layer
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)) * 3
    y = linear(x)
    expected = reference(raw, qtype, x) + bias.double().numpy()
    # Exact integer block sums; the float steps round twice a block.
    np.testing.assert_allclose(y.double().numpy(), expected, rtol=0, atol=np.abs(expected).max() * 2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(layer, dtype):
    *_, linear = layer
    x = (torch.randn(130, K, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    together = linear(x)
    for lo, hi in ((0, 1), (3, 4), (5, 8), (20, 36), (64, 130), (129, 130)):
        assert torch.equal(linear(x[lo:hi]), together[lo:hi]), (lo, hi)

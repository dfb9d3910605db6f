"""The reference GGUF quantizer used to build K-quant and IQ4 fixtures: round trips through the gguf package's
dequantizers, output sizes, and that every bit of each block format is used (so a layout slip cannot hide)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_quants import quantize

Q = gguf.GGMLQuantizationType

# Relative RMS round-trip error allowed per type; measured values sit well below (about 0.07 / 0.035 / 0.017 /
# 0.075 / 0.075 on Gaussian rows), so the bounds catch a broken quantizer, not noise.
BOUNDS = {Q.Q4_K: 0.10, Q.Q5_K: 0.05, Q.Q6_K: 0.025, Q.IQ4_NL: 0.10, Q.IQ4_XS: 0.10}
TYPES = list(BOUNDS)

# Byte fields of each block: (name, start, end), from ggml's structs. The fp16 scales are left out of the
# every-bit check (a positive scale never sets its sign bit) and checked on their own.
FIELDS = {
    Q.Q4_K: [("scales", 4, 16), ("qs", 16, 144)],
    Q.Q5_K: [("scales", 4, 16), ("qh", 16, 48), ("qs", 48, 176)],
    Q.Q6_K: [("ql", 0, 128), ("qh", 128, 192), ("scales", 192, 208)],
    Q.IQ4_NL: [("qs", 2, 18)],
    Q.IQ4_XS: [("scales_h", 2, 4), ("scales_l", 4, 8), ("qs", 8, 136)],
}
D_OFFSET = {Q.Q4_K: 0, Q.Q5_K: 0, Q.Q6_K: 208, Q.IQ4_NL: 0, Q.IQ4_XS: 0}


def varied(rows: int, k: int, seed: int) -> np.ndarray:
    """Gaussian rows with a different scale per row and per 32 values, some shifted 32-value blocks (all one
    sign), an all-zero first row and an all-negative 256-value stretch (or the whole row when shorter)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k))
    sub = x.reshape(rows, k // 32, 32)
    sub *= 2.0 ** rng.uniform(-2, 2, (rows, k // 32, 1))
    shift = rng.choice([-3.0, 0.0, 0.0, 3.0], (rows, k // 32, 1))
    sub += shift * np.abs(sub).max(-1, keepdims=True)
    x *= 10.0 ** rng.uniform(-1.5, 1.5, (rows, 1))
    x[0] = 0
    if rows > 1:
        x[1, :256] = -np.abs(x[1, :256]) - 0.01
    return x.astype(np.float32)


def blocks_of(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Quantized bytes [rows, n] -> [n_blocks, type_size]."""
    return data.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])


def rel_rms(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative RMS error per row."""
    return np.sqrt(((x - y) ** 2).sum(-1) / (x**2).sum(-1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(3, 256), (17, 512), (5, 1024)], ids=str)
def test_round_trip(qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> None:
    x = varied(*shape, seed=shape[0])
    data = quantize(x, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8
    assert data.shape == (shape[0], shape[1] // block * type_size)
    y = gguf.quants.dequantize(data, qtype)
    assert y.shape == x.shape
    # A zero row comes back exactly.
    assert np.array_equal(y[0], np.zeros(shape[1], np.float32))
    errors = rel_rms(x[1:], y[1:])
    assert errors.max() < BOUNDS[qtype], errors
    # The all-negative stretch on its own (its values must not be clipped at zero).
    neg = slice(0, min(256, shape[1]))
    assert rel_rms(x[1, neg], y[1, neg]) < BOUNDS[qtype]
    # IQ4's grid has no zero (its nearest value is +1), so tiny values may come back slightly positive.
    assert y[1, neg].max() < 0.02 * np.abs(x[1, neg]).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gaussian_error(qtype: gguf.GGMLQuantizationType) -> None:
    # A plain Gaussian tensor: the error stays well inside the bound, and finer types are more accurate.
    x = np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32)
    error = rel_rms(x.ravel(), gguf.quants.dequantize(quantize(x, qtype), qtype).ravel())
    assert error < 0.8 * BOUNDS[qtype]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_bit_is_used(qtype: gguf.GGMLQuantizationType) -> None:
    # Across the blocks of a random tensor, every bit of every byte of each non-fp16 field is both set and
    # clear somewhere: a field that was packed at the wrong place or width would leave bits unused (or fail
    # the round trip above), e.g. the high bits of Q4_K's scales 4..7 or of IQ4_XS's scales_h.
    x = varied(64, 1024, seed=7)
    blocks = blocks_of(quantize(x, qtype), qtype)
    for name, start, end in FIELDS[qtype]:
        field = blocks[:, start:end]
        ored = np.bitwise_or.reduce(field, axis=0)
        anded = np.bitwise_and.reduce(field, axis=0)
        assert (ored == 0xFF).all(), (name, ored)
        assert (anded == 0).all(), (name, anded)
    d = np.ascontiguousarray(blocks[:, D_OFFSET[qtype] : D_OFFSET[qtype] + 2]).view(np.float16)[:, 0]
    assert np.isfinite(d).all()
    if qtype in (Q.Q4_K, Q.Q5_K):
        assert (d >= 0).all() and (d > 0).any()
        dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16)[:, 0]
        assert (dmin >= 0).all() and (dmin > 0).any()
    else:
        # Symmetric types pick the sign of the scale from the data.
        assert (d < 0).any() and (d > 0).any()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_k_scales_use_the_packed_high_bits(qtype: gguf.GGMLQuantizationType) -> None:
    blocks = blocks_of(quantize(varied(64, 1024, seed=3), qtype), qtype)
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    # The 6-bit range is used to the top, and scales / mins 4..7 (split across bytes 0..7 and 8..11) reach 16+.
    assert sc.max() == 63 and m.max() == 63
    assert (sc[:, 4:] >= 16).any() and (m[:, 4:] >= 16).any()
    assert (sc[:, :4] >= 32).any() and (m[:, :4] >= 32).any()
    if qtype == Q.Q5_K:
        qh = blocks[:, 16:48]
        # Each bit i of qh holds the 5th bit of sub-block i, and every sub-block uses it.
        for bit in range(8):
            assert ((qh >> bit) & 1).any(), bit


def test_q6_k_signed_scales() -> None:
    blocks = blocks_of(quantize(varied(64, 1024, seed=5), Q.Q6_K), Q.Q6_K)
    scales = blocks[:, 192:208].view(np.int8)
    assert (scales < 0).any() and (scales > 0).any()
    assert scales.min() == -128  # the largest sub-scale maps to the end of the int8 range
    qh = blocks[:, 128:192]
    for shift in (0, 2, 4, 6):
        assert set(np.unique((qh >> shift) & 3)) == {0, 1, 2, 3}, shift


def test_iq4_xs_six_bit_scales() -> None:
    blocks = blocks_of(quantize(varied(64, 1024, seed=9), Q.IQ4_XS), Q.IQ4_XS)
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)[:, 0]
    scales_l = blocks[:, 4:8]
    for ib in range(8):
        stored = ((scales_l[:, ib // 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
        # Stored +32: both signs occur at every sub-block position, and each position is sometimes the
        # largest sub-scale of its block, which maps to -32 (stored 0).
        assert (stored < 32).any() and (stored > 32).any(), ib
        assert (stored == 0).any(), ib


def test_iq4_codes_cover_the_table() -> None:
    for qtype, start in ((Q.IQ4_NL, 2), (Q.IQ4_XS, 8)):
        blocks = blocks_of(quantize(varied(16, 1024, seed=11), qtype), qtype)
        qs = blocks[:, start:]
        assert set(np.unique(qs & 0xF)) == set(range(16)) == set(np.unique(qs >> 4)), qtype.name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
def test_other_types_delegate_to_gguf(qtype: gguf.GGMLQuantizationType) -> None:
    x = varied(4, 512, seed=1)
    assert np.array_equal(quantize(x, qtype), gguf.quants.quantize(x, qtype))


def test_rejects_a_partial_block() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 300), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), Q.IQ4_NL)

"""A numpy reference quantizer for the GGUF block types that the gguf package can only dequantize.

Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS are written here, byte for byte in ggml's block layouts (the exact inverse of
gguf.quants' dequantizers); every other type is passed on to gguf.quants.quantize, so fixtures can call one function
for all types. The quantizers are simple ones in the spirit of ggml's reference code: a small vectorized search for
each sub-block's scale (and min), then the super-block scales in fp16, the 6/8-bit sub-scales rounded from them, and
the codes rounded from the rounded scales. They do not match llama.cpp bit for bit, but the round trip is close and
every field of each format (high scale bits, qh bits, signed sub-scales) is used on ordinary inputs.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# IQ4's non-uniform 4-bit grid (ggml's kvalues_iq4nl), ascending.
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)
# Q6_K's codes are 6-bit values stored +32.
_Q6_GRID = np.arange(-32, 32, dtype=np.float32)


def quantize(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """values float32 [rows, k] (k a multiple of the type's block size) -> uint8 [rows, k // block * type_size],
    the GGUF bytes of that type, which gguf.quants.dequantize turns back into values close to the input."""
    impl = _QUANTIZERS.get(qtype)
    if impl is None:
        return gguf.quants.quantize(values, qtype)
    values = np.asarray(values, dtype=np.float32)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if values.ndim == 0 or values.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("values must be finite")
    out = impl(values.reshape(-1, block))
    assert out.dtype == np.uint8 and out.shape[-1] == type_size
    return out.reshape(*values.shape[:-1], values.shape[-1] // block * type_size)


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------


def _f16(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16 and back, so later steps are computed from the scale the dequantizer will see."""
    return x.astype(np.float16).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[n] floats -> [n, 2] little-endian fp16 bytes."""
    return np.ascontiguousarray(x.astype("<f2")).reshape(-1, 1).view(np.uint8)


def _div(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x / d, with 0 where d is 0 (an all-zero block has a zero scale)."""
    safe = np.where(d == 0, 1, d)
    return np.where(d == 0, 0, x / safe).astype(np.float32)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, keeping its sign (keepdims)."""
    i = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, i, axis=-1)


def _nearest_table(grid: np.ndarray) -> np.ndarray:
    """A lookup table for _nearest: the grids are integers in -128..127, so their midpoints are multiples of 1/2
    and the nearest grid index is constant on each half-unit interval of y (a table lookup is much faster than a
    search over the grid, and this runs once per candidate scale)."""
    mid = (grid[:-1] + grid[1:]) / 2
    centers = (np.arange(-512, 512) + 0.5) / 2
    return np.searchsorted(mid, centers).astype(np.uint8)


def _nearest(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value for each element of y, from the grid's _nearest_table."""
    j = np.clip(np.floor(2 * y), -512, 511).astype(np.int32) + 512
    return table[j]


_IQ4_TABLE = _nearest_table(KVALUES_IQ4NL)
_Q6_TABLE = _nearest_table(_Q6_GRID)


def _symmetric_scales(x: np.ndarray, grid: np.ndarray, table: np.ndarray, dens: np.ndarray) -> np.ndarray:
    """Best scale s per row of x (..., n) for x ~= s * grid[code]: for each candidate s0 = absmax / den the codes
    are rounded, s is refit by least squares, and the candidate with the smallest squared error wins. Trying both
    ends of the grid (negative and positive den) lets the sign of s follow the data, as ggml's search does."""
    amax = _signed_absmax(x)
    best_err = np.full(amax.shape, np.inf, np.float32)
    best = np.zeros(amax.shape, np.float32)
    for den in dens:
        v = grid[_nearest(_div(x, amax / den), table)]
        sumv2 = (v * v).sum(-1, keepdims=True)
        s = _div((x * v).sum(-1, keepdims=True), sumv2)
        err = ((x - s * v) ** 2).sum(-1, keepdims=True)
        better = err < best_err
        best = np.where(better, s, best)
        best_err = np.where(better, err, best_err)
    return best[..., 0]


def _asymmetric_scales(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Best (scale, min) per row of x (..., n) for x ~= scale * q - min with q in 0..nmax, min >= 0 (ggml clamps
    the offset this way because the format stores min unsigned). Starts from (max - min) / nmax and tries a few
    stretched grids, each refit by least squares, like ggml's make_qkx2_quants without weights."""
    n = x.shape[-1]
    lo = np.minimum(x.min(-1, keepdims=True), 0)
    hi = x.max(-1, keepdims=True)
    rng = hi - lo
    best_scale = rng / nmax
    best_off = lo
    q = np.clip(np.round(_div(x - lo, best_scale)), 0, nmax)
    best_err = ((best_scale * q + best_off - x) ** 2).sum(-1, keepdims=True)
    for step in range(21):
        iscale = _div(np.float32(nmax - 1 + 0.1 * step), rng)
        q = np.clip(np.round(iscale * (x - lo)), 0, nmax)
        sq, sq2 = q.sum(-1, keepdims=True), (q * q).sum(-1, keepdims=True)
        sx, sqx = x.sum(-1, keepdims=True), (q * x).sum(-1, keepdims=True)
        det = n * sq2 - sq * sq
        scale = _div(n * sqx - sq * sx, det)
        off = _div(sq2 * sx - sq * sqx, det)
        # A positive offset cannot be stored: refit the scale alone with the offset at 0.
        clamp = off > 0
        scale = np.where(clamp, _div(sqx, sq2), scale)
        off = np.where(clamp, 0, off)
        err = ((scale * q + off - x) ** 2).sum(-1, keepdims=True)
        better = (det > 0) & (err < best_err)
        best_scale = np.where(better, scale, best_scale)
        best_off = np.where(better, off, best_off)
        best_err = np.where(better, err, best_err)
    return np.maximum(best_scale[..., 0], 0), np.maximum(-best_off[..., 0], 0)


def _k_scales_mins(x: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K common part for blocks [n, 256]: fp16 d and dmin, the 6-bit sub-scales and sub-mins [n, 8] and
    the codes [n, 8, 32] in 0..nmax, rounded from the rounded scales so the stored fields are self-consistent."""
    sub = x.reshape(-1, 8, 32)
    scales, mins = _asymmetric_scales(sub, nmax)
    # The largest sub-scale / sub-min maps to 63, so the 6-bit fields use their full range.
    d = _f16(scales.max(-1, keepdims=True) / 63)
    dmin = _f16(mins.max(-1, keepdims=True) / 63)
    ls = np.clip(np.round(_div(scales, d)), 0, 63)
    lm = np.clip(np.round(_div(mins, dmin)), 0, 63)
    step = (d * ls)[..., None]
    q = np.clip(np.round(_div(sub + (dmin * lm)[..., None], step)), 0, nmax).astype(np.uint8)
    return d[:, 0], dmin[:, 0], ls.astype(np.uint8), lm.astype(np.uint8), q


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> ggml's 12-byte packing: bytes 0..3 hold scales 0..3 with the top 2 bits of
    scales 4..7 above them, bytes 4..7 likewise for the mins, bytes 8..11 the low nibbles of scales / mins 4..7."""
    lo_s, hi_s = ls[:, :4], ls[:, 4:]
    lo_m, hi_m = lm[:, :4], lm[:, 4:]
    b0 = (lo_s & 0x3F) | ((hi_s >> 4) << 6)
    b1 = (lo_m & 0x3F) | ((hi_m >> 4) << 6)
    b2 = (hi_s & 0x0F) | ((hi_m & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=-1).astype(np.uint8)


def _pack_nibbles_32(q: np.ndarray) -> np.ndarray:
    """[n, 2m, 32] codes < 16 -> [n, 32m] bytes: sub-blocks 2j and 2j+1 share bytes 32j.., low nibble first."""
    q = q.reshape(q.shape[0], -1, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], -1)


def _pack_nibbles_16(q: np.ndarray) -> np.ndarray:
    """[n, m, 32] codes < 16 -> [n, 16m] bytes: in each 32-value block, value l (l < 16) is the low nibble of
    byte l and value 16 + l its high nibble (the IQ4 layout)."""
    q = q.reshape(q.shape[0], -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------------
# The block types
# ---------------------------------------------------------------------------------------------------------------


def _q4_k(x: np.ndarray) -> np.ndarray:
    """block_q4_K: fp16 d, fp16 dmin, scales[12], qs[128]; value = d * sc * q - dmin * m."""
    d, dmin, ls, lm, q = _k_scales_mins(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(ls, lm), _pack_nibbles_32(q)], -1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    """block_q5_K: fp16 d, fp16 dmin, scales[12], qh[32], qs[128]; the 5th bit of value l of sub-block i is bit
    i of qh[l]."""
    d, dmin, ls, lm, q = _k_scales_mins(x, 31)
    bit = (q >> 4).astype(np.uint8)  # [n, 8, 32]
    qh = np.bitwise_or.reduce(bit << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(ls, lm), qh, _pack_nibbles_32(q & 0x0F)]
    return np.concatenate(parts, -1).astype(np.uint8)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], int8 scales[16], fp16 d; value = d * sc * (q - 32) over 16-value sub-blocks."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    dens = np.concatenate([-32 + 0.1 * np.arange(-9, 10), 31 + 0.1 * np.arange(-9, 10)])
    scales = _symmetric_scales(sub, _Q6_GRID, _Q6_TABLE, dens)
    # The sub-scale of largest magnitude maps to -128, so sub-scales of either sign use the full int8 range.
    d = _f16(_signed_absmax(scales) / -128)
    ls = np.clip(np.round(_div(scales, d)), -128, 127)
    q = _nearest(_div(sub, (d * ls)[..., None]), _Q6_TABLE)  # 0..63, i.e. the code + 32
    # Each half of 128 values: value 64s + l (l < 64) is nibble s of ql[l]; value 32t + l (l < 32) is bits
    # 2t..2t+1 of qh[l].
    q = q.reshape(n, 2, 128)
    lo = q & 0x0F
    ql = lo[:, :, :64] | (lo[:, :, 64:] << 4)
    hi = (q >> 4).reshape(n, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    sc = ls.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc, _f16_bytes(d[:, 0])], -1).astype(
        np.uint8
    )


# Candidate denominators for IQ4 scales: map the block's largest value near either end of the grid.
_IQ4_DENS = np.concatenate([-127 + np.arange(-7, 8), 113 + np.arange(-7, 8)]).astype(np.float32)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """block_iq4_nl: fp16 d, qs[16]; value = d * kvalues[code] over 32 values."""
    s = _symmetric_scales(x, KVALUES_IQ4NL, _IQ4_TABLE, _IQ4_DENS)
    d = _f16(s)[:, None]
    q = _nearest(_div(x, d), _IQ4_TABLE)
    return np.concatenate([_f16_bytes(d[:, 0]), _pack_nibbles_16(q[:, None, :])], -1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    """block_iq4_xs: fp16 d, uint16 scales_h, scales_l[4], qs[128]; value = d * (ls - 32) * kvalues[code] over
    32-value sub-blocks, ls 6 bits: low nibble in scales_l (sub-block 2j + s in nibble s of byte j), high 2 bits
    at bits 2i..2i+1 of scales_h."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    scales = _symmetric_scales(sub, KVALUES_IQ4NL, _IQ4_TABLE, _IQ4_DENS)
    # As in ggml: the largest-magnitude sub-scale maps to -32, the others round into -32..31.
    d = _f16(_signed_absmax(scales) / -32)
    ls = np.clip(np.round(_div(scales, d)), -32, 31)
    q = _nearest(_div(sub, (d * ls)[..., None]), _IQ4_TABLE)
    stored = (ls + 32).astype(np.uint16)  # [n, 8] in 0..63
    scales_h = np.bitwise_or.reduce((stored >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1)
    low = (stored & 0x0F).astype(np.uint8).reshape(n, 4, 2)
    scales_l = low[:, :, 0] | (low[:, :, 1] << 4)
    sh = np.ascontiguousarray(scales_h.astype("<u2")).reshape(n, 1).view(np.uint8)
    return np.concatenate([_f16_bytes(d[:, 0]), sh, scales_l, _pack_nibbles_16(q)], -1).astype(np.uint8)


_QUANTIZERS = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}

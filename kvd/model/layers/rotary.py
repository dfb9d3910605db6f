"""Rotary position embedding (neox layout) with default, linear, llama3, longrope, proportional and YaRN frequency
scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvd.kernels import cpu_native


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 inverse frequencies, computed with the same operations as transformers so cos/sin match."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return inv_freq
    factor = scaling.get("factor")
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "longrope":
        # Per-frequency divisors: the long ones for a table past the trained length (llama.cpp's rule: by the
        # served length, not by each sequence's, so that every sequence and batch rotates alike).
        long = scaling["max_position_embeddings"] > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    if rope_type == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the angles as by default, the rest 0 (those
        # values pass unrotated through the same arithmetic).
        rotated = int(scaling["partial_rotary_factor"] * head_dim // 2)
        inv_freq[rotated:] = 0.0
        return inv_freq / (factor or 1.0)
    raise ValueError(f"unknown rope_type {rope_type!r}")


def _yarn_factor(scaling: dict[str, Any]) -> float:
    return (
        scaling.get("factor")
        or scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    )


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: each frequency between its original (extrapolated) and divided by factor (interpolated), by a linear
    ramp over the dimensions whose wavelengths fit between beta_fast and beta_slow turns of the trained length."""
    factor = _yarn_factor(scaling)
    trained = scaling["original_max_position_embeddings"]

    def dim_for(turns: float) -> float:  # the dimension whose frequency turns `turns` times over `trained`
        return head_dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(scaling.get("beta_fast") or 32), dim_for(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers avoids the division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    # transformers' terms, in its order, so that the float32 frequencies are the same bits.
    inverse = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (factor * inverse) * (1 - extrapolated) + 1.0 / inverse * extrapolated


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1, longrope's sqrt(1 + ln(factor) / ln(trained length)), or YaRN's
    0.1 ln(factor) + 1 (or the ratio its mscale and mscale_all_dim give)."""
    if scaling and scaling["rope_type"] == "yarn":
        return _yarn_attention_factor(scaling)
    if not scaling or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


@dataclass
class RotaryRows:
    """One forward pass's angles: (cos, signed sin) rows [T, 1, head_dim] for torch, or for the native kernel
    (CPU) the whole table and the positions, which it reads in place."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    table: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Holds cos and signed sin, full width, for every position up to max_positions; rows are looked up once
    per forward pass, so that a rotation costs four ops (apply_rotary)."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # A buffer, so model.to(dtype) casts it: transformers also casts float32 cos/sin to the model dtype.
        scale = attention_factor(scaling)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        table = torch.cat((cos, cos, -sin, sin), dim=-1)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def truncate(self, positions: int) -> None:
        """Keep the first `positions` rows only (the context served): each row is computed on its own, so the
        rows kept are the same bits; a 32k-position table of 256-wide heads is 32 MiB in bf16."""
        if positions < self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self.cos_sin_cache[:positions].clone()

    def lookup(self, positions: torch.Tensor) -> RotaryRows:
        if cpu_native.supports(self.cos_sin_cache):
            return RotaryRows(table=self.cos_sin_cache, positions=positions.contiguous())
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return RotaryRows(cos, sin)


def apply_rotary(x: torch.Tensor, rows: RotaryRows) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its positions' angles (the rotate-half layout of HF checkpoints): its
    first R values a head for a table of width 2 R (partial rotary), the rest as they are.

    transformers computes x * cos + cat(-x2, x1) * sin; rolling x by half gives cat(x2, x1), and the sign lives
    in the table (-sin | sin): the same products and sums, bit for bit, in half the ops. The native kernel does
    the same arithmetic in place (x is the caller's fresh projection output).
    """
    if rows.table is not None:
        return cpu_native.rotary(x, rows.table, rows.positions)
    width = rows.cos.shape[-1]
    part = x[..., :width]
    rotated = part * rows.cos + part.roll(width // 2, dims=-1) * rows.sin
    return rotated if width == x.shape[-1] else torch.cat((rotated, x[..., width:]), dim=-1)

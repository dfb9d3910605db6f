"""Linears and the token embedding in a GGUF file's own tensor types (quantization "gguf", on the CPU).

Each checkpoint matrix keeps its file type and runs in kvd's native kernels without a float copy:
- GGUF's super-block types (Q4_K, Q5_K, Q6_K) as the file stores them (kvd_weight.ggml);
- the 32-value block types in kvd's own block layouts, converted exactly: Q4_0 and Q4_1 as 4-bit blocks (an fp16
  scale and minimum: Q4_0's minimum is -8 x its scale), Q8_0, Q5_0 and IQ4_NL as 8-bit ones (their values are
  small integers times the block's fp16 scale: Q5_0's codes - 16, IQ4_NL's table entries);
- any other type dequantized to the model's dtype by the loader (kvd.model.gguf_native), which warns.
A fused projection (q/k/v, gate/up) keeps one part per checkpoint matrix, as its types may differ (a Q4_K_M file
often holds attn_v in Q6_K beside Q4_K q and k). Every part is batch invariant: integer block sums then one
float order, or the float kernels' one order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from kvd.kernels import cpu_native

Q = GGMLQuantizationType
# IQ4_NL's sixteen code values (GGUF's kvalues_iq4nl).
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# The 32-value block types held exactly in kvd's 4-bit (Q4_1-like) or 8-bit (Q8_0-like) blocks.
BLOCK_TYPES = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8, Q.Q5_0: 8, Q.IQ4_NL: 8}


def native_type(qtype: GGMLQuantizationType) -> bool:
    """Whether a matrix of this type runs in its own type (else it is dequantized)."""
    return qtype.name in cpu_native.SUPER_TYPES or qtype in BLOCK_TYPES


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block [N, nb, bytes] -> float16 [N, nb]."""
    return np.ascontiguousarray(blocks[:, :, at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block [N, nb, 16] -> its 32 codes [N, nb, 32] (byte i: code i low, code i + 16 high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def to_kvd_blocks(
    raw: np.ndarray, qtype: GGMLQuantizationType
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """(bits, codes [N, bytes a row], fp16 scales [N, nb], fp16 minimums [N, nb] or None) holding exactly the
    values of a 32-value block type's rows `raw` [N, row bytes]."""
    _, size = GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    d = _half(blocks, 0)
    if qtype == Q.Q4_0:
        return 4, blocks[:, :, 2:].reshape(n, -1), d, (d.astype(np.float32) * -8).astype(np.float16)
    if qtype == Q.Q4_1:
        return 4, blocks[:, :, 4:].reshape(n, -1), d, _half(blocks, 2)
    if qtype == Q.Q8_0:
        return 8, blocks[:, :, 2:].reshape(n, -1).view(np.int8), d, None
    if qtype == Q.Q5_0:
        high = np.ascontiguousarray(blocks[:, :, 2:6]).view(np.uint32)  # bit j: code j's fifth bit
        fifth = (high >> np.arange(32, dtype=np.uint32)) & 1
        codes = _nibbles(blocks[:, :, 6:]).astype(np.int16) | (fifth.astype(np.int16) << 4)
        return 8, (codes - 16).astype(np.int8).reshape(n, -1), d, None
    if qtype == Q.IQ4_NL:
        return 8, IQ4_NL_VALUES[_nibbles(blocks[:, :, 2:])].reshape(n, -1), d, None
    raise ValueError(f"{qtype.name} is not a 32-value block type kvd holds exactly")


@dataclass(frozen=True)
class PartSpec:
    """A run of rows of one layout (kind: "super", "blocks", "float") and how its buffers are read."""

    kind: str
    rows: int
    bits: int = 0  # kvd blocks: 4 or 8; float: 32 or 16
    ggml: int = 0  # super: the GGUF type number


def _converted(name: str, raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[tuple, list[np.ndarray]]:
    """(layout key, arrays by rows) of one file matrix as a part holds it: rows of the same key stack."""
    if qtype.name in cpu_native.SUPER_TYPES:
        return ("super", cpu_native.SUPER_TYPES[qtype.name]), [raw]
    if qtype in BLOCK_TYPES:
        bits, codes, scales, mins = to_kvd_blocks(raw, qtype)
        return ("blocks", bits), [codes, scales] + ([] if mins is None else [mins])
    if qtype != Q.F32:
        raise ValueError(f"{name}: GGUF type {qtype.name} has no native kernel; pass its values as F32")
    return ("float",), [raw]


class GGUFLinear(nn.Module):
    """y = x W^T (+ b), W the row-wise stack of its parts, each in its file's type (see the module's doc)."""

    batch_invariant = True  # every part is; the switch is here for kvd.model.batch_invariance's sake

    def __init__(
        self,
        in_features: int,
        parts: list[tuple[str, np.ndarray, GGMLQuantizationType]],
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        """parts: (tensor name, its rows' bytes [N, row bytes], its type), or float32 values [N, K] as F32.
        Consecutive matrices of one layout share a part (Q5_0 q and k beside a Q8_0 v: one 8-bit part), so that
        most fused projections run as one kernel call."""
        super().__init__()
        self.in_features = in_features
        self.out_sizes = [raw.shape[0] for _, raw, _ in parts]
        self.out_features = sum(self.out_sizes)
        runs: list[tuple[tuple, list[list[np.ndarray]]]] = []
        for name, raw, qtype in parts:
            key, arrays = _converted(name, raw, qtype)
            if runs and runs[-1][0] == key:
                runs[-1][1].append(arrays)
            else:
                runs.append((key, [arrays]))
        self.specs = [self._add_part(i, key, stacked, dtype) for i, (key, stacked) in enumerate(runs)]
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _add_part(self, i: int, key: tuple, stacked: list[list[np.ndarray]], dtype: torch.dtype) -> PartSpec:
        """Part i from its matrices' arrays, stacked by rows."""
        arrays = [
            torch.from_numpy(np.ascontiguousarray(np.concatenate(a))) for a in zip(*stacked, strict=True)
        ]
        rows = arrays[0].shape[0]
        if key[0] == "super":
            self.register_buffer(f"data{i}", arrays[0])
            return PartSpec("super", rows, ggml=key[1])
        if key[0] == "blocks":
            for j, t in enumerate(cpu_native.group_blocks(*arrays)):
                self.register_buffer(f"data{i}_{j}", t)
            return PartSpec("blocks", rows, bits=key[1])
        self.register_buffer(f"data{i}", arrays[0].to(dtype).contiguous())
        return PartSpec("float", rows, bits=32 if dtype == torch.float32 else 16)

    def part_weight(self, i: int) -> cpu_native.LinearWeight:
        """Part i's view for the kernels (its bias included), over its buffers where they lie now."""
        spec, bias = self.specs[i], self._part_bias(i)
        if spec.kind == "super":
            return cpu_native.super_weight(spec.ggml, getattr(self, f"data{i}"), self.in_features, bias)
        if spec.kind == "blocks":
            buffers = [getattr(self, f"data{i}_{j}") for j in range(3 if spec.bits == 4 else 2)]
            return cpu_native.linear_weight(spec.bits, *buffers, bias=bias, rows=spec.rows)
        return cpu_native.linear_weight(spec.bits, getattr(self, f"data{i}"), bias=bias)

    def _part_bias(self, i: int) -> torch.Tensor | None:
        if self.bias is None:
            return None
        start = sum(spec.rows for spec in self.specs[:i])
        return self.bias[start : start + self.specs[i].rows]

    def native_weight(self) -> cpu_native.LinearWeight:
        """The kernels' view of a linear of one part (the native layer loop takes those alone)."""
        if len(self.specs) != 1:
            raise ValueError("a linear of several parts has no single native weight")
        return self.part_weight(0)

    def native_weights(self) -> list[cpu_native.LinearWeight]:
        """Every part's view, in order (the native layer loop's multi-part projections)."""
        return [self.part_weight(i) for i in range(len(self.specs))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        parts = [cpu_native.linear(rows, weight) for weight in self.native_weights()]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).view(*x.shape[:-1], -1)

    def forward_shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per file matrix (q, k, v or gate, up): views of the parts' outputs."""
        return list(self.forward(x).split(self.out_sizes, dim=-1))


class GGUFEmbedding(nn.Module):
    """The token embedding table in its file's type (a GGUFLinear of one part, which a tied model's output
    projection shares): the rows a step looks up are dequantized into the model's dtype as it looks them up."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table.specs[0].kind == "float":
            return self.table.data0[input_ids]
        weight = self.table.part_weight(0)
        out = torch.empty(input_ids.numel(), self.table.in_features, dtype=self.dtype)
        for row, token in enumerate(input_ids.reshape(-1).tolist()):
            cpu_native.dequantize(weight, token, out[row : row + 1])
        return out.view(*input_ids.shape, -1)

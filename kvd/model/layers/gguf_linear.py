"""Linears and the token embedding in a GGUF file's own tensor types (quantization "gguf", on the CPU).

Each checkpoint matrix keeps its file type and runs in kvd's native kernels without a float copy:
- GGUF's super-block types (Q4_K, Q5_K, Q6_K, IQ4_XS) as the file stores them (kvd_weight.ggml);
- the 32-value block types in kvd's own block layouts, converted exactly: Q4_0 and Q4_1 as 4-bit blocks (an fp16
  scale and minimum: Q4_0's minimum is -8 x its scale), Q5_0 and Q5_1 as 5-bit ones (the same, and each code's
  fifth bit: Q5_0's minimum is -16 x its scale), Q8_0, IQ4_NL and MXFP4 as 8-bit ones (IQ4_NL's and MXFP4's values
  are their tables' small integers times the block's scale as an fp16: MXFP4's power of two where fp16 holds it,
  else its matrix is dequantized);
- F16 and BF16 matrices as their values: bf16 as they are, fp16 as they are in a float32 model (widened as they
  are read) and in bf16 in a bf16 one (as a float16 checkpoint loads); F32 ones in the model's dtype; float parts
  lie in the float kernels' packed order where it has one (float32 panels, bf16 tiles);
- any other type dequantized to the model's dtype by the loader (kvd.model.gguf_native), which warns.
A fused projection (q/k/v, gate/up) keeps one part per run of matrices of one layout, as its types may differ (a
Q4_K_M file often holds attn_v in Q6_K beside Q4_K q and k). Every part is batch invariant: integer block sums
then one float order, or the float kernels' one order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from kvd.distributed.shard import WHOLE, Shard
from kvd.kernels import cpu_native
from kvd.model.layers.linear import vocab_parallel_lookup

Q = GGMLQuantizationType
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> an empty tensor
# IQ4_NL's sixteen code values (GGUF's kvalues_iq4nl).
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# MXFP4's (gpt-oss's experts): the E2M1 values doubled, each block's power-of-two scale halved (GGUF's).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
# The block exponents (E8M0, 2^(e - 127), halved) whose scale an fp16 holds exactly: 2^-24 .. 2^15.
MXFP4_EXPONENTS = (104, 143)
# The 32-value block types held exactly in kvd's 4-bit (Q4_1-like), 5-bit (Q5_1-like) or 8-bit (Q8_0-like) blocks.
BLOCK_TYPES = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.IQ4_NL: 8, Q.MXFP4: 8}
# The kernels' buffers of a part of each width: codes, scales, then minimums and fifth bits where it has them.
_BUFFERS = {4: 3, 5: 4, 8: 2}
# The 16-bit float types a part holds as they are (numpy's view of their stored elements).
HALF_TYPES = {Q.F16: np.float16, Q.BF16: np.uint16}


def native_type(qtype: GGMLQuantizationType) -> bool:
    """Whether a matrix of this type runs in its own type (else it is dequantized)."""
    return qtype.name in cpu_native.SUPER_TYPES or qtype in BLOCK_TYPES or qtype in HALF_TYPES


def held_exactly(raw: np.ndarray, qtype: GGMLQuantizationType) -> bool:
    """Whether these rows of a native type convert without loss: all but MXFP4 blocks of nonzero values whose scale
    lies outside fp16's range (kvd's 8-bit blocks scale by an fp16; an all-zero block, which quantizers write with
    exponent 0, converts to a zero scale)."""
    if qtype != Q.MXFP4:
        return True
    blocks = raw.reshape(raw.shape[0], -1, GGML_QUANT_SIZES[qtype][1])
    low, high = MXFP4_EXPONENTS
    return bool(((blocks[:, :, 0] >= low) & (blocks[:, :, 0] <= high) | _zero_mxfp4(blocks)).all())


def _zero_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """Which MXFP4 blocks [N, nb, 17] hold only zeros (codes 0 and 8, E2M1's +0 and -0)."""
    return ((blocks[:, :, 1:] & 0x77) == 0).all(axis=-1)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block [N, nb, bytes] -> float16 [N, nb]."""
    return np.ascontiguousarray(blocks[:, :, at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block [N, nb, 16] -> its 32 codes [N, nb, 32] (byte i: code i low, code i + 16 high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def to_kvd_blocks(
    raw: np.ndarray, qtype: GGMLQuantizationType
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(bits, codes [N, bytes a row], fp16 scales [N, nb], fp16 minimums [N, nb] or None, fifth bits int32 [N, nb]
    or None) holding exactly the values of a 32-value block type's rows `raw` [N, row bytes]."""
    _, size = GGML_QUANT_SIZES[qtype]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    d = _half(blocks, 0)

    def words(at: int) -> np.ndarray:  # Q5's 32 fifth bits of a block (bit i: code i's)
        return np.ascontiguousarray(blocks[:, :, at : at + 4]).view(np.int32)[..., 0]

    if qtype == Q.Q4_0:
        return 4, blocks[:, :, 2:].reshape(n, -1), d, (d.astype(np.float32) * -8).astype(np.float16), None
    if qtype == Q.Q4_1:
        return 4, blocks[:, :, 4:].reshape(n, -1), d, _half(blocks, 2), None
    if qtype == Q.Q5_0:
        return (
            5,
            blocks[:, :, 6:].reshape(n, -1),
            d,
            (d.astype(np.float32) * -16).astype(np.float16),
            words(2),
        )
    if qtype == Q.Q5_1:
        return 5, blocks[:, :, 8:].reshape(n, -1), d, _half(blocks, 2), words(4)
    if qtype == Q.Q8_0:
        return 8, blocks[:, :, 2:].reshape(n, -1).view(np.int8), d, None, None
    if qtype == Q.IQ4_NL:
        return 8, IQ4_NL_VALUES[_nibbles(blocks[:, :, 2:])].reshape(n, -1), d, None, None
    if qtype == Q.MXFP4:
        # One exponent byte, then Q4_0's nibbles; its scale 2^(e - 128) as an fp16 (held_exactly), an all-zero
        # block's 0 whatever its exponent (no inf x 0).
        with np.errstate(over="ignore"):
            scale = np.ldexp(np.float32(1), blocks[:, :, 0].astype(np.int32) - 128).astype(np.float16)
        scale[_zero_mxfp4(blocks)] = 0
        return 8, MXFP4_VALUES[_nibbles(blocks[:, :, 1:])].reshape(n, -1), scale, None, None
    raise ValueError(f"{qtype.name} is not a 32-value block type kvd holds exactly")


@dataclass(frozen=True)
class PartSpec:
    """A run of rows of one layout (kind: "super", "blocks", "float") and how its buffers are read."""

    kind: str
    rows: int
    bits: int = 0  # kvd blocks: 4, 5 or 8; float: 32 or 16
    ggml: int = 0  # super: the GGUF type number
    tiles: bool = False  # float: in the float kernels' packed order (cpu_native.pack); super: pack_super's


# Rows of 32-value blocks converted at a time (a multiple of GROUP_ROWS, so chunks group as the whole would): the
# conversion's temporaries stay a few MB beside the part, where a whole embedding table's were ~4x its size.
CHUNK_ROWS = 4096


def _layout(name: str, qtype: GGMLQuantizationType, dtype: torch.dtype) -> tuple:
    """How a part holds a file matrix of this type in a model of this dtype: matrices of one layout stack into one
    part."""
    if qtype.name in cpu_native.SUPER_TYPES:
        return ("super", cpu_native.SUPER_TYPES[qtype.name])
    if qtype in BLOCK_TYPES:
        return ("blocks", BLOCK_TYPES[qtype])
    if qtype == Q.BF16:
        return ("float", torch.bfloat16)
    if qtype == Q.F16:  # fp16 has no bf16 kernel: widened in a float32 model, bf16 in a bf16 one
        return ("float", torch.float16 if dtype == torch.float32 else dtype)
    if qtype != Q.F32:
        raise ValueError(f"{name}: GGUF type {qtype.name} has no native kernel; pass its values as F32")
    return ("float", dtype)


def _values(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A float matrix's values as torch reads them (BF16's stored 16-bit words as bfloat16); torch reads no
    read-only array, so those are copied."""
    if qtype in HALF_TYPES:
        raw = raw.view(HALF_TYPES[qtype]).reshape(raw.shape[0], -1)
    values = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    return values.view(torch.bfloat16) if qtype == Q.BF16 else values


def _rows(matrices: list[tuple[np.ndarray, GGMLQuantizationType]], start: int, stop: int):
    """(rows, type) of each matrix's share of rows [start, stop) of their stack."""
    offset = 0
    for raw, qtype in matrices:
        lo, hi = max(start - offset, 0), min(stop - offset, raw.shape[0])
        if lo < hi:
            yield raw[lo:hi], qtype
        offset += raw.shape[0]


def _grouped_blocks(
    matrices: list[tuple[np.ndarray, GGMLQuantizationType]], rows: int, empty: Allocator
) -> list[torch.Tensor]:
    """The kernels' grouped blocks (cpu_native.group_blocks) of the stacked matrices, converted chunk by chunk
    into the tensors the part keeps."""
    out: list[torch.Tensor] = []
    for start in range(0, rows, CHUNK_ROWS):
        pieces = [to_kvd_blocks(raw, qtype)[1:] for raw, qtype in _rows(matrices, start, start + CHUNK_ROWS)]
        arrays = [
            np.concatenate([p[j] for p in pieces]) for j in range(len(pieces[0])) if pieces[0][j] is not None
        ]
        grouped = cpu_native.group_blocks(*(torch.from_numpy(a) for a in arrays))
        if not out:
            padded = rows + -rows % cpu_native.GROUP_ROWS
            out = [empty((padded, t.shape[1]), t.dtype) for t in grouped]
        for whole, chunk in zip(out, grouped, strict=True):
            whole[start : start + chunk.shape[0]] = chunk
    return out


def _stack_super(
    ggml: int, matrices: list[tuple[np.ndarray, GGMLQuantizationType]], out: torch.Tensor, k: int
) -> bool:
    """out = the matrices' rows stacked, in the kernels' packed layout where they have one (cpu_native.pack_super;
    then True): each matrix straight from the file's bytes where the stack's groups of rows fall within one, else
    stacked first and packed in place."""
    if any(raw.shape[0] % cpu_native.SUPER_PACK_ROWS for raw, _ in matrices[:-1]):
        np.concatenate([raw for raw, _ in matrices], out=out.numpy())
        return cpu_native.pack_super(ggml, out, k)
    packed, start = [], 0
    for raw, _ in matrices:
        packed.append(cpu_native.pack_super(ggml, out[start : start + raw.shape[0]], k, source=raw))
        start += raw.shape[0]
    return any(packed)  # the others alike, or (fewer rows than a group) the stack's rows after its groups


class GGUFLinear(nn.Module):
    """y = x W^T (+ b), W the row-wise stack of its parts, each in its file's type (see the module's doc)."""

    batch_invariant = True  # every part is; the switch is here for kvd.model.batch_invariance's sake

    def __init__(
        self,
        in_features: int,
        parts: list[tuple[str, np.ndarray, GGMLQuantizationType]],
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        empty: Allocator = lambda shape, dtype: torch.empty(shape, dtype=dtype),
    ) -> None:
        """parts: (tensor name, its rows' bytes [N, row bytes], its type), or float32 values [N, K] as F32;
        empty(shape, dtype) gives the tensors the parts keep (the loader's: 2 MiB-page arenas).
        Consecutive matrices of one layout share a part (Q4_K q and k: one part, beside a Q6_K v), so that
        most fused projections run as one kernel call."""
        super().__init__()
        self.in_features = in_features
        self.out_sizes = [raw.shape[0] for _, raw, _ in parts]
        self.out_features = sum(self.out_sizes)
        runs: list[tuple[tuple, list[tuple[np.ndarray, GGMLQuantizationType]]]] = []
        for name, raw, qtype in parts:
            layout = _layout(name, qtype, dtype)
            if runs and runs[-1][0] == layout:
                runs[-1][1].append((raw, qtype))
            else:
                runs.append((layout, [(raw, qtype)]))
        self.specs = [
            self._add_part(i, layout, matrices, dtype, empty) for i, (layout, matrices) in enumerate(runs)
        ]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._views: list[cpu_native.LinearWeight] = []  # native_weights', for the buffers at _views_at
        self._views_at: tuple[int, ...] | None = None

    def _add_part(
        self,
        i: int,
        layout: tuple,
        matrices: list[tuple[np.ndarray, GGMLQuantizationType]],
        dtype: torch.dtype,
        empty: Allocator,
    ) -> PartSpec:
        """Part i from its matrices stacked by rows, copied out of the file's (read-only) map."""
        rows = sum(raw.shape[0] for raw, _ in matrices)
        if layout[0] == "blocks":
            for j, t in enumerate(_grouped_blocks(matrices, rows, empty)):
                self.register_buffer(f"data{i}_{j}", t)
            return PartSpec("blocks", rows, bits=layout[1])
        if layout[0] == "super":
            stacked = empty((rows, matrices[0][0].shape[1]), torch.uint8)
            tiles = _stack_super(layout[1], matrices, stacked, self.in_features)
            self.register_buffer(f"data{i}", stacked)
            return PartSpec("super", rows, ggml=layout[1], tiles=tiles)
        values = torch.cat([_values(raw, qtype).to(layout[1]) for raw, qtype in matrices])
        # The packed kernels take the model's dtype alone.
        tiles = layout[1] == dtype and cpu_native.packable(values)
        stacked = empty(tuple(values.shape), layout[1])
        stacked.copy_(cpu_native.pack(values) if tiles else values)
        self.register_buffer(f"data{i}", stacked)
        return PartSpec("float", rows, bits=32 if layout[1] == torch.float32 else 16, tiles=tiles)

    def part_weight(self, i: int) -> cpu_native.LinearWeight:
        """Part i's view for the kernels (its bias included), over its buffers where they lie now."""
        spec, bias = self.specs[i], self._part_bias(i)
        if spec.kind == "super":
            return cpu_native.super_weight(
                spec.ggml, getattr(self, f"data{i}"), self.in_features, bias, packed=spec.tiles
            )
        if spec.kind == "blocks":
            codes, *rest = (getattr(self, f"data{i}_{j}") for j in range(_BUFFERS[spec.bits]))
            return cpu_native.linear_weight(
                spec.bits,
                codes,
                *rest[:2],
                bias=bias,
                rows=spec.rows,
                fifth=rest[2] if spec.bits == 5 else None,
            )
        return cpu_native.linear_weight(spec.bits, getattr(self, f"data{i}"), bias=bias, tiles=spec.tiles)

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
        """Every part's view, in order (the native layer loop's multi-part projections): built again only when a
        buffer has moved (a Python layer loop calls this for every linear of every step)."""
        where = tuple(b.data_ptr() for b in self._buffers.values())
        where += () if self.bias is None else (self.bias.data_ptr(),)
        if where != self._views_at:
            self._views = [self.part_weight(i) for i in range(len(self.specs))]
            self._views_at = where
        return self._views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        parts = [cpu_native.linear(rows, weight) for weight in self.native_weights()]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).view(*x.shape[:-1], -1)

    def forward_shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per file matrix (q, k, v or gate, up): views of the parts' outputs."""
        return list(self.forward(x).split(self.out_sizes, dim=-1))


class GGUFEmbedding(nn.Module):
    """The token embedding table in its file's type (a GGUFLinear of one part, which a tied model's output
    projection shares): the rows a step looks up are dequantized into the model's dtype as it looks them up.
    Vocab-parallel under tensor parallelism, as kvd.model.layers.linear.Embedding: the table holds this rank's
    rows from vocab_start."""

    def __init__(
        self, table: GGUFLinear, dtype: torch.dtype, shard: Shard = WHOLE, vocab_start: int = 0
    ) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.shard = shard
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(
            self._rows, input_ids, self.vocab_start, self.table.out_features, self.shard
        )

    def _rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        spec = self.table.specs[0]
        if spec.kind == "float":
            table = self.table.data0
            rows = cpu_native.unpack_rows(table, input_ids) if spec.tiles else table[input_ids]
            return rows.to(self.dtype)
        weight = self.table.part_weight(0)
        out = torch.empty(input_ids.numel(), self.table.in_features, dtype=self.dtype)
        for row, token in enumerate(input_ids.reshape(-1).tolist()):
            cpu_native.dequantize(weight, token, out[row : row + 1])
        return out.view(*input_ids.shape, -1)

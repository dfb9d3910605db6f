"""Weight-only quantized linears on the CPU: 4-bit (asymmetric) or 8-bit (symmetric) in blocks of 32 along K.

Two implementations of each, picked by what this host can run:
- kvd's native kernels (kvd.kernels.cpu_native, built on the host): the weights in GGUF Q4_1 / Q8_0's block
  layout, activations quantized per block to int8 and multiplied in integer SIMD, float32 or bfloat16 in and
  out, for every row count (batch invariance); with batch invariance off, from DEQUANTIZE_MIN_ROWS rows
  torch's GEMM on dequantized tiles instead (faster prefill, but it rounds differently). Per matmul on SmolLM2's shapes 1.2-2x
  faster than torch's kernels below, and batch-1 decode becomes bound by reading the weights.
- torch's weight-only kernels, where the native ones cannot be built: 4-bit groups, 8-bit per row.
  Activations enter them as bfloat16: their float32 and float16 paths are 10-100x slower (measured on AVX2),
  while the bfloat16 ones beat a float32 matmul at decode batch sizes even without native bf16 units.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvd.kernels import cpu_native
from kvd.model.layers.linear import Linear

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 block: a Q4_1 file's groups are reproduced exactly
_INT4_INNER_K_TILES = 2  # the packing needs K divisible by 16 x this
_ACT_DTYPE = torch.bfloat16


class QuantizationError(ValueError):
    """A quantization mode kvd cannot run here (unknown name, or not a CPU)."""


class QuantizedLinear(nn.Module):
    """Base of the quantized linears: bias, the split into stacked outputs, and the activation casts."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_sizes: list[int] | None = None
    ) -> None:
        super().__init__()
        self.out_sizes = out_sizes or [weight.shape[0]]
        self.out_features, self.in_features = weight.shape
        self.bias = bias

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]: the weight the kernel multiplies by (to bf16 precision), for comparisons."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's int4/int8 kernels take contiguous rows only (a view of the gate/up output is not).
        y = self._matmul(x.reshape(-1, self.in_features).to(_ACT_DTYPE).contiguous()).to(x.dtype)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y.add_(self.bias)

    def forward_shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per stacked matrix (q, k, v or gate, up): one kernel call, then views."""
        return list(self.forward(x).split(self.out_sizes, dim=-1))


class Int4Linear(QuantizedLinear):
    """W in 4-bit groups of INT4_GROUP_SIZE along K, each group with its own scale and minimum (asymmetric)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_sizes: list[int] | None = None
    ) -> None:
        super().__init__(weight, bias, out_sizes)
        codes, scales, mins = quantize_int4(weight.float(), INT4_GROUP_SIZE)
        # The kernel computes (code - 8) * scale + zero per group; scale and zero lie [K / group, N, 2].
        zeros = mins + 8 * scales
        scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INT4_INNER_K_TILES)
        )
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(_ACT_DTYPE))

    @staticmethod
    def supports(in_features: int) -> bool:
        return in_features % max(INT4_GROUP_SIZE, 16 * _INT4_INNER_K_TILES) == 0

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, INT4_GROUP_SIZE, self.scales_and_zeros
        )

    def dequantized_weight(self) -> torch.Tensor:
        # The kernel's own arithmetic on the identity recovers W^T without keeping the codes around.
        eye = torch.eye(self.in_features, dtype=_ACT_DTYPE)
        return self._matmul(eye).float().t().contiguous()


class Int8Linear(QuantizedLinear):
    """W in 8 bits with one scale per output row (symmetric)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_sizes: list[int] | None = None
    ) -> None:
        super().__init__(weight, bias, out_sizes)
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("weight_int8", (weight / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales.to(_ACT_DTYPE))

    @staticmethod
    def supports(in_features: int) -> bool:
        return True

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]


# Rows from which torch's GEMM on the weight dequantized for the call beats the integer kernel, whose cost
# grows with every row: a SmolLM2 layer's four linears (AVX2, 2 threads) break even at 64-128 rows, run 1.2x
# faster at 256 and 1.4x at 512.
DEQUANTIZE_MIN_ROWS = 64
DEQUANTIZE_TILE_BYTES = 4 << 20  # the dequantized tile: weight rows one GEMM takes at a time
_scratch_buffers = threading.local()


def _scratch(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] buffer of this thread's, reused by every layer: a fresh multi-MB tensor per call would
    cost more in page faults than the dequantization."""
    buffer = getattr(_scratch_buffers, "tensor", None)
    if buffer is None or buffer.numel() < rows * cols or buffer.dtype != dtype:
        buffer = _scratch_buffers.tensor = torch.empty(rows * cols, dtype=dtype)
    return buffer[: rows * cols].view(rows, cols)


class NativeQuantizedLinear(QuantizedLinear):
    """Base of the native linears: codes, fp16 scales (and minimums) in GGUF's blocks of 32 along K, laid out in
    the kernel's groups of rows (cpu_native.group_blocks)."""

    bits: ClassVar[int]
    batch_invariant = True  # set per model by kvd.model.batch_invariance

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_sizes: list[int] | None = None
    ) -> None:
        # The kernel adds a float32 bias before rounding to the activations' dtype.
        super().__init__(weight, None if bias is None else bias.detach().float().contiguous(), out_sizes)

    @staticmethod
    def supports(in_features: int) -> bool:
        return in_features % cpu_native.QBLOCK == 0

    def native_weight(self) -> cpu_native.LinearWeight:
        """The kernel's view of the buffers where they lie now (a copy of the module has its own)."""
        return cpu_native.linear_weight(
            self.bits, self.codes, self.scales, self.mins, self.bias, rows=self.out_features
        )

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> None:
        """Keep the row-order blocks in the kernel's layout."""
        grouped = cpu_native.group_blocks(codes, scales, *(() if mins is None else (mins,)))
        self.register_buffer("codes", grouped[0])
        self.register_buffer("scales", grouped[1])
        if mins is None:
            self.mins = None
        else:
            self.register_buffer("mins", grouped[2])

    def _row_blocks(self) -> tuple[torch.Tensor, ...]:
        """(codes, scales[, mins]) in row order."""
        extra = () if self.mins is None else (self.mins,)
        return cpu_native.ungroup_blocks(self.codes, self.scales, *extra, rows=self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant or x.numel() < DEQUANTIZE_MIN_ROWS * self.in_features:
            return cpu_native.linear(x, self.native_weight())
        # Many rows (prefill): torch's GEMM on the weight dequantized for this call, a tile of rows at a time
        # into one reused buffer, so that a float copy of the weight never exists whole.
        rows, cols = self.out_features, self.in_features
        tile = max(64, DEQUANTIZE_TILE_BYTES // (cols * x.element_size()))
        y = torch.empty(*x.shape[:-1], rows, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        native = self.native_weight()
        for first in range(0, rows, tile):
            count = min(tile, rows - first)
            weight = cpu_native.dequantize(native, first, _scratch(count, cols, x.dtype))
            part = None if bias is None else bias[first : first + count]
            y[..., first : first + count] = F.linear(x, weight, part)
        return y


class NativeInt4Linear(NativeQuantizedLinear):
    """W in GGUF Q4_1's blocks: 32 codes 0..15 along K with an fp16 scale and minimum."""

    bits = 4

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_sizes: list[int] | None = None
    ) -> None:
        super().__init__(weight, bias, out_sizes)
        codes, scales, mins = quantize_int4(weight.float(), cpu_native.QBLOCK)
        rows, cols = codes.shape
        # Byte j of a block holds codes j (low nibble) and j + 16 (high), as in GGUF files.
        halves = codes.to(torch.uint8).view(rows, cols // cpu_native.QBLOCK, 2, cpu_native.QBLOCK // 2)
        self._store(
            (halves[:, :, 0] | halves[:, :, 1] << 4).reshape(rows, cols // 2), scales.half(), mins.half()
        )

    def dequantized_weight(self) -> torch.Tensor:
        packed, scales, mins = self._row_blocks()
        halves = packed.reshape(packed.shape[0], -1, 1, cpu_native.QBLOCK // 2)
        codes = (
            torch.cat((halves & 15, halves >> 4), dim=2).view(packed.shape[0], -1, cpu_native.QBLOCK).float()
        )
        weight = codes * scales.float()[..., None] + mins.float()[..., None]
        return weight.view(packed.shape[0], -1)


class NativeInt8Linear(NativeQuantizedLinear):
    """W in GGUF Q8_0's blocks: 32 int8 values along K with an fp16 scale."""

    bits = 8

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_sizes: list[int] | None = None
    ) -> None:
        super().__init__(weight, bias, out_sizes)
        blocks = weight.float().view(weight.shape[0], -1, cpu_native.QBLOCK)
        # As GGUF's Q8_0 quantizer does: codes from the float32 scale, which is then stored in fp16.
        scales = blocks.abs().amax(dim=-1) / 127
        codes = (blocks / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round_()
        self._store(codes.to(torch.int8).view(weight.shape), scales.half(), None)

    def dequantized_weight(self) -> torch.Tensor:
        codes, scales = self._row_blocks()
        blocks = codes.reshape(codes.shape[0], -1, cpu_native.QBLOCK).float()
        return (blocks * scales.float()[..., None]).view(codes.shape)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 codes 0..15 [N, K], scales [N, K / group], minimums [N, K / group]): W ~ code * scale + min."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group_size, group_size)
    mins = groups.amin(dim=-1)
    scales = ((groups.amax(dim=-1) - mins) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - mins[..., None]) / scales[..., None]).round_().clamp_(0, 15)
    return codes.to(torch.int32).reshape(rows, cols), scales, mins


def linear_class(mode: str) -> type[QuantizedLinear]:
    """The linear for int4 / int8 on this host: the native kernels where they are built, else torch's."""
    if cpu_native.available():
        return {"int4": NativeInt4Linear, "int8": NativeInt8Linear}[mode]
    return {"int4": Int4Linear, "int8": Int8Linear}[mode]


# The output projection is quantized to int8 in either mode: logits are the most sensitive product of the
# model (and GGUF files keep it in 8 bits or more).
_OUTPUT_MODE = "int8"


def quantize_linears(layers: nn.Module, mode: str) -> int:
    """Replace every Linear under `layers` (the decoder layers) by its `mode` counterpart; returns the count.

    A Linear whose K the packing cannot take, or that must stay float (a router's), stays as it is.
    """
    if mode not in QUANTIZATIONS:
        raise QuantizationError(f"quantization {mode!r} is not one of {', '.join(QUANTIZATIONS)}")
    if mode == "none":
        return 0
    cls = linear_class(mode)
    targets = [
        (parent, name, child)
        for parent in layers.modules()
        for name, child in parent.named_children()
        if isinstance(child, Linear) and child.quantizable and cls.supports(child.weight.shape[1])
    ]
    for parent, name, child in targets:
        if child.weight.device.type != "cpu":
            raise QuantizationError(
                f"quantization {mode!r} runs on CPU only (torch's weight-only CPU kernels); use --quantization none"
            )
        setattr(parent, name, cls(child.row_weight(), child.bias, child.out_sizes))
    return len(targets)


def quantize_model(model: nn.Module, mode: str) -> None:
    """Quantize a CausalLM in place: its decoder layers' linears, and an int8 copy of its output projection."""
    quantize_linears(model.model.layers, mode)
    model.output_proj = quantize_output(model.float_output().weight, mode)


def quantize_output(weight: torch.Tensor, mode: str) -> QuantizedLinear | None:
    """The quantized output projection for `mode` (None for none); the float table stays for embeddings."""
    if mode == "none":
        return None
    return linear_class(_OUTPUT_MODE)(weight)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the weights of the model's linears, quantized or not (for reports)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear | QuantizedLinear):
            total += sum(t.numel() * t.element_size() for t in module.state_dict().values())
    return total

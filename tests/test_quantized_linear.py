"""Weight-only quantized linears (kvd's native kernels and torch's int4 / int8 CPU kernels) against the float
weights they stand for."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from greedy_helper import greedy_generate

from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.kernels import cpu_native
from kvd.model.gguf_loader import GGUFFile, native_quantization
from kvd.model.layers import quantized_linear
from kvd.model.layers.linear import Linear
from kvd.model.layers.quantized_linear import (
    DEQUANTIZE_MIN_ROWS,
    Int4Linear,
    Int8Linear,
    NativeInt4Linear,
    NativeInt8Linear,
    QuantizationError,
    QuantizedLinear,
    linear_class,
    linear_weight_bytes,
    quantize_linears,
    quantize_output,
)
from kvd.model.loader import load_model


def _linear(weight: torch.Tensor, out_sizes: list[int], bias: bool = False) -> Linear:
    layer = Linear(weight.shape[1], out_sizes, bias)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.copy_(torch.randn(weight.shape[0]))
    return layer


def _q4_1_grid(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights on a 4-bit grid per group of 32, as a Q4_1 file holds them, and the grid's largest step."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (rows, cols // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 quantizes each block from its own minimum and maximum
    scales, mins = torch.rand(rows, cols // 32, 1) * 0.01 + 1e-3, torch.randn(rows, cols // 32, 1) * 0.05
    return (codes * scales + mins).reshape(rows, cols), scales.max().item()


def test_int4_reproduces_a_q4_1_grid():
    """A Q4_1 grid comes back up to the rounding of its scales: bf16 in torch's layout, fp16 in the native one."""
    weight, step = _q4_1_grid(96, 128)
    # Error below 1 % of a step times the code range, plus the minimum's rounding.
    assert (
        Int4Linear(weight).dequantized_weight() - weight
    ).abs().max() < 0.1 * step + weight.abs().max() * 2**-8
    assert (NativeInt4Linear(weight).dequantized_weight() - weight).abs().max() < (
        0.01 * step + weight.abs().max() * 2**-11
    )


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the native kernels see it: int8 per block of 32, the block's largest magnitude at 127, each value
    times the float32 reciprocal of the scale rounded half to even (as the kernel computes it, ties included)."""
    blocks = x.float().view(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((blocks * inverse).round().double() * scale.double()).view(x.shape)


@pytest.mark.parametrize("cls", [NativeInt4Linear, NativeInt8Linear])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6, 7, 70, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(88, 320), (83, 352)])
def test_native_linear_is_exact_on_its_quantized_activations(cls, batch, dtype, rows, cols):
    """Integer block dot products: equal to float64 on the int8 activations and the stored weights; every
    activation-row tiling (1, 4, ragged, several tiles of 16 and work items of 256 rows for int8 on AMX, passes
    of 4 and 1-3 rows and items of 64 on AVX-512 VNNI; below 7 rows, group passes of 4, 3, 2 or 1 rows), outputs past the last tile of 16, a last group of rows
    padded (83), blocks along K in pairs (10) or with an odd one last
    (11), and a zero block (scale 0) included."""
    torch.manual_seed(batch)
    weight = torch.randn(rows, cols) * 0.05
    layer = cls(weight, torch.randn(rows), [48, rows - 48])
    x = torch.randn(batch, cols) * 3
    x[0, :32] = 0
    x = x.to(dtype)
    want = F.linear(
        _quantized_activations(x.float()), layer.dequantized_weight().double(), layer.bias.double()
    )
    got = cpu_native.linear(x, layer.native_weight())  # the kernel itself, at every batch
    assert got.dtype == dtype and got.shape == (batch, rows)
    tolerance = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    # The layer runs the kernel for every batch with batch invariance, for decode-sized ones without it.
    assert torch.equal(layer(x), got)
    assert torch.equal(torch.cat(layer.forward_shards(x), dim=-1), got)
    # Each row alone gives its row of the whole batch, bit for bit (batch invariance).
    for row in (0, batch // 2, batch - 1):
        assert torch.equal(cpu_native.linear(x[row : row + 1], layer.native_weight())[0], got[row])


@pytest.mark.parametrize("cls", [NativeInt4Linear, NativeInt8Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_multiply_the_dequantized_weight_tile_by_tile(cls, dtype, monkeypatch):
    """Without batch invariance, prefill-sized batches: torch's GEMM on the weight dequantized a tile of rows at a
    time (tiles of 64 rows here, the last one ragged), bias sliced along."""
    monkeypatch.setattr(quantized_linear, "DEQUANTIZE_TILE_BYTES", 64 * 96 * 4)
    torch.manual_seed(1)
    layer = cls(torch.randn(150, 96) * 0.05, torch.randn(150), [100, 50])
    layer.batch_invariant = False
    x = torch.randn(2, DEQUANTIZE_MIN_ROWS, 96).to(dtype)
    want = F.linear(x.double(), layer.dequantized_weight().double(), layer.bias.double())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, DEQUANTIZE_MIN_ROWS, 150)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_native_int8_matches_gguf_q8_0():
    """The native int8 layout is GGUF Q8_0's: gguf's own quantizer gives the same values."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    torch.manual_seed(0)
    weight = torch.randn(16, 256)
    packed = gguf_quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(gguf_quants.dequantize(packed, GGMLQuantizationType.Q8_0))
    assert torch.equal(NativeInt8Linear(weight).dequantized_weight(), want.float())


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_native_kernels_are_picked_where_built(mode):
    assert linear_class(mode) is {"int4": NativeInt4Linear, "int8": NativeInt8Linear}[mode]


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_quantized_linear_matches_its_dequantized_weight(cls, batch):
    torch.manual_seed(batch)
    weight = torch.randn(160, 96) * 0.05
    layer = _linear(weight, [96, 32, 32], bias=True)
    quantized = cls(layer.weight, layer.bias, layer.out_sizes)
    x = torch.randn(batch, 96)
    # Reference: the dequantized weight in float32 on the bf16-rounded input (what the kernel is fed).
    want = F.linear(x.bfloat16().float(), quantized.dequantized_weight(), layer.bias)
    got = quantized(x)
    assert got.dtype == torch.float32 and got.shape == (batch, 160)
    # The kernels accumulate in fp32 but round the output to bf16: 2^-8 relative.
    assert torch.allclose(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    shards = quantized.forward_shards(x)
    assert [s.shape[-1] for s in shards] == [96, 32, 32]
    assert torch.equal(torch.cat(shards, dim=-1), got)
    # And the quantization itself is close to the float weight: 4-bit within half a step of its group.
    error = (quantized.dequantized_weight() - weight).abs().max().item()
    assert error < (0.02 if cls is Int4Linear else 0.002)


def test_quantize_linears_rejects_unknown_modes_and_keeps_none_untouched():
    layers = torch.nn.ModuleList([_linear(torch.randn(64, 64), [64])])
    assert quantize_linears(layers, "none") == 0 and isinstance(layers[0], Linear)
    with pytest.raises(QuantizationError, match="int3"):
        quantize_linears(layers, "int3")
    with pytest.raises(EngineArgsError, match="quantization"):
        EngineArgs(quantization="int3")


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, dtype=torch.float32, quantization="none")


def test_bundled_q4_1_file_runs_int4(smollm2):
    assert native_quantization(GGUFFile(smollm2.path)) == "int4"


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_smollm2_against_its_dequantized_model(smollm2, mode):
    """Logits of the quantized model vs the float32 model holding the very weights the kernels use."""
    quantized = copy.deepcopy(smollm2.model)
    assert quantize_linears(quantized.model.layers, mode) == 4 * smollm2.config.num_hidden_layers
    quantized.output_proj = quantize_output(quantized.model.embed_tokens.row_weight(), mode)
    reference = copy.deepcopy(smollm2.model)
    reference.output_proj = _linear(quantized.output_proj.dequantized_weight(), [smollm2.config.vocab_size])
    for ours, ref in zip(quantized.model.layers.modules(), reference.model.layers.modules(), strict=True):
        if isinstance(ours, QuantizedLinear):
            ref.set_weight(ours.dequantized_weight())
    assert isinstance(quantized.output_proj, linear_class("int8"))  # logits stay 8-bit in either mode
    # int4 of a Q4_1 file keeps the file's 4-bit values: a quarter of the linears' float32 bytes or less.
    ratio = linear_weight_bytes(quantized.model.layers) / linear_weight_bytes(reference.model.layers)
    assert ratio < (0.17 if mode == "int4" else 0.27)

    prompt = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    got = greedy_generate(quantized, prompt, 8)
    want = greedy_generate(reference, prompt, 8)
    # Stated tolerance: activations enter the kernels as int8 blocks (bf16 for torch's), so a few greedy steps may
    # part ways on a near-tie; the first tokens (a well-determined answer) agree.
    assert got[:3] == want[:3], (got, want)

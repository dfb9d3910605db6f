"""Weight-only quantized linears (torch's int4 / int8 CPU kernels) against the float weights they stand for."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from greedy_helper import greedy_generate

from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.model.gguf_loader import GGUFFile, native_quantization
from kvd.model.layers.linear import Linear
from kvd.model.layers.quantized_linear import (
    Int4Linear,
    Int8Linear,
    QuantizationError,
    QuantizedLinear,
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


def test_int4_reproduces_a_q4_1_grid():
    """Weights already on a 4-bit grid per group of 32 (as a Q4_1 file holds) come back up to bf16 scales."""
    torch.manual_seed(0)
    rows, cols = 96, 128
    codes = torch.randint(0, 16, (rows, cols // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 quantizes each block from its own minimum and maximum
    scales, mins = torch.rand(rows, cols // 32, 1) * 0.01 + 1e-3, torch.randn(rows, cols // 32, 1) * 0.05
    weight = (codes * scales + mins).reshape(rows, cols)
    layer = Int4Linear(weight)
    step = scales.max().item()
    # bf16 scale and zero: error below 1 % of a step times the code range, plus the zero's rounding.
    assert (layer.dequantized_weight() - weight).abs().max() < 0.1 * step + weight.abs().max() * 2**-8


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
    quantized.output_proj = quantize_output(quantized.model.embed_tokens.weight, mode)
    reference = copy.deepcopy(smollm2.model)
    reference.output_proj = _linear(quantized.output_proj.dequantized_weight(), [smollm2.config.vocab_size])
    for ours, ref in zip(quantized.model.layers.modules(), reference.model.layers.modules(), strict=True):
        if isinstance(ours, QuantizedLinear):
            ref.weight.data.copy_(ours.dequantized_weight())
    assert isinstance(quantized.output_proj, Int8Linear)  # logits stay 8-bit in either mode
    # int4 of a Q4_1 file keeps the file's 4-bit values: a quarter of the linears' float32 bytes or less.
    ratio = linear_weight_bytes(quantized.model.layers) / linear_weight_bytes(reference.model.layers)
    assert ratio < (0.17 if mode == "int4" else 0.27)

    prompt = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    got = greedy_generate(quantized, prompt, 8)
    want = greedy_generate(reference, prompt, 8)
    # Stated tolerance: activations enter the kernels in bf16, so a few greedy steps may part ways on a
    # near-tie; the first tokens (a well-determined answer) agree.
    assert got[:3] == want[:3], (got, want)

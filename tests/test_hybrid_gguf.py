"""A Qwen3.5 GGUF file as llama.cpp's converter writes it (value heads tiled, ssm_a = -exp(A_log), norms with
their 1 added): the same logits as transformers on the Hugging Face weights, dequantized and in its own types."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_loader import tiny_hf_model, write_tiny_gguf

from kvd.kernels import cpu_native
from kvd.model.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels built")

PROMPT = [(11 * i + 5) % 250 for i in range(21)]


@pytest.fixture(scope="module")
def hf_and_file(tmp_path_factory):
    model = tiny_hf_model("qwen3_5", hidden_size=256, intermediate_size=256)
    with torch.no_grad():  # unit-variance layers, so that rounding does not blow up through the layers
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.mul_(param.shape[-1] ** -0.5)
            elif "norm" in name:
                param.mul_(0.1)
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen3_5.gguf"
    write_tiny_gguf(model, path)
    quantized = path.with_name("tiny-qwen3_5-q8.gguf")
    types = {
        f"blk.{i}.{t}.weight": Q.Q8_0 for i in range(2) for t in ("attn_qkv", "ssm_out", "ffn_up", "attn_q")
    }
    write_tiny_gguf(model, quantized, tensor_types=types)
    return model.eval(), path, quantized


def _logits(model, paged_runner) -> torch.Tensor:
    return paged_runner(model).step([("a", PROMPT)], all_logits=True)


def test_the_file_reads_as_the_checkpoint_with_tiled_value_heads(hf_and_file, paged_runner):
    hf, path, _ = hf_and_file
    loaded = load_model(str(path), dtype="float32", quantization="none")
    shape = loaded.config.linear_attention
    assert shape.tiled_value_heads and (shape.num_key_heads, shape.num_value_heads) == (2, 4)
    assert loaded.config.layer_types == ("linear_attention", "full_attention")
    assert loaded.config.rotary_dim == 4  # a quarter of 16
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = _logits(loaded.model, paged_runner)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_its_matrices_run_in_their_file_types(hf_and_file, paged_runner):
    """Q8_0 in_proj_qkv, ssm_out, ffn_up and the gated q projection run natively; the logits follow the
    dequantized model's: only the activations' int8 rounding separates them."""
    _, _, quantized = hf_and_file
    native = load_model(str(quantized), dtype="float32", quantization="gguf")
    layer = native.model.model.layers[0].linear_attn
    assert [(s.kind, s.bits) for s in layer.in_proj_qkv.specs] == [("blocks", 8)]
    reference = load_model(str(quantized), dtype="float32", quantization="none")
    got, want = _logits(native.model, paged_runner), _logits(reference.model, paged_runner)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.995
    assert (got - want).abs().max() < 0.1 * want.abs().max()

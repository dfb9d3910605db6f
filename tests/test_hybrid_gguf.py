"""Hybrid GGUF files as llama.cpp's converter writes them: Qwen3.5's (value heads tiled, ssm_a = -exp(A_log), norms
with their 1 added), Qwen3.5-MoE's (the same with experts and a shared expert) and Qwen3-Next's (value heads grouped
by key head, its betas and decay inputs fused per key head): the same logits as transformers on the Hugging Face
weights, dequantized and in their own types."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_loader import tiny_hf_model, write_tiny_gguf

from kvd.kernels import cpu_native
from kvd.model.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels built")

PROMPT = [(11 * i + 5) % 250 for i in range(21)]
# Each family's file, and Qwen3-Next's as the first converter wrote it (q/k/v/z fused per key head: ssm_in); the
# Qwen3.5 files with a multi-token-prediction layer after the model's, which kvd skips.
FAMILIES = {
    "qwen3_5": {"mtp_layers": 1},
    "qwen3_5_moe": {"mtp_layers": 1},
    "qwen3_next": {},
    "qwen3_next (ssm_in)": {"fused_qkvz": True},
}
# The matrices stored as Q8_0 (those a file of the family has): the DeltaNet's, the gated q projection, the MLP's or
# the experts' and the shared expert's.
Q8_KINDS = (
    "attn_qkv",
    "attn_gate",
    "ssm_in",
    "ssm_out",
    "ssm_ba",
    "ssm_beta",
    "ssm_alpha",
    "attn_q",
    "ffn_up",
)
Q8_KINDS += ("ffn_up_exps", "ffn_down_shexp")


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_and_file(request, tmp_path_factory):
    variant = FAMILIES[request.param]
    family = request.param.split()[0]
    model = tiny_hf_model(family, hidden_size=256, intermediate_size=256)
    with torch.no_grad():  # unit-variance layers, so that rounding does not blow up through the layers
        for name, param in model.named_parameters():
            if param.dim() > 1 and not name.endswith("mlp.gate.weight"):
                param.mul_(param.shape[-1] ** -0.5)
            elif "norm" in name:
                param.mul_(0.1)
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{family}.gguf"
    write_tiny_gguf(model, path, **variant)
    quantized = path.with_name(f"tiny-{family}-q8.gguf")
    types = {f"blk.{i}.{t}.weight": Q.Q8_0 for i in range(2) for t in Q8_KINDS}
    write_tiny_gguf(model, quantized, tensor_types=types, **variant)
    return family, model.eval(), path, quantized


def _logits(model, paged_runner) -> torch.Tensor:
    return paged_runner(model).step([("a", PROMPT)], all_logits=True)


def test_the_file_reads_as_the_checkpoint(hf_and_file, paged_runner):
    family, hf, path, _ = hf_and_file
    loaded = load_model(str(path), dtype="float32", quantization="none")
    shape = loaded.config.linear_attention
    assert shape.tiled_value_heads == (family != "qwen3_next")
    assert (shape.num_key_heads, shape.num_value_heads) == (2, 4)
    assert loaded.config.layer_types == ("linear_attention", "full_attention")
    assert loaded.config.rotary_dim == 4  # a quarter of 16
    moe = loaded.config.moe
    assert (moe is None) == (family == "qwen3_5")
    if moe is not None:  # llama.cpp rescales both families' top k
        assert (moe.num_experts, moe.top_k, moe.normalize_top_k, moe.shared_expert_size) == (4, 2, True, 96)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = _logits(loaded.model, paged_runner)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_its_matrices_run_in_their_file_types(hf_and_file, paged_runner):
    """The Q8_0 matrices run natively (Qwen3-Next's betas and decay inputs each from its rows of the fused one); the
    logits follow the dequantized model's: only the activations' int8 rounding separates them."""
    family, _, _, quantized = hf_and_file
    native = load_model(str(quantized), dtype="float32", quantization="gguf")
    layer = native.model.model.layers[0]
    for linear in (layer.linear_attn.in_proj_qkv, layer.linear_attn.in_proj_b, layer.linear_attn.in_proj_a):
        assert [(s.kind, s.bits) for s in linear.specs] == [("blocks", 8)]
    if family != "qwen3_5":
        assert [(s.kind, s.bits) for s in layer.mlp.experts[0].gate_up_proj.specs][1] == ("blocks", 8)
    reference = load_model(str(quantized), dtype="float32", quantization="none")
    got, want = _logits(native.model, paged_runner), _logits(reference.model, paged_runner)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.995
    assert (got - want).abs().max() < 0.1 * want.abs().max()

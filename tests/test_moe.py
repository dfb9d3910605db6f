"""Mixture-of-experts layers (kvd.model.layers.moe): the experts against a float64 per-token reference in every
weight format, a token's output independent of the tokens beside it (batch invariance), the router kept float,
the config's router variants read or refused by name, and info's expert figures. Parity with transformers and
every scheduling path: tests/test_model_parity.py and tests/test_batch_invariance.py (the tiny families
qwen3_moe, mixtral, gpt_oss)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import _TINY, TINY_FAMILIES

from kvd import LLM
from kvd.kernels import cpu_native
from kvd.model.config import ModelConfig, UnsupportedModelError
from kvd.model.layers.moe import RouterLinear, SparseMoE
from kvd.model.loader import load_model

MOE_FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"]
FORMATS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int4")]
# The reference multiplies float64 copies of the weights the kernels hold; what remains is the kernels' own
# rounding: bf16 activations and outputs, int8-quantized activations of the quantized kernels.
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
QUANTIZED_TOLERANCE = 3e-2


def _moe_layer(folder, dtype: str, quantization: str) -> SparseMoE:
    model = load_model(folder, dtype=dtype, quantization=quantization).model
    return next(m for m in model.modules() if isinstance(m, SparseMoE))


def _weight(linear: torch.nn.Module) -> torch.Tensor:
    """The float64 [out, in] weight a linear multiplies by, whatever its format."""
    if hasattr(linear, "dequantized_weight"):
        return linear.dequantized_weight().double()
    return linear.row_weight().double()


def _reference(layer: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64: each token's experts one by one, as the model defines them."""
    from kvd.model.layers.moe import expert_activation

    activation = expert_activation(layer.moe)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = layer.experts[int(ids[t, slot])]
            bias = [
                None if p.bias is None else p.bias.double() for p in (expert.gate_up_proj, expert.down_proj)
            ]
            gate_up = torch.nn.functional.linear(x[t : t + 1].double(), _weight(expert.gate_up_proj), bias[0])
            hidden = activation(*gate_up.split(layer.moe.intermediate_size, dim=-1))
            down = torch.nn.functional.linear(hidden, _weight(expert.down_proj), bias[1])
            out[t] += weights[t, slot].double() * down[0]
    if layer.shared_expert is not None:  # Qwen2-MoE: + sigmoid(gate x) x the shared expert's output
        shared = layer.shared_expert
        gate_up = torch.nn.functional.linear(x.double(), _weight(shared.gate_up_proj))
        hidden = activation(*gate_up.split(layer.moe.shared_expert_size, dim=-1))
        scale = torch.sigmoid(torch.nn.functional.linear(x.double(), _weight(layer.shared_expert_gate)))
        out += scale * torch.nn.functional.linear(hidden, _weight(shared.down_proj))
    return out


def _skewed_tokens(layer: SparseMoE, count: int, seed: int) -> torch.Tensor:
    """Tokens of which most go to one expert: random rows pushed along that expert's router row."""
    dtype = layer.gate.weight.dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, layer.gate.row_weight().shape[1], generator=g)
    favourite = layer.gate.row_weight()[3].float()
    x[: count * 3 // 4] += 0.5 * favourite / favourite.norm() * x.shape[1] ** 0.5
    return x.to(dtype)


@pytest.mark.skipif(not cpu_native.available(), reason="kvd's native kernels need a C compiler")
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
def test_experts_match_a_float64_reference_and_ignore_their_batch(
    tiny_checkpoint, family, dtype, quantization
):
    layer = _moe_layer(tiny_checkpoint(family), dtype, quantization)
    if quantization != "none":
        assert type(layer.gate) is RouterLinear and layer.gate.weight.dtype == getattr(torch, dtype)
        assert all(not hasattr(e.gate_up_proj, "weight") for e in layer.experts)  # the experts are quantized
    # The whole mixture in one native call, but for bf16 experts with biases (torch adds those after rounding).
    assert (layer.native() is not None) == (
        family != "gpt_oss" or (dtype, quantization) != ("bfloat16", "none")
    )
    x = _skewed_tokens(layer, 24, seed=1)
    with torch.inference_mode():
        weights, ids = layer.route(x)
        out = layer(x)
        alone = torch.cat([layer(x[t : t + 1]) for t in range(x.shape[0])])
        reversed_batch = layer(x.flip(0)).flip(0)
    counts = torch.bincount(ids.flatten(), minlength=layer.moe.num_experts)
    assert counts.max() >= x.shape[0] * 3 // 4 and (counts > 0).sum() >= 4  # one expert busy, several used
    assert torch.equal(ids, ids.sort(dim=-1).values)
    if family != "qwen3_moe":  # its top 2 are not rescaled (norm_topk_prob false)
        torch.testing.assert_close(weights.sum(-1), torch.ones(x.shape[0]), rtol=0, atol=1e-6)
    # A token's output: the same bits alone, in the batch and in another order.
    assert torch.equal(out, alone) and torch.equal(out, reversed_batch)
    ref = _reference(layer, x, ids, weights)
    tolerance = TOLERANCE[dtype] if quantization == "none" else QUANTIZED_TOLERANCE
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tolerance


def test_routing_follows_each_familys_rule(tiny_checkpoint):
    """Qwen3-MoE without norm_topk_prob: the top k of a softmax over all experts, not rescaled; Mixtral and the tiny
    Qwen2-MoE: rescaled to 1; gpt-oss: a softmax over the top k logits (its router's bias included)."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    for family in MOE_FAMILIES:
        layer = _moe_layer(tiny_checkpoint(family), "float32", "none")
        logits = torch.nn.functional.linear(x.double(), layer.gate.row_weight().double())
        if layer.gate.bias is not None:
            logits += layer.gate.bias.double()
        with torch.inference_mode():
            weights, ids = layer.route(x)
        k = layer.moe.top_k
        if family == "gpt_oss":
            top, want_ids = logits.topk(k)
            want = top.softmax(-1)
        else:
            want, want_ids = logits.softmax(-1).topk(k)
            if family in ("mixtral", "qwen2_moe"):  # the tiny Qwen2-MoE sets norm_topk_prob
                want = want / want.sum(-1, keepdim=True)
        order = want_ids.argsort(-1)
        assert torch.equal(ids, want_ids.gather(-1, order))
        torch.testing.assert_close(weights.double(), want.gather(-1, order), rtol=1e-5, atol=1e-6)


def _config(family: str, **overrides) -> dict:
    """A tiny config.json dict of the family, as transformers writes it."""
    import transformers

    class_name, extra = TINY_FAMILIES[family]
    config = getattr(transformers, class_name)(**(_TINY | extra))
    return json.loads(config.to_json_string()) | overrides


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported; only 'softmax' is"),
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported; only 'greedy' is"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is not between 1 and num_experts (8)"),
        (
            {"num_experts_per_tok": None},
            "config.json lacks num_experts (or num_local_experts) or num_experts_per_tok",
        ),
    ],
)
def test_a_router_kvd_does_not_implement_is_refused_by_name(overrides, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf_dict(_config("qwen3_moe", **overrides))


def test_each_familys_config_reads_its_experts():
    qwen = ModelConfig.from_hf_dict(
        _config("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4)
    )
    assert (
        qwen.moe.dense_layers == (0, 2) and qwen.moe.intermediate_size == 64 and not qwen.moe.normalize_top_k
    )
    mixtral = ModelConfig.from_hf_dict(_config("mixtral"))
    assert mixtral.moe.normalize_top_k and mixtral.moe.num_experts == 8 and mixtral.moe.dense_layers == ()
    oss = ModelConfig.from_hf_dict(_config("gpt_oss"))
    assert oss.moe.router_bias and oss.moe.expert_bias and oss.moe.activation == "clamped_swiglu"
    assert oss.attention_sinks and oss.layer_types == ("sliding_attention", "full_attention")
    assert oss.rope_scaling["rope_type"] == "yarn"


def test_info_reports_the_experts_and_the_bytes_a_token_reads(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("mixtral")), dtype="float32", quantization="int8", kv_cache_memory="8M")
    info = llm.engine.info()
    experts = info["experts"]
    per_expert = 3 * 64 * 64
    assert experts["num_experts"] == 8 and experts["top_k"] == 2 and experts["sparse_layers"] == 2
    assert experts["expert_parameters"] == 2 * 8 * per_expert
    assert experts["active_expert_parameters"] == 2 * 2 * per_expert
    # int8: a byte a weight and a 2-byte scale per 32
    assert experts["expert_bytes"] == 2 * 8 * per_expert * (1 + 2 / 32)
    # A token reads its 2 experts of 8 and every other weight but the embedding table (an int8 copy of lm_head
    # projects the logits; the table is looked up).
    table = llm.engine.runner.model.model.embed_tokens.weight
    read = info["weight_bytes"] - table.numel() * table.element_size() - 6 / 8 * experts["expert_bytes"]
    assert experts["active_bytes_per_token"] == read
    dense = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="8M")
    assert dense.engine.info()["experts"] is None


# GGUF: llama.cpp stacks each layer's experts in one tensor per projection (ffn_gate_exps, ...), writes Mixtral as
# a llama file with experts, and always rescales the top k (Qwen3-MoE's norm_topk_prob, set here to match).
GGUF_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GGUF_MOE = {
    "qwen3moe": (
        "Qwen3MoeConfig",
        {"head_dim": 64, "num_experts": 8, "moe_intermediate_size": 256, "norm_topk_prob": True},
    ),
    "mixtral": ("MixtralConfig", {"head_dim": 64, "num_local_experts": 8}),
    "qwen2moe": (
        "Qwen2MoeConfig",
        {
            "head_dim": 64,
            "num_experts": 8,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 512,
        },
    ),
    # A sliding layer (window 8) before a full one, sinks, YaRN (its correction range rounded, as llama.cpp has
    # it: a file has no key for it), the router's and the experts' biases.
    "gpt-oss": (
        "GptOssConfig",
        {
            "head_dim": 64,
            "num_local_experts": 8,
            "sliding_window": 8,
            "rope_parameters": TINY_FAMILIES["gpt_oss"][1]["rope_parameters"] | {"truncate": True},
        },
    ),
}
# A Q4_K_M-like mix over the experts: Q4_K gate and up but Q6_K down in layer 0, other types in layer 1.
EXPERT_TYPES = {
    "blk.0.ffn_gate_exps.weight": "Q4_K",
    "blk.0.ffn_up_exps.weight": "Q4_K",
    "blk.0.ffn_down_exps.weight": "Q6_K",
    "blk.1.ffn_gate_exps.weight": "Q8_0",
    "blk.1.ffn_up_exps.weight": "Q5_K",
    "blk.1.ffn_down_exps.weight": "Q4_0",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.1.ffn_gate_inp.weight": "F32",
}


def _moe_gguf(arch: str, folder, types: dict[str, str] | None = None, **overrides):
    """A tiny MoE model of llama.cpp's `arch` as transformers builds it (`overrides`: config values), and its GGUF
    file."""
    import transformers
    from gguf import GGMLQuantizationType
    from test_loader import tiny_vocab, write_tiny_gguf

    class_name, extra = GGUF_MOE[arch]
    tokens = tiny_vocab()[0]
    config = getattr(transformers, class_name)(
        **(GGUF_SHAPE | extra | overrides),
        num_hidden_layers=2,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        vocab_size=len(tokens),
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # unit-variance layers, a router that tells tokens apart
        for name, param in model.named_parameters():
            router = name.endswith((".gate.weight", ".router.weight"))
            scale = 1.0 if router or param.dim() == 1 else param.shape[-1] ** -0.5
            scale = 0.1 if "norm" in name or "bias" in name else scale
            param.normal_(1.0 if "norm" in name else 0.0, scale)
    path = folder / f"tiny-{arch}.gguf"
    qtypes = {n: GGMLQuantizationType[t] for n, t in (types or {}).items()}
    write_tiny_gguf(model, path, tensor_types=qtypes)
    return model, path


@pytest.mark.parametrize("arch", list(GGUF_MOE))
def test_a_gguf_mixture_of_experts_loads_as_transformers_runs_it(tmp_path, arch, paged_runner):
    model, path = _moe_gguf(arch, tmp_path)
    loaded = load_model(str(path), dtype="float32", quantization="none")
    moe = loaded.config.moe
    # llama.cpp's rules: rescaled for Qwen3-MoE and Mixtral, not for Qwen2-MoE; gpt-oss's softmax over the top k.
    assert moe.num_experts == 8 and moe.normalize_top_k == (arch in ("qwen3moe", "mixtral"))
    assert moe.shared_expert_size == (512 if arch == "qwen2moe" else 0)
    ids = list(range(3, 40, 2))
    logits = paged_runner(loaded.model).step([("a", ids)], all_logits=True)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < 1e-4


# gpt-oss's files: MXFP4 experts (with their biases), the rest in 8 bits.
OSS_EXPERT_TYPES = {
    f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in (0, 1) for p in ("gate", "up", "down")
} | {
    "blk.0.attn_q.weight": "Q8_0",
    "blk.1.ffn_down_exps.weight": "Q8_0",
}


# Qwen2-MoE's: the Q4_K_M-like experts and a shared expert of K-quants.
SHARED_EXPERT_TYPES = EXPERT_TYPES | {
    f"blk.{i}.ffn_{p}_shexp.weight": "Q6_K" if p == "down" else "Q4_K"
    for i in (0, 1)
    for p in ("gate", "up", "down")
}


@pytest.mark.skipif(not cpu_native.available(), reason="kvd's native kernels need a C compiler")
@pytest.mark.parametrize(
    ("arch", "types"),
    [("qwen3moe", EXPERT_TYPES), ("gpt-oss", OSS_EXPERT_TYPES), ("qwen2moe", SHARED_EXPERT_TYPES)],
)
def test_gguf_experts_run_in_their_file_types_and_ignore_their_batch(tmp_path, caplog, arch, types):
    from kvd.model.layers.gguf_linear import GGUFLinear

    _, path = _moe_gguf(arch, tmp_path, types)
    native = load_model(str(path), dtype="float32", quantization="auto")
    assert native.quantization == "gguf"
    layers = [m for m in native.model.modules() if isinstance(m, SparseMoE)]
    assert all(
        isinstance(p, GGUFLinear) for m in layers for e in m.experts for p in (e.gate_up_proj, e.down_proj)
    )
    assert all(type(m.gate) is RouterLinear and m.native() is not None for m in layers)
    shared = [
        p
        for m in layers
        if m.shared_expert
        for p in (m.shared_expert.gate_up_proj, m.shared_expert.down_proj)
    ]
    assert len(shared) == (4 if arch == "qwen2moe" else 0) and all(isinstance(p, GGUFLinear) for p in shared)
    if arch == "gpt-oss":  # MXFP4 held exactly in 8-bit blocks, and no warning that any was dequantized
        assert [s.bits for s in layers[0].experts[0].gate_up_proj.specs] == [8]
        assert "MXFP4" in native.file_types and not any(
            "dequantized" in r.getMessage() for r in caplog.records
        )
    float_layers = [
        m for m in load_model(str(path), dtype="float32").model.modules() if isinstance(m, SparseMoE)
    ]
    for layer, reference_layer in zip(layers, float_layers, strict=True):
        x = _skewed_tokens(layer, 20, seed=3)
        with torch.inference_mode():
            weights, ids = layer.route(x)
            out = layer(x)
            alone = torch.cat([layer(x[t : t + 1]) for t in range(x.shape[0])])
        assert torch.equal(out, alone)
        # The file's values (dequantized by gguf), in float64: the kernels' own rounding stays.
        ref = _reference(reference_layer, x, ids, weights)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < QUANTIZED_TOLERANCE


@pytest.mark.skipif(not cpu_native.available(), reason="kvd's native kernels need a C compiler")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_decode_steps_run_the_native_layer_loop_with_the_python_loops_tokens(
    tiny_checkpoint, monkeypatch, family
):
    """A MoE model's decode steps run every layer in one native call (each mixture through kvd_moe_forward), and
    give the tokens of the Python layer loop."""
    from kvd import SamplingParams
    from kvd.model.native_decode import NativeDecoder

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [7, 3]]
    llm = LLM(str(tiny_checkpoint(family)), dtype="float32", quantization="int8", kv_cache_memory="8M")
    native = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert isinstance(llm.engine.runner.model._native_decoder, NativeDecoder)
    monkeypatch.setattr(NativeDecoder, "applies", staticmethod(lambda model: False))
    python = LLM(str(tiny_checkpoint(family)), dtype="float32", quantization="int8", kv_cache_memory="8M")
    assert [o.token_ids for o in python.generate(prompts, greedy, use_tqdm=False)] == native


def test_a_quantized_gpt_oss_checkpoint_is_refused_before_any_weight_loads():
    """The released gpt-oss safetensors hold MXFP4 experts as *_blocks / *_scales: the error says what loads."""
    with pytest.raises(UnsupportedModelError, match=r"quantized with 'mxfp4'.*GGUF file"):
        ModelConfig.from_hf_dict(_config("gpt_oss", quantization_config={"quant_method": "mxfp4"}))


@pytest.mark.skipif(not cpu_native.available(), reason="kvd's native kernels need a C compiler")
def test_the_native_mixture_refuses_experts_of_other_shapes(tiny_checkpoint):
    """The kernel sizes its buffers by the config's widths: an expert whose weights disagree is refused first."""
    from kvd.model.layers.native_weights import native_parts

    layer = _moe_layer(tiny_checkpoint("mixtral"), "float32", "int8")
    assert layer.native() is not None
    router = cpu_native.linear_weight(32, layer.gate.row_weight())
    experts = [(native_parts(e.gate_up_proj), native_parts(e.down_proj)[0]) for e in layer.experts]
    with pytest.raises(cpu_native.NativeKernelError, match="expert 0 is gate/up"):
        cpu_native.ExpertWeights(router, experts, 2, 32, "softmax_topk", True, "silu")
    with pytest.raises(cpu_native.NativeKernelError, match="scores 8 experts, 7 given"):
        cpu_native.ExpertWeights(router, experts[:7], 2, 64, "softmax_topk", True, "silu")


@pytest.mark.skipif(not cpu_native.available(), reason="kvd's native kernels need a C compiler")
def test_a_gguf_mixture_with_mxfp4_experts_serves_through_the_daemon(tmp_path):
    """A gpt-oss GGUF file with MXFP4 experts, served by a real daemon: its info names the experts and the file's
    types, and a greedy request gives the tokens the model gives in process."""
    from daemon_fixtures import start_daemon

    from kvd import SamplingParams

    _, path = _moe_gguf("gpt-oss", tmp_path, OSS_EXPERT_TYPES)
    prompt = [(5 * i + 2) % 250 for i in range(20)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(path), kv_cache_memory="16M").generate([prompt], greedy, use_tqdm=False)[0].token_ids
    daemon = start_daemon(tmp_path, model=path, kv_cache_memory="16M")
    try:
        with daemon.client() as client:
            info = client.info()
            assert info["quantization"] == "gguf" and "MXFP4" in info["file_types"]
            assert info["experts"]["num_experts"] == 8 and info["experts"]["top_k"] == 2
            assert (
                client.generate(prompt, temperature=0.0, max_tokens=8, ignore_eos=True).token_ids == expected
            )
    finally:
        assert daemon.stop() == 0, daemon.log()

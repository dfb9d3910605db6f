"""Quantization "gguf": a GGUF file's matrices installed in their own types (kvd.model.layers.gguf_linear).

The decoder layers' linears, the token embedding and the output projection are built from the file's bytes,
before the float weights load; the float tensors that remain (norms, biases of linears not replaced) load as
usual. A matrix of a type without a native kernel is dequantized, with a warning naming it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from kvd.distributed.shard import ShardPlan
from kvd.model.config import ModelConfig
from kvd.model.gguf_loader import (
    PERMUTED_QK,
    GGUFError,
    GGUFFile,
    dequantize,
    expert_tensor_names,
    fused_file_tensor,
    native_quantization,
    unpermute_qk,
)
from kvd.model.huge_pages import Arenas, return_freed_heap
from kvd.model.layers.gguf_linear import GGUFEmbedding, GGUFLinear, held_exactly, native_type

logger = logging.getLogger(__name__)

# Our fused linear -> the GGUF matrices stacked in it, in order.
_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
    # A Gated DeltaNet layer's (Qwen3.5): in place of self_attn's
    "linear_attn.in_proj_qkv": ("attn_qkv",),
    "linear_attn.in_proj_z": ("attn_gate",),
    "linear_attn.in_proj_b": ("ssm_beta",),
    "linear_attn.in_proj_a": ("ssm_alpha",),
    "linear_attn.out_proj": ("ssm_out",),
}


def file_types(file: GGUFFile) -> dict[str, tuple[int, int]]:
    """Matrices' type name -> (tensor count, bytes), for `info`."""
    counts: dict[str, tuple[int, int]] = {}
    for info in file.tensors.values():
        count, nbytes = counts.get(info.qtype.name, (0, 0))
        counts[info.qtype.name] = (count + 1, nbytes + info.nbytes)
    return counts


def uses_native_types(file: GGUFFile) -> bool:
    """Whether any layer matrix of the file is of a type this mode runs in place."""
    return any(
        name.startswith("blk.") and len(info.shape) > 1 and native_type(info.qtype)
        for name, info in file.tensors.items()
    )


# Qwen3-Next's files hold the DeltaNet's betas and decay inputs in one matrix fused per key head (ssm_ba), and the
# first converter's its q/k/v/z too (ssm_in): our linear -> that matrix, the LinearAttention property naming a key
# head's parts, and its parts there (LinearAttention.fused_rows), where the file has the matrix.
_PER_KEY_HEAD = {
    "linear_attn.in_proj_b": ("ssm_ba", "ba_parts", (0,)),
    "linear_attn.in_proj_a": ("ssm_ba", "ba_parts", (1,)),
    "linear_attn.in_proj_qkv": ("ssm_in", "qkvz_parts", (0, 1, 2)),
    "linear_attn.in_proj_z": ("ssm_in", "qkvz_parts", (3,)),
}
# A mixture of experts' shared expert (Qwen2-MoE): our linear -> its GGUF matrices.
_SHARED_EXPERT = {
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
    "mlp.shared_expert.down_proj": ("ffn_down_shexp",),
}
# A GGUF matrix kind -> the Hugging Face projection whose shard plan it follows.
_HF_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
}


class _Reader:
    def __init__(self, file: GGUFFile, hf_config: dict, dtype: torch.dtype, plan: ShardPlan) -> None:
        self.file, self.dtype, self.plan = file, dtype, plan
        self.arenas = Arenas()  # the weights go straight to their 2 MiB pages: no copy moves them later
        self.heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
        self.permuted = file.architecture in PERMUTED_QK  # llama.cpp reorders their q/k rows
        self._biases: dict[str, torch.Tensor] = {}

    def part(
        self, name: str, hf_name: str, kind: str | None = None, rows: slice | int | list[int] | None = None
    ) -> tuple[str, np.ndarray, GGMLQuantizationType]:
        """(name, rows, type) of this rank's slice of one matrix (`hf_name`: the tensor whose shard plan it
        follows; `rows`: its rows of a fused file tensor, or its index in a stacked one): its stored rows when its
        type runs natively (F32 too), else float32 values."""
        info = self.file.tensors[name]
        raw = self.file.raw(info) if rows is None else self.file.raw(info)[rows]
        qtype = info.qtype
        if not native_type(qtype) and qtype != GGMLQuantizationType.F32:
            logger.warning("%s: GGUF type %s has no native kernel; dequantized", name, qtype.name)
            raw, qtype = dequantize(raw, qtype), GGMLQuantizationType.F32
        elif not held_exactly(raw, qtype):
            logger.warning("%s: %s scales beyond fp16's range; dequantized", name, qtype.name)
            raw, qtype = dequantize(raw, qtype), GGMLQuantizationType.F32
        # Rows stay the file's read-only bytes here: GGUFLinear copies them as it stacks them.
        if self.permuted and kind in self.heads:
            raw = unpermute_qk(torch.from_numpy(np.array(raw)), self.heads[kind]).numpy()
        if self.plan.shard.sharded:
            raw, qtype = self._slice(name, hf_name, raw, qtype, info.shape[-1])
        return name, raw, qtype

    def _slice(
        self, name: str, hf_name: str, raw: np.ndarray, qtype: GGMLQuantizationType, k: int
    ) -> tuple[np.ndarray, GGMLQuantizationType]:
        """This rank's rows or columns of a matrix [N, k] stored as `raw` (its rows' bytes or values); columns that
        are no whole blocks of its type are cut from its values, dequantized, with a warning."""
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, rows = self.plan.vocab_range(raw.shape[0])
            part = raw[start : start + rows]
            padding = np.zeros((rows - part.shape[0], raw.shape[1]), raw.dtype)  # zero blocks: zero values
            return np.concatenate([part, padding]), qtype
        dim, start, length = self.plan.split(hf_name, (raw.shape[0], k))
        if dim == 0:
            return raw[start : start + length], qtype
        block = GGML_QUANT_SIZES[qtype][0]
        if start % block or length % block:
            logger.warning(
                "%s: this rank's columns %d..%d are no whole %s blocks; dequantized",
                name,
                start,
                start + length,
                qtype.name,
            )
            raw, qtype, block = dequantize(raw, qtype), GGMLQuantizationType.F32, 1
        unit = raw.shape[1] // (k // block)  # a block's bytes, or 1 for values
        return raw[:, start // block * unit : (start + length) // block * unit], qtype

    def linear(
        self,
        k: int,
        names: list[str],
        hf_names: list[str],
        kinds: tuple[str | None, ...],
        biases: list[str],
        rows: list[slice | int | list[int] | None] | None = None,
    ) -> GGUFLinear:
        """The linear of these matrices; their pages leave this process's memory once it holds them."""
        rows = rows or [None] * len(names)
        parts = [self.part(*p) for p in zip(names, hf_names, kinds, rows, strict=True)]
        bias = self.bias(biases, [n.replace(".weight", ".bias") for n in hf_names], rows)
        linear = GGUFLinear(k, parts, bias, self.dtype, self.arenas.empty)
        self.file.drop_pages()
        return_freed_heap()  # the conversion's temporaries, before the next matrix's
        return linear

    def _dequantized(self, name: str) -> torch.Tensor:
        """A bias's values; a layer's stacked expert biases [E, N] (gate, up, down) are kept while its experts take
        their rows of them."""
        if name not in self._biases:
            if len(self._biases) >= 3:
                self._biases.clear()
            self._biases[name] = self.file.dequantize(name)
        return self._biases[name]

    def bias(
        self, names: list[str], hf_names: list[str], rows: list[slice | int | None]
    ) -> torch.Tensor | None:
        """The parts' biases stacked (an expert's: its row of the stacked biases), this rank's slice of each."""
        present = [n for n in names if n in self.file.tensors]
        if not present:
            return None
        if len(present) != len(names):
            raise ValueError(f"{self.file.path}: biases for only some of {names}")
        values = [self._dequantized(n) for n in names]
        values = [v if r is None or isinstance(r, slice) else v[r] for v, r in zip(values, rows, strict=True)]
        return torch.cat([self.plan.tensor(h, v) for v, h in zip(values, hf_names, strict=True)])


def install(
    model: nn.Module, file: GGUFFile, hf_config: dict, dtype: torch.dtype, plan: ShardPlan
) -> set[str]:
    """Replace the model's linears, embedding and output projection by their file-typed forms, this rank's slice
    of each (plan); returns the GGUF tensor names they took (the loader skips those)."""
    reader, taken = _Reader(file, hf_config, dtype, plan), set()
    hidden = model.config.hidden_size
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            taken |= _install_experts(reader, experts, i)
        shared = experts is not None and layer.mlp.shared_expert is not None
        for path, kinds in (_LINEARS | (_SHARED_EXPERT if shared else {})).items():
            if experts is not None and path in ("mlp.gate_up_proj", "mlp.down_proj"):
                continue
            owner, attr = path.rsplit(".", 1)
            if getattr(layer, owner.split(".")[0]) is None:
                continue  # a linear-attention layer has no self_attn, an attention layer no linear_attn
            parent = layer.get_submodule(owner)
            linear = getattr(parent, attr)
            kinds = kinds[
                : len(linear.out_sizes)
            ]  # Gemma 4's q alone (K/V shared) or q and k (keys give values)
            hf_names = [f"model.layers.{i}.{_HF_NAMES[kind]}.weight" for kind in kinds]
            fused = fused_file_tensor(file.architecture, path) if len(kinds) > 1 else None
            per_key_head = _PER_KEY_HEAD.get(path)
            if per_key_head is not None and f"blk.{i}.{per_key_head[0]}.weight" in file.tensors:
                kind, parts, indices = per_key_head
                shape = model.config.linear_attention
                rows = [[r for p in indices for r in shape.fused_rows(getattr(shape, parts), p)]]
                names = [f"blk.{i}.{kind}.weight"]
            elif fused is None:
                names, rows = [f"blk.{i}.{kind}.weight" for kind in kinds], None
            else:  # one file tensor holds the whole model's parts, stacked by rows (each rank then cuts its own)
                names = [f"blk.{i}.{fused}.weight"] * len(kinds)
                sizes = _part_rows(plan.config, path)
                ends = np.cumsum(sizes).tolist()
                rows = [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]
            biases = [f"blk.{i}.{kind}.bias" for kind in kinds]
            k = linear.weight.shape[1]
            setattr(parent, attr, reader.linear(k, names, hf_names, kinds, biases, rows))
            taken.update(names, (b for b in biases if b in file.tensors))
    embed = model.model.embed_tokens
    table = reader.linear(hidden, ["token_embd.weight"], ["model.embed_tokens.weight"], (None,), [])
    model.model.embed_tokens = GGUFEmbedding(table, dtype, embed.shard, embed.vocab_start)
    per_layer = getattr(model.model, "embed_tokens_per_layer", None)
    if per_layer is not None and _PER_LAYER_TABLE in file.tensors:  # Gemma 4's (E2B: 262,144 x 35 x 256)
        width, hf_name = per_layer.weight.shape[1], "model.embed_tokens_per_layer.weight"
        rows = reader.linear(width, [_PER_LAYER_TABLE], [hf_name], (None,), [])
        model.model.embed_tokens_per_layer = GGUFEmbedding(rows, dtype)
        taken.add(_PER_LAYER_TABLE)
    # Tied: the one table serves both.
    untied = "output.weight" in file.tensors
    output = reader.linear(hidden, ["output.weight"], ["lm_head.weight"], (None,), []) if untied else table
    model.output_proj = output
    model.lm_head = None  # the output runs from output_proj alone
    taken.update(("token_embd.weight", "output.weight"))
    return taken


# Gemma 4's per-layer token embeddings: looked up as the token embedding is, rows dequantized as they are read.
_PER_LAYER_TABLE = "per_layer_token_embd.weight"
# An expert's fused linear -> the stacked expert tensors it takes its part of, in order.
_EXPERT_LINEARS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}


def _install_experts(reader: _Reader, experts: nn.ModuleList, layer: int) -> set[str]:
    """Each expert's linears from its part of the layer's stacked expert tensors, in their file type."""
    file = reader.file
    for e, expert in enumerate(experts):
        for attr, kinds in _EXPERT_LINEARS.items():
            names = [f"blk.{layer}.{kind}.weight" for kind in kinds]
            missing = [n for n in names if n not in file.tensors]
            if missing:
                raise GGUFError(
                    f"{file.path}: layer {layer} is a mixture of experts but the file lacks {missing}"
                )
            if any(file.tensors[n].shape[0] != len(experts) for n in names):
                raise GGUFError(f"{file.path}: {names} do not hold {len(experts)} experts")
            hf_names = [expert_tensor_names(n, len(experts))[e] for n in names]
            biases = [n.replace(".weight", ".bias") for n in names]
            k = getattr(expert, attr).weight.shape[1]
            linear = reader.linear(k, names, hf_names, (None,) * len(kinds), biases, [e] * len(kinds))
            setattr(expert, attr, linear)
    kinds = [kind for kinds in _EXPERT_LINEARS.values() for kind in kinds]
    return {f"blk.{layer}.{kind}.{part}" for kind in kinds for part in ("weight", "bias")} & set(file.tensors)


def _part_rows(config: ModelConfig, path: str) -> list[int]:
    """The rows of each part of a fused projection in the whole model."""
    if path == "self_attn.qkv_proj":
        return [config.q_size, config.kv_size, config.kv_size]
    return [config.intermediate_size] * 2


def auto_quantization(file: GGUFFile, native: bool) -> str:
    """What quantization "auto" runs a GGUF file in on a CPU: "gguf" (every matrix in its file's type) where some
    layer matrix has a native kernel and `native` (the kernels built); else int4 / int8 where those hold every
    layer matrix exactly (torch's kernels run them without ours), else none."""
    if native and uses_native_types(file):
        return "gguf"
    return native_quantization(file)

"""load_model: a safetensors folder, a GGUF file, a hub id or the default model: model, config, tokenizer."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from kvd.distributed.shard import WHOLE, Shard, ShardPlan
from kvd.kernels import cpu_native
from kvd.model import gguf_native
from kvd.model.batch_invariance import set_batch_invariant
from kvd.model.config import ModelConfig, UnsupportedModelError
from kvd.model.cpu_dtype import DtypeChoice, cpu_flags, pick_cpu_dtype
from kvd.model.decoder import CausalLM
from kvd.model.gguf_loader import (
    GGUFError,
    GGUFFile,
    hf_config_from_gguf,
    iter_gguf_weights,
    load_gguf_tokenizer,
    norms_hold_offset,
)
from kvd.model.hub import ModelNotFoundError, resolve_model_path
from kvd.model.huge_pages import pack_weights
from kvd.model.layers.attention.selector import create_attention_backend, resolve_backend_name
from kvd.model.layers.quantized_linear import (
    QUANTIZATIONS,
    QuantizationError,
    quantize_model,
)
from kvd.model.registry import family_class

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from kvd.model.layers.attention import AttentionBackend

__all__ = [
    "DeviceUnavailableError",
    "GGUFError",
    "LoadedModel",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "choose_dtype",
    "load_model",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CorruptModelError(ValueError):
    """A model file that cannot be read as what its name says; the message names the file."""


class UnsupportedDtypeError(ValueError):
    """The dtype asked for does not run on the device."""


class DeviceUnavailableError(ValueError):
    """The device asked for does not exist in this process (e.g. cuda with a CPU-only torch)."""


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerFast
    name: str  # what the user asked for, or the file/folder name
    dtype: torch.dtype
    path: Path  # the folder or .gguf file the weights came from
    dtype_reason: str = ""  # why this dtype (see choose_dtype)
    quantization: str = "none"  # of the decoder layers' weights: none | int8 | int4 | gguf
    # A GGUF file's tensor types: name -> (tensor count, bytes), as the file stores them.
    file_types: dict[str, tuple[int, int]] = field(default_factory=dict)


def resolve_dtype(dtype: torch.dtype | str, hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype to run in: as given, or for "auto" bfloat16 if the checkpoint is bfloat16, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
        return torch.bfloat16 if stored == "bfloat16" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', {', '.join(map(repr, _DTYPES))}")
    return _DTYPES[dtype]


def choose_dtype(
    dtype: torch.dtype | str, hf_config: dict[str, Any], device: torch.device | str
) -> DtypeChoice:
    """The run dtype and why: "auto" on a CPU follows its cores (kvd.model.cpu_dtype), elsewhere resolve_dtype.
    float16 on a CPU is refused here, before any weight loads: kvd's CPU kernels take float32 and bfloat16."""
    if torch.device(device).type == "cpu":
        if dtype == "auto":
            return pick_cpu_dtype(cpu_flags())
        if resolve_dtype(dtype, hf_config) == torch.float16:
            here = pick_cpu_dtype(cpu_flags())
            raise UnsupportedDtypeError(
                "dtype float16 does not run on a CPU (kvd's CPU kernels take float32 and bfloat16): use auto, "
                f"which is {str(here.dtype).removeprefix('torch.')} on this one ({here.reason}), or float32"
            )
    reason = "the checkpoint's dtype (bfloat16, else float32)" if dtype == "auto" else "as asked"
    return DtypeChoice(resolve_dtype(dtype, hf_config), reason)


def load_model(
    model: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    attention_backend: AttentionBackend | str | None = None,
    quantization: str = "none",
    batch_invariant: bool = True,
    shard: Shard = WHOLE,
) -> LoadedModel:
    """Load weights, config and tokenizer without building a transformers model.

    `model`: a folder with config.json, *.safetensors and tokenizer files; a .gguf file; a folder holding a
    single .gguf file; a Hugging Face id (cache first, see kvd.model.hub); or None for SmolLM2-135M-Instruct.
    `attention_backend`: a backend, a name for kvd.model.layers.attention.selector
    (auto|torch|native|triton|flash-attn), or None for the torch backend.
    `quantization`: none | int8 | int4 | auto (on CPU, what a GGUF file holds): the decoder layers' weights stay
    quantized in memory and run through kvd's native CPU kernels, else torch's (kvd.model.layers.quantized_linear).
    `batch_invariant`: every kernel rounds a row the same whatever else shares its step (kvd.model.batch_invariance).
    `shard`: this tensor-parallel rank's slice (kvd.distributed.shard); only that slice is ever allocated, each
    checkpoint tensor is read whole and cut. The returned config is the whole model's.
    """
    device = check_device(device)
    path = resolve_model_path(model)
    gguf_path = _gguf_file(path)
    checkpoint = _open_gguf(gguf_path) if gguf_path is not None else _open_folder(path)
    config = ModelConfig.from_hf_dict(checkpoint.hf_config)  # before the slow parts: fail fast if unsupported
    quantization = _resolve_quantization(quantization, checkpoint, device)
    dtype_choice = choose_dtype(dtype, checkpoint.hf_config, device)
    run_dtype = dtype_choice.dtype
    logger.info("dtype %s: %s", str(run_dtype).removeprefix("torch."), dtype_choice.reason)
    if isinstance(attention_backend, str):  # picked for the run dtype, which "auto" resolves only here
        attention_backend = create_attention_backend(
            resolve_backend_name(attention_backend, device, run_dtype, config.max_head_dim)
        )
    tokenizer = _PARSED_TOKENIZERS.get(_tokenizer_key(gguf_path or path)) or checkpoint.load_tokenizer()
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = family_class(config.model_type).CHAT_TEMPLATE
    name = str(model) if model is not None and not Path(model).expanduser().exists() else path.stem
    causal_lm = build_causal_lm(config, attention_backend, run_dtype, device, shard)
    plan = ShardPlan(config, shard)
    taken = set()
    if quantization == "gguf":
        if checkpoint.install_native is None:
            raise QuantizationError(
                "quantization 'gguf' runs a GGUF file's own types; this model is no GGUF file"
            )
        taken = checkpoint.install_native(causal_lm, run_dtype, plan)
    family = family_class(config.model_type)
    tensors = tqdm(
        checkpoint.weights(taken),
        total=checkpoint.num_tensors - len(taken),
        desc=f"Loading {name}",
        unit="tensor",
        disable=None,
    )
    causal_lm.load_weights(  # casts to the parameters' dtype
        (
            (part, plan.tensor(part, t))
            for n, whole in tensors
            for part, t in family.checkpoint_tensors(config, n, whole)
        ),
        offset_norms=not checkpoint.norms_offset,
    )
    if quantization != "gguf":
        quantize_model(causal_lm, quantization)
    set_batch_invariant(causal_lm, batch_invariant)
    causal_lm.eval()
    if device.type == "cpu":
        pack_weights(causal_lm)
    return LoadedModel(
        causal_lm,
        config,
        tokenizer,
        name,
        run_dtype,
        gguf_path or path,
        dtype_choice.reason,
        quantization,
        checkpoint.file_types,
    )


def check_device(device: torch.device | str) -> torch.device:
    """The device, if this process can use it; DeviceUnavailableError saying what to do otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise DeviceUnavailableError(
            f"device {device} was asked for but CUDA is not available (torch {torch.__version__} is {build}, "
            "or no GPU is visible); install a CUDA build of torch on a GPU host, or use --device cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceUnavailableError(
            f"device {device} does not exist: {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return device


def build_causal_lm(
    config: ModelConfig,
    attention_backend: AttentionBackend | None,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard = WHOLE,
) -> CausalLM:
    """The model of the config's family (kvd.model.registry) with uninitialized parameters created in `dtype`
    on `device`: peak memory is the run dtype's, never float32's. Only the rotary tables are computed in float32
    (their code asks for it), then rounded to `dtype` as transformers rounds its cos/sin."""
    with torch.device(device), _default_dtype(dtype):
        causal_lm = family_class(config.model_type)(config, attention_backend, shard)
    return causal_lm.to(dtype)  # casts the float32 buffers; the parameters are already in dtype


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass
class _Checkpoint:
    hf_config: dict[str, Any]
    num_tensors: int
    load_tokenizer: Callable[[], PreTrainedTokenizerFast]
    weights: Callable[[set[str]], Iterable[tuple[str, torch.Tensor]]]  # all but the names given
    # What "auto" quantization picks on a CPU, given whether the native kernels are built there: GGUF files only.
    auto_quantization: Callable[[bool], str] = lambda native: "none"
    # GGUF files: installs this rank's slice of the matrices in their own types (quantization "gguf"); returns the
    # names it took.
    install_native: Callable[[nn.Module, torch.dtype, ShardPlan], set[str]] | None = None
    file_types: dict[str, tuple[int, int]] = field(default_factory=dict)
    norms_offset: bool = False  # its norm weights hold the family's norm_weight_offset already


def _open_gguf(path: Path) -> _Checkpoint:
    file = GGUFFile(path)
    hf_config = hf_config_from_gguf(file)
    return _Checkpoint(
        hf_config,
        len(file.tensors),
        lambda: load_gguf_tokenizer(file),
        lambda skip: iter_gguf_weights(file, hf_config, skip),
        lambda native: gguf_native.auto_quantization(file, native),
        lambda model, dtype, plan: gguf_native.install(model, file, hf_config, dtype, plan),
        gguf_native.file_types(file),
        norms_hold_offset(file),
    )


def _open_folder(path: Path) -> _Checkpoint:
    files = safetensors_files(path)
    config_path = path / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(hf_config, dict):
        raise CorruptModelError(f"{config_path} holds no JSON object")
    return _Checkpoint(
        hf_config,
        _safetensors_count(files),
        lambda: _folder_tokenizer(path),
        lambda skip: iter_safetensors(files),
    )


def _resolve_quantization(mode: str, checkpoint: _Checkpoint, device: torch.device) -> str:
    on_cpu = device.type == "cpu"
    if mode == "auto":
        return checkpoint.auto_quantization(cpu_native.available()) if on_cpu else "none"
    if mode not in (*QUANTIZATIONS, "gguf"):
        raise QuantizationError(f"quantization {mode!r} is not one of auto, gguf, {', '.join(QUANTIZATIONS)}")
    if mode != "none" and not on_cpu:
        raise QuantizationError(
            f"quantization {mode!r} runs on CPU only (torch's weight-only CPU kernels); use none on {device}"
        )
    return mode


# Tokenizers parsed ahead of their models' loads (preload_tokenizer), by file and modification time: the tokenizers
# library holds the interpreter's lock while it parses one (~0.1 s for a 50k vocabulary), which a daemon loading a
# model on demand would otherwise take from the streams of the models it serves.
_PARSED_TOKENIZERS: dict[tuple[str, int], Any] = {}


def preload_tokenizer(model: str | os.PathLike[str] | None) -> None:
    """Parse the tokenizer of `model` now, for its load later (a daemon's models loaded on demand)."""
    path = resolve_model_path(model)
    gguf_path = _gguf_file(path)
    checkpoint = _open_gguf(gguf_path) if gguf_path is not None else _open_folder(path)
    _PARSED_TOKENIZERS[_tokenizer_key(gguf_path or path)] = checkpoint.load_tokenizer()


def _tokenizer_key(path: Path) -> tuple[str, int]:
    """A model file's or folder's identity for the parsed tokenizers: its path and when it last changed."""
    marker = path if path.is_file() else path / "config.json"
    return str(path.resolve()), marker.stat().st_mtime_ns if marker.exists() else 0


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file to load, if path is one or is a folder without config.json holding exactly one."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf file; pass a .gguf file or a model folder"
            )
        return path
    if (path / "config.json").is_file():
        return None
    candidates = sorted(path.glob("*.gguf"))
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        names = ", ".join(c.name for c in candidates)
        raise ModelNotFoundError(
            f"{path} holds several GGUF files ({names}); pass the path of the one to load"
        )
    raise ModelNotFoundError(f"{path} has neither config.json (a safetensors model) nor a .gguf file")


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards: those the index names, else model.safetensors, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise ModelNotFoundError(
            f"{folder} lacks its safetensors weights ({', '.join(missing) or '*.safetensors'})"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of every shard, read one at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _safetensors_count(files: list[Path]) -> int:
    """The tensors of every shard: opening each one checks its header before the slow parts."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                total += len(f.keys())
        except SafetensorError as e:
            raise CorruptModelError(
                f"{file} is not a readable safetensors file ({e}); download it again"
            ) from None
    return total


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _folder_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not any((path / name).exists() for name in TOKENIZER_FILES):
        # Else transformers falls back to a slow tokenizer class and reports a missing package instead.
        raise UnsupportedModelError(
            f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy them from the "
            "model's repository into the folder, next to config.json"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise UnsupportedModelError(
            f"{path}: the tokenizer loads as {type(tokenizer).__name__}, not a fast tokenizer; "
            "kvd needs tokenizer.json (or files transformers converts to it)"
        )
    return tokenizer

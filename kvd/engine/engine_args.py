"""Engine settings, with the defaults kvd runs with and the validation of each."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class EngineArgsError(ValueError):
    """An engine setting is invalid; the message names it."""


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "512M", "2G", "1.5GiB" (binary units); the CLI and the API share it."""
    match = _SIZE.match(text)
    if not match:
        raise EngineArgsError(f"{text!r} is not a size: use bytes or a number with K, M, G or T")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise EngineArgsError(f"{text!r}: the size must be positive")
    return size


@dataclass
class EngineArgs:
    model: str | None = None  # folder, .gguf file or hub id; None = the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int | None = None  # tokens per KV block; None = the attention backend's default
    kv_cache_memory: int | str | None = None  # bytes or "512M"; None = sized from the two settings below
    kv_cache_memory_fraction: float = 0.1  # CPU: this fraction of available memory
    gpu_memory_utilization: float = 0.9  # CUDA: this process's share of the device memory
    attention_backend: str = "auto"  # auto | torch | native | triton | flash-attn (kvd.model.layers.selector)
    enforce_eager: bool = False  # CUDA: no torch.compile and no CUDA graphs
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's context length, capped by the pool
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # CPU threads for torch; None = all cores
    # Decoder weights kept quantized (CPU): auto = what a GGUF file holds (int4 for Q4_0/Q4_1, int8 for
    # Q8_0), none = dequantized to dtype; int8 | int4 force one (kvd.model.layers.quantized_linear).
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise EngineArgsError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise EngineArgsError(
                f"num_threads must be >= 1 (leave it unset for all cores), got {self.num_threads}"
            )
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise EngineArgsError(f"quantization must be auto, none, int8 or int4, got {self.quantization!r}")
        if self.block_size is not None and self.block_size < 1:
            raise EngineArgsError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineArgsError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise EngineArgsError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise EngineArgsError(
                f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}"
            )
        if self.max_num_seqs < 1:
            raise EngineArgsError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineArgsError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that every running sequence can decode in one step"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise EngineArgsError(f"max_model_len must be >= 2, got {self.max_model_len}")

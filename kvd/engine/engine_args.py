"""Engine settings: the defaults kvd runs with, their `kvd serve` flags and the validation of each."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvd.parallel.address import remote_refusal
from kvd.settings import positive_int, setting

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_TCP = re.compile(r"^tcp://[^/:]+:\d+/?$")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
KV_CACHE_DTYPES = ("auto", "int8")
# kvd.model.layers.attention.selector's BACKEND_NAMES, spelt out: importing it would load torch for every
# command.
ATTENTION_BACKENDS = ("auto", "torch", "native", "triton", "flash-attn")
POOLINGS = ("auto", "mean", "last")  # kvd.engine.pooling's, spelt out for the same reason
SPECULATIVE_METHODS = ("none", "ngram")  # kvd.engine.speculative's


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
    """The engine's settings; each field's help is its `kvd serve` flag's (kvd.settings)."""

    model: str | None = setting(None, "folder, .gguf file or Hugging Face id (default: bundled SmolLM2-135M)")
    dtype: str = setting("auto", "auto, float32, bfloat16 or float16 (%(default)s)")
    device: str = setting("cpu", "cpu or cuda[:N] (%(default)s)")
    block_size: int | None = setting(
        None,
        "tokens per KV block (default: the attention backend's; 16, or 256 for flash-attn)",
        type=positive_int,
    )
    # The pool's element: auto = the model's dtype; int8 = a scale and 8-bit codes per token and kv head, half a
    # bf16 pool's bytes for every decode step to read (CPU, the native attention: kvd/kernels/cpu_kernels.h).
    kv_cache_dtype: str = setting(
        "auto",
        "KV pool elements: auto = the model's dtype, int8 = 8-bit codes and a scale per token and head "
        "(CPU native attention; half the bytes of bf16) (%(default)s)",
        choices=KV_CACHE_DTYPES,
    )
    # Bytes or "512M"; None = sized by kv_cache_memory_fraction (CPU) or gpu_memory_utilization (CUDA).
    kv_cache_memory: int | str | None = setting(
        None,
        "KV pool size, e.g. 512M or 2G "
        "(default: sized by --kv-cache-memory-fraction or --gpu-memory-utilization)",
        type=parse_size,
    )
    # Bytes or "8G": the weights and pool of every model a process serves (a daemon's models share it).
    memory: int | str | None = setting(
        None,
        "one memory budget for the weights and KV pool of every model served, e.g. 8G: without --kv-cache-memory "
        "a pool takes --kv-cache-memory-fraction of what the budget has left after its weights; a daemon unloads "
        "idle models to load another within it (default: no budget)",
        type=parse_size,
    )
    kv_cache_memory_fraction: float = setting(
        0.1, "CPU: the share of available memory the KV pool takes without --kv-cache-memory (%(default)s)"
    )
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: the share of the device's memory this process may use, KV pool included (%(default)s)"
    )
    attention_backend: str = setting(
        "auto",
        "auto: flash-attn, else triton on CUDA; native (kvd's kernels), else torch on CPU (%(default)s)",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = setting(False, "CUDA: no CUDA graphs and no torch.compile")
    max_num_seqs: int = setting(128, "sequences per batch (%(default)s)")
    max_num_batched_tokens: int = setting(2048, "tokens per step (%(default)s)")
    # None = the model's context length, capped by the pool
    max_model_len: int | None = setting(None, "context length cap (default: the model's)")
    enable_prefix_caching: bool = setting(
        True, "do not reuse cached prompt prefixes", name="--no-prefix-caching"
    )
    num_threads: int | None = setting(
        None,
        "CPU threads for torch, num_threads in the Python API (default: all cores)",
        aliases=("--threads",),
        type=positive_int,
    )
    # Decoder weights kept quantized (CPU): auto = what a GGUF file holds (gguf: each matrix in its own type,
    # kvd.model.gguf_native; under tensor parallel or without the native kernels int4 for Q4_0/Q4_1, int8 for
    # Q8_0), none = dequantized to dtype; int8 | int4 force one (kvd.model.layers.quantized_linear).
    quantization: str = setting(
        "auto",
        "CPU: keep decoder weights quantized; auto = what a GGUF file holds, none = dequantize (%(default)s)",
        choices=QUANTIZATIONS,
    )
    # On: a request's logits do not depend on what else shares its steps, how its prompt was chunked or whether
    # its prefix was cached (kvd.model.batch_invariance); off: faster prefill kernels that round by batch shape.
    batch_invariant: bool = setting(
        True,
        "let a request's output depend on the batch it shares, for faster prefill (CPU; docs/architecture.md, "
        "Determinism)",
        name="--no-batch-invariance",
    )

    # Speculative decoding (kvd.engine.speculative): drafts verified in the decode step; never a different token.
    speculative: str = setting(
        "none",
        "ngram: draft tokens from the request's own text (prompt lookup) and verify them in one step; the "
        "output stays the same bits (%(default)s)",
        choices=SPECULATIVE_METHODS,
    )
    speculative_tokens: int = setting(
        32,
        "with --speculative: the most draft tokens per request and step; each draft's length follows how often "
        "the request's drafts are accepted (%(default)s)",
        type=positive_int,
    )
    ngram_max: int = setting(
        5, "with --speculative ngram: the longest suffix matched (%(default)s)", type=positive_int
    )
    ngram_min: int = setting(
        3, "with --speculative ngram: the shortest suffix matched (%(default)s)", type=positive_int
    )
    speculative_max_seqs: int = setting(
        8,
        "with --speculative: no drafts in a step that decodes more sequences than this (%(default)s)",
        type=positive_int,
    )

    # Models with linear-attention layers (kvd.engine.state_slots): prefix hits resume from state checkpoints.
    state_checkpoints: int | None = setting(
        None,
        "models with linear-attention layers: recurrent states kept at cached blocks so that a prefix hit can "
        "resume there; 0 = no prefix caching for them (default: as many as sequences can run, within a quarter "
        "of the KV cache memory)",
    )
    state_checkpoint_interval: int = setting(
        4,
        "models with linear-attention layers: a state checkpoint every this many blocks; a hit recomputes at "
        "most this many blocks' tokens (%(default)s)",
        type=positive_int,
    )

    pooling: str = setting(
        "auto",
        "how embed requests pool the final hidden states: auto (the checkpoint's choice), mean or last "
        "(%(default)s)",
        choices=POOLINGS,
    )

    # Tensor parallel (kvd.distributed, kvd.parallel, kvd.worker; docs/architecture.md, "Tensor parallel").
    tensor_parallel_size: int = setting(
        1,
        "ranks that each hold 1/N of every weight; the daemon is rank 0 and starts the others, unless "
        "--distributed-init is given (%(default)s)",
        aliases=("--world-size",),
        type=positive_int,
    )
    rank: int = setting(
        0, "this process's rank; 1..N-1 joins the daemon (rank 0) at --distributed-init instead of serving"
    )
    distributed_init: str | None = setting(
        None,
        "tcp://HOST:PORT where the ranks meet, rank 0 listening (default: a loopback port, the other ranks "
        "started by the daemon)",
    )
    # Every rank started by hand proves this secret to rank 0 and rank 0 to it (kvd.parallel.handshake); the
    # workers the daemon starts get one it makes, through a pipe.
    distributed_secret_file: str | None = setting(
        None,
        "with --distributed-init: a file of yours (mode 0600) holding the secret every rank proves; the same "
        "on every rank",
        metavar="FILE",
    )
    # The ranks' traffic after the rendezvous (every step, every activation) is neither encrypted nor
    # authenticated, so a non-loopback --distributed-init is the operator's explicit choice.
    distributed_allow_remote: bool = setting(
        False,
        "permit a non-loopback --distributed-init (its traffic is not encrypted: trusted networks only)",
    )
    distributed_timeout: float = setting(
        60.0,
        "seconds a collective may wait on another rank before the group is declared failed (%(default)s)",
    )
    cpu_binding: str = setting(
        "auto",
        "CPU cores per rank: auto (a NUMA node each, else an even split), none, or lists like 0-15|16-31 "
        "(%(default)s)",
    )

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if isinstance(self.memory, str):
            self.memory = parse_size(self.memory)
        if self.memory is not None and self.memory <= 0:
            raise EngineArgsError(f"memory must be a positive number of bytes, got {self.memory}")
        if self.memory is not None and self.tensor_parallel_size > 1:
            # Each rank holds a slice of the weights and its own pool: one budget would count rank 0's alone.
            raise EngineArgsError(
                "memory is not supported with tensor parallel yet: size each rank's pool with kv_cache_memory"
            )
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise EngineArgsError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise EngineArgsError(
                f"num_threads must be >= 1 (leave it unset for all cores), got {self.num_threads}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise EngineArgsError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineArgsError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}")
        if self.pooling not in POOLINGS:
            raise EngineArgsError(f"pooling must be auto, mean or last, got {self.pooling!r}")
        self._check_speculative()
        checkpoints = self.state_checkpoints
        if checkpoints is not None and (
            isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 0
        ):
            raise EngineArgsError(f"state_checkpoints must be a whole number >= 0, got {checkpoints!r}")
        interval = self.state_checkpoint_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise EngineArgsError(f"state_checkpoint_interval must be a whole number >= 1, got {interval!r}")
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
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise EngineArgsError(
                f"rank must be in 0..{self.tensor_parallel_size - 1} (--world-size {self.tensor_parallel_size}), "
                f"got {self.rank}"
            )
        if self.rank > 0 and self.distributed_init is None:
            raise EngineArgsError("a rank other than 0 needs --distributed-init tcp://HOST:PORT of rank 0")
        if self.distributed_init is not None and not _TCP.match(self.distributed_init):
            raise EngineArgsError(f"distributed_init must be tcp://HOST:PORT, got {self.distributed_init!r}")
        refusal = remote_refusal(self.distributed_init, self.distributed_allow_remote)
        if refusal is not None:
            raise EngineArgsError(refusal)
        if self.distributed_timeout <= 0:
            raise EngineArgsError(f"distributed_timeout must be positive, got {self.distributed_timeout}")
        if self.tensor_parallel_size == 1:
            # Settings of the ranks' placement and rendezvous: a lone rank would ignore them.
            if self.distributed_init is not None:
                raise EngineArgsError(
                    "--distributed-init is where tensor-parallel ranks meet; it needs --tensor-parallel-size 2 "
                    "or more"
                )
            if self.cpu_binding not in ("auto", "none"):
                raise EngineArgsError(
                    f"--cpu-binding {self.cpu_binding} places tensor-parallel ranks; it needs "
                    "--tensor-parallel-size 2 or more (bind one process with taskset or systemd's CPUAffinity)"
                )

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise EngineArgsError(f"speculative must be none or ngram, got {self.speculative!r}")
        for name in ("speculative_tokens", "ngram_min", "ngram_max", "speculative_max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineArgsError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise EngineArgsError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if self.speculative != "none" and not self.batch_invariant:
            raise EngineArgsError(
                "speculative decoding keeps every output the same bits only with batch invariance (a draft's "
                "rows share the step): drop --no-batch-invariance, or --speculative none"
            )

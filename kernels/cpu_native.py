"""Builds kvd's native CPU kernels (cpu_kernels.c) on this host and calls them on torch tensors.

The C file is compiled once per source, compiler and CPU (-march=native, so AVX2/AVX-512 are used where the
CPU has them) into a cache folder ($KVD_CACHE_DIR, else $XDG_CACHE_HOME/kvd or ~/.cache/kvd, else a temporary
folder), then loaded with ctypes. Without a C compiler, or with KVD_NATIVE=0, `available()` is False and kvd
runs its plain-torch paths instead; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
QBLOCK = 32  # the quantization block along K, as in the C file
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_DTYPES = (torch.float32, torch.bfloat16)


class NativeKernelError(RuntimeError):
    """A native kernel refused its input or ran out of memory."""


def _cache_dir() -> Path:
    for candidate in (
        os.environ.get("KVD_CACHE_DIR"),
        os.environ.get("XDG_CACHE_HOME") and Path(os.environ["XDG_CACHE_HOME"]) / "kvd",
        Path.home() / ".cache" / "kvd",
    ):
        if candidate:
            path = Path(candidate) / "native"
            try:
                path.mkdir(parents=True, exist_ok=True)
                if os.access(path, os.W_OK):
                    return path
            except OSError:
                continue
    path = Path(tempfile.gettempdir()) / f"kvd-native-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _compile(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), version, _cpu_flags(), *_FLAGS]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"kvd_cpu_{key}.so"
    if target.exists():
        return target
    log.info("building kvd's native CPU kernels for this host (once): %s", target)
    # Build beside the target and rename: another process may be building the same file at the same time.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise OSError(result.stderr.strip()[-2000:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.kvd_linear.argtypes = [ctypes.POINTER(LinearWeight), p, i32, i64, p, i32, i32]
    lib.kvd_paged_decode_attention.argtypes = [
        p,
        i64,
        p,
        p,
        i32,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        p,
        i64,
        p,
        f32,
        i32,
    ]
    lib.kvd_add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
    lib.kvd_store_kv.argtypes = [p, i64, p, i64, p, i32, i64, i64, p, i64]
    lib.kvd_rotary.argtypes = [p, i64, i32, i64, i64, i64, p, p]
    lib.kvd_rms_norm.argtypes = [p, i64, p, i64, i64, i64, i64, p, f32]
    lib.kvd_decode_layers.argtypes = [p, p, i64, p, p, i64, p, p, p, p, i64, p, i32]
    lib.kvd_dequantize.argtypes = [ctypes.POINTER(LinearWeight), i64, i64, p, i32, i32]
    for fn in (lib.kvd_add_rms_norm, lib.kvd_rms_norm, lib.kvd_store_kv, lib.kvd_rotary, lib.kvd_dequantize):
        fn.restype = None
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (and a logged reason) when they cannot be built or are switched off."""
    if os.environ.get("KVD_NATIVE", "1") == "0":
        log.info("native CPU kernels switched off (KVD_NATIVE=0): plain torch paths run")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning(
            "no C compiler found: kvd runs its slower plain-torch CPU paths; install gcc (or set $CC) for its "
            "native CPU kernels"
        )
        return None
    try:
        return _declare(ctypes.CDLL(str(_compile(compiler))))
    except OSError as exc:
        log.warning("building kvd's native CPU kernels failed, plain-torch CPU paths run instead:\n%s", exc)
        return None


def available() -> bool:
    return library() is not None


def supports(t: torch.Tensor) -> bool:
    """Whether the native kernels take this tensor: on the CPU, float32 or bfloat16, and native kernels built.

    Never while torch.compile traces: a graph holds torch ops only (compiled paths run torch's code).
    """
    if torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" and t.dtype in _DTYPES and available()


def _threads() -> int:
    return torch.get_num_threads()


def _check(status: int, what: str) -> None:
    if status != 0:
        raise NativeKernelError(f"{what}: out of memory")


def address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class LinearWeight(ctypes.Structure):
    """kvd_weight: a linear's buffers and shape. Addresses are plain integers (not ctypes pointers), so a module
    holding one can still be deep-copied; its owner rebuilds it when its buffers move (linear_weight)."""

    _fields_ = [
        ("data", ctypes.c_size_t),
        ("scales", ctypes.c_size_t),
        ("mins", ctypes.c_size_t),
        ("bias", ctypes.c_size_t),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bits", ctypes.c_int32),
    ]


def linear_weight(
    cached: LinearWeight | None,
    bits: int,
    data: torch.Tensor,
    scales: torch.Tensor | None = None,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> LinearWeight:
    """The kernel's view of a weight [N, K]: 4-bit (data uint8 [N, K/2], scales/mins float16 [N, K/32]), 8-bit
    (data int8 [N, K], scales float16 [N, K/32]) in blocks of 32 along K, or float32 (bits 32: data [N, K]); an
    optional float32 bias [N]. `cached` is returned when it still points at these buffers."""
    if cached is not None and (cached.data, cached.bias) == (data.data_ptr(), address(bias)):
        return cached
    if bias is not None and bias.dtype != torch.float32:
        raise NativeKernelError(f"the bias of a native linear is float32, not {bias.dtype}")
    k = data.shape[1] * 2 if bits == 4 else data.shape[1]
    return LinearWeight(
        data.data_ptr(), address(scales), address(mins), address(bias), data.shape[0], k, bits
    )


def linear(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias), in x's dtype (float32 only for a float32 weight)."""
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], weight.n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    status = library().kvd_linear(
        ctypes.byref(weight), x.data_ptr(), bf16, x.numel() // weight.k, y.data_ptr(), bf16, _threads()
    )
    _check(status, "linear")
    return y


def dequantize(weight: LinearWeight, first: int, out: torch.Tensor) -> torch.Tensor:
    """Rows first .. first + len(out) of a 4- or 8-bit weight into out [rows, K] (float32 or bfloat16,
    contiguous); returns out."""
    bf16 = int(out.dtype == torch.bfloat16)
    library().kvd_dequantize(ctypes.byref(weight), first, out.shape[0], out.data_ptr(), bf16, _threads())
    return out


def _token_stride(x: torch.Tensor) -> int:
    """Elements from one token's row to the next in x [T, heads, D], whose heads must lie packed in a row."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        raise NativeKernelError(
            f"heads of a {tuple(x.shape)} tensor with strides {x.stride()} are not packed"
        )
    return x.stride(0)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [S, H, D] (one new token per sequence) over the pool [2, blocks, block_size, kv_heads, D] in place.

    block_tables int32 [S, width] and context_lens int32 [S] (tokens cached, this one included).
    """
    out = torch.empty(q.shape, dtype=q.dtype)
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    status = library().kvd_paged_decode_attention(
        q.data_ptr(), _token_stride(q), out.data_ptr(), kv_cache.data_ptr(), int(q.dtype == torch.bfloat16),
        num_blocks, block_size, kv_heads, head_dim, q.shape[0], q.shape[1], block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), scale, _threads(),
    )  # fmt: skip
    _check(status, "paged decode attention")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k and v [T, kv_heads, D] into the pool's slots (long [T]; -1 = skip)."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    library().kvd_store_kv(
        k.data_ptr(), _token_stride(k), v.data_ptr(), _token_stride(v), kv_cache.data_ptr(),
        int(k.dtype == torch.bfloat16),
        num_slots, k.shape[1] * k.shape[2], slots.data_ptr(), k.shape[0],
    )  # fmt: skip


def rotary(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place by cos_sin's rows [positions] (cos | signed sin, x's dtype); returns x."""
    library().kvd_rotary(
        x.data_ptr(), _token_stride(x), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], x.shape[2],
        cos_sin.data_ptr(), positions.data_ptr(),
    )  # fmt: skip
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight over x's last dimension, float32; x [T, heads, D] with packed heads, or [T, D]."""
    if not x.dtype == weight.dtype == torch.float32:
        raise NativeKernelError(f"rms_norm runs in float32, not {x.dtype}")
    rows = x if x.dim() == 3 else x.contiguous().view(-1, 1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=torch.float32)
    library().kvd_rms_norm(
        rows.data_ptr(), _token_stride(rows), out.data_ptr(), out.stride(0), rows.shape[0], rows.shape[1],
        rows.shape[2], weight.data_ptr(), eps,
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x) in float32; the sum is written into `residual` (contiguous)."""
    if not x.dtype == residual.dtype == weight.dtype == torch.float32:
        raise NativeKernelError(f"add_rms_norm runs in float32, not {x.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    library().kvd_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps,
        _threads(),
    )  # fmt: skip
    return out, residual

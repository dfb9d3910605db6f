"""kvd's native CPU kernels called on torch tensors: every call into them goes through this module.

The library is built and loaded by native_build (cffi, from the declarations in cpu_kernels.h). The wrappers
check what the C code cannot (dtypes, shapes, packed rows); the kernels check every index into the KV pool and
the rotary table themselves and refuse a bad one before writing (NativeKernelError, never a stray write).
The structs are described to Python by named tuples whose fields are read from the header, so they cannot
drift from it; a tuple holds addresses as plain integers, so a module holding one can still be deep-copied.
"""

from __future__ import annotations

from collections import namedtuple
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from kvd.kernels.native_build import ffi, library

# The quantized weights' block along K and the weight rows of a group of their layout: read from cpu_kernels.h,
# which the C files read too (enum kvd_block), so both lay blocks out alike.
_BLOCK = ffi.typeof("enum kvd_block").relements
QBLOCK = _BLOCK["KVD_QBLOCK"]
GROUP_ROWS = _BLOCK["KVD_GROUP_ROWS"]
# GGUF's super-block types that run in place (enum kvd_ggml): name as GGUF spells it -> its type number.
SUPER_TYPES = {name.removeprefix("KVD_GGML_"): v for name, v in ffi.typeof("enum kvd_ggml").relements.items()}
SUPER_BLOCK = ffi.typeof("enum kvd_super").relements["KVD_SUPER_BLOCK"]
SUPER_PACK_ROWS = ffi.typeof("enum kvd_super").relements["KVD_SUPER_PACK_ROWS"]
GGML_F16 = ffi.typeof("enum kvd_half").relements["KVD_GGML_F16"]
MAX_PARTS = ffi.typeof("enum kvd_parts").relements["KVD_MAX_PARTS"]  # of a fused projection in the layer loop
# A mixture of experts' router scoring and expert activation (enum kvd_moe_scoring, kvd_moe_act), and the weights of
# one expert in kvd_moe.experts.
MOE_SCORING = {
    n.removeprefix("KVD_").lower(): v for n, v in ffi.typeof("enum kvd_moe_scoring").relements.items()
}
MOE_ACTIVATIONS = {
    n.removeprefix("KVD_ACT_").lower(): v for n, v in ffi.typeof("enum kvd_moe_act").relements.items()
}
EXPERT_WEIGHTS = ffi.typeof("enum kvd_moe_weights").relements["KVD_EXPERT_WEIGHTS"]
_DTYPES = (torch.float32, torch.bfloat16)
_VOID_P = ffi.typeof("void *")


class NativeKernelError(RuntimeError):
    """A native kernel refused its input or ran out of memory."""


def _fields(struct: str) -> list[str]:
    return [name for name, _ in ffi.typeof(struct).fields]


# kvd_weight, kvd_layer and kvd_shape as Python values: fields named and ordered as in cpu_kernels.h.
LinearWeight = namedtuple("LinearWeight", _fields("kvd_weight"))
LayerWeights = namedtuple("LayerWeights", _fields("kvd_layer"))
ModelShape = namedtuple("ModelShape", _fields("kvd_shape"))
RecurrentWeights = namedtuple("RecurrentWeights", _fields("kvd_recurrent"))


def _fill(target: object, value: tuple) -> None:
    """Copy a named tuple into the cffi struct `target`, field by field (pointers from integers; an array of
    structs from a sequence, the entries after it left zero)."""
    for (name, field), item in zip(ffi.typeof(target).fields, value, strict=True):
        if field.type.kind == "struct":
            _fill(getattr(target, name), item)
        elif field.type.kind == "array":
            if len(item) > field.type.length:
                raise NativeKernelError(f"{name}: at most {field.type.length} entries, got {len(item)}")
            for i, element in enumerate(item):
                _fill(getattr(target, name)[i], element)
        elif field.type.kind == "pointer":
            setattr(target, name, ffi.cast(field.type, item))
        else:
            setattr(target, name, item)


@lru_cache(maxsize=4096)
def _struct(ctype: str, value: tuple) -> object:
    """The C struct for a named tuple, made once per distinct value."""
    struct = ffi.new(f"{ctype} *")
    _fill(struct[0], value)
    return struct


@lru_cache(maxsize=8)
def _layer_array(layers: tuple[LayerWeights, ...]) -> object:
    array = ffi.new("kvd_layer[]", len(layers))
    for i, layer in enumerate(layers):
        _fill(array[i], layer)
    return array


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


def _ptr(t: torch.Tensor | None) -> object:
    return ffi.NULL if t is None else ffi.cast(_VOID_P, t.data_ptr())


def address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check(status: int, what: str) -> None:
    if status == 0:
        return
    if status == library().KVD_UNSUPPORTED:
        raise NativeKernelError(
            f"{what}: this CPU or build cannot run it (a bf16 weight in tile order without AMX or AVX-512 BF16)"
        )
    if status == library().KVD_BAD_INDEX:
        raise NativeKernelError(
            f"{what}: an index out of range (a slot, block table entry, context length, position or row), "
            "refused before any write"
        )
    raise NativeKernelError(f"{what}: out of memory")


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """t is on the CPU, of this dtype and shape, contiguous (the message is only built when it is not)."""
    if t.dtype != dtype or t.shape != shape or not t.is_contiguous() or not t.is_cpu:
        raise NativeKernelError(
            f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}"
            f"{'' if t.is_contiguous() else ' (strided)'}"
        )


def _is_bf16(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPES:
        raise NativeKernelError(f"native kernels take float32 or bfloat16, not {t.dtype}")
    return int(t.dtype == torch.bfloat16)


def linear_weight(
    bits: int,
    data: torch.Tensor,
    scales: torch.Tensor | None = None,
    mins: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    tiles: bool = False,
    rows: int | None = None,
    fifth: torch.Tensor | None = None,
) -> LinearWeight:
    """The kernel's view of a weight [N, K]: 4-bit (data uint8, scales/mins float16), 5-bit (4-bit's and `fifth`,
    the codes' fifth bits: int32 [N, K / 32], bit i of a block's word code i's) or 8-bit (data int8, scales
    float16) in blocks of 32 along K as group_blocks lays them out, `rows` = N of them (data's rows without the
    padding), or float32 / bf16 / fp16 (bits 32 / 16 / 16: data [N, K] of that dtype; fp16 in rows alone); an
    optional float32 bias [N]; `tiles`: a float weight in its kernel's packed order (pack). Cheap: callers make one
    per call rather than keep one."""
    if bias is not None and bias.dtype != torch.float32:
        raise NativeKernelError(f"the bias of a native linear is float32, not {bias.dtype}")
    if (bits == 5) != (fifth is not None):
        raise NativeKernelError("a 5-bit weight, and only one, has its codes' fifth bits")
    half = data.dtype == torch.float16
    if half and (bits != 16 or tiles):
        raise NativeKernelError("an fp16 weight is bits 16, in rows")
    return LinearWeight(
        qs=data.data_ptr(),
        d=address(scales),
        mn=address(mins),
        qh=address(fifth),
        bias=address(bias),
        n=data.shape[0] if rows is None else rows,
        k=data.shape[1] * 2 if bits in (4, 5) else data.shape[1],
        bits=bits,
        tiles=int(tiles),
        ggml=GGML_F16 if half else 0,
    )


def super_weight(
    ggml_type: int, data: torch.Tensor, k: int, bias: torch.Tensor | None = None, packed: bool = False
) -> LinearWeight:
    """The kernel's view of a weight [N, K] in one of GGUF's super-block types (SUPER_TYPES; the type as GGUF
    numbers it): data uint8 [N, K / 256 x the type's block bytes], the file's bytes (or, `packed`, the bytes
    pack_super rewrote), read in place."""
    if ggml_type not in SUPER_TYPES.values():
        raise NativeKernelError(f"no native kernel for GGUF tensor type {ggml_type}")
    if data.dtype != torch.uint8 or data.dim() != 2 or not data.is_contiguous() or k % SUPER_BLOCK:
        raise NativeKernelError(
            f"a super-block weight is contiguous uint8 [N, K / {SUPER_BLOCK} x block bytes] with K a multiple "
            f"of {SUPER_BLOCK}, got {data.dtype} {tuple(data.shape)}, K {k}"
        )
    if bias is not None and bias.dtype != torch.float32:
        raise NativeKernelError(f"the bias of a native linear is float32, not {bias.dtype}")
    if packed and ggml_type == SUPER_TYPES["IQ4_XS"]:
        raise NativeKernelError("IQ4_XS has no packed layout: pack_super leaves it as the file stores it")
    return LinearWeight(
        qs=data.data_ptr(),
        d=0,
        mn=0,
        qh=0,
        bias=address(bias),
        n=data.shape[0],
        k=k,
        bits=0,
        tiles=int(packed),
        ggml=ggml_type,
    )


def pack_super(ggml_type: int, data: torch.Tensor, k: int, source: np.ndarray | None = None) -> bool:
    """data = the rows of a super-block weight (super_weight's data), rewritten into the layout this build's kernels
    read fastest where it has one for the type (then True; super_weight(..., packed=True) reads them): from
    `source` (the file's rows, uint8 [N, row bytes]), or in place. False: data holds the rows as the file does."""
    if ggml_type not in SUPER_TYPES.values() or data.dtype != torch.uint8 or not data.is_contiguous():
        raise NativeKernelError(
            f"pack_super: GGUF type {ggml_type}, {data.dtype} data is not a super-block weight"
        )
    if data.dim() != 2 or (source is not None and source.shape != tuple(data.shape)):
        raise NativeKernelError(
            f"pack_super: data is [N, row bytes], got {tuple(data.shape)}"
            + ("" if source is None else f" for a source of {source.shape}")
        )
    if source is not None:
        source = np.ascontiguousarray(source, dtype=np.uint8)
    if not available():
        if source is not None:
            data.numpy()[:] = source
        return False
    src = _ptr(data) if source is None else ffi.cast("void *", source.ctypes.data)
    status = library().kvd_super_pack(ggml_type, src, _ptr(data), data.shape[0], k, data.shape[1], _threads())
    _check(min(status, 0), "pack_super")
    return status == 1


def group_blocks(codes: torch.Tensor, *scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Quantized blocks in row order (codes [N, bytes a row], scales and minimums [N, K / 32]) laid out as the
    kernels read them (kvd_weight in cpu_kernels.h): rows in groups of GROUP_ROWS, padded with zeros to a whole
    group; in a group, each pair of blocks of every row, then an odd last block; the scales [groups, K / 32, 8]."""
    n, width = codes.shape
    nb = scales[0].shape[1]
    bb, even, pad = width // nb, nb - nb % 2, -n % GROUP_ROWS
    blocks = F.pad(codes, (0, 0, 0, pad)).view(-1, GROUP_ROWS, nb, bb)
    groups = blocks.shape[0]
    pairs = blocks[:, :, :even].reshape(groups, GROUP_ROWS, nb // 2, 2 * bb).transpose(1, 2)
    last = blocks[:, :, even:].transpose(1, 2)
    grouped = torch.cat((pairs.reshape(groups, -1), last.reshape(groups, -1)), dim=1).view(n + pad, width)
    return grouped, *(
        F.pad(t, (0, 0, 0, pad)).view(groups, GROUP_ROWS, nb).transpose(1, 2).reshape(-1, nb) for t in scales
    )


def ungroup_blocks(codes: torch.Tensor, *scales: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """The row order, `rows` of them, of what group_blocks laid out."""
    width, nb = codes.shape[1], scales[0].shape[1]
    bb, even, groups = width // nb, nb - nb % 2, codes.shape[0] // GROUP_ROWS
    split = codes.view(groups, -1).split([GROUP_ROWS * even * bb, GROUP_ROWS * (nb - even) * bb], dim=1)
    pairs = split[0].reshape(groups, nb // 2, GROUP_ROWS, 2 * bb).transpose(1, 2)
    last = split[1].reshape(groups, nb - even, GROUP_ROWS, bb).transpose(1, 2)
    blocks = torch.cat((pairs.reshape(groups, GROUP_ROWS, -1), last.reshape(groups, GROUP_ROWS, -1)), dim=2)
    return blocks.reshape(-1, width)[:rows], *(
        t.view(groups, nb, GROUP_ROWS).transpose(1, 2).reshape(-1, nb)[:rows] for t in scales
    )


def bf16_kernel_order() -> bool:
    """Whether bf16 weights in tile order (see pack) can be multiplied here: AMX tiles or AVX-512 BF16 pairs."""
    return available() and bool(library().kvd_bf16_kernel_order())


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight here: float32 [N, K] with N a multiple of 16, or bf16 with K a multiple
    of 32 too on a CPU with AMX tiles or AVX-512 BF16."""
    if not available() or weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % 16:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and bf16_kernel_order()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in its batch-invariant kernel's order, a tensor of the same shape (linear_weight(...,
    tiles=True) then reads it): float32 in panels [N/16][K][16] (each k's 16 outputs side by side), bf16 in AMX
    tiles [N/16][K/32][16 pairs of k][16 outputs][2] (which AVX-512 BF16 reads as [N/16][K/2][16][2])."""
    n, k = weight.shape
    if n % 16 or (weight.dtype == torch.bfloat16 and k % 32):
        raise NativeKernelError(f"a {weight.dtype} [{n}, {k}] weight is not whole panels or tiles")
    if weight.dtype == torch.float32:
        return weight.reshape(n // 16, 16, k).transpose(1, 2).contiguous().view(n, k)
    return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(n, k)


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """The row order [N, K] of a weight `pack` laid out."""
    n, k = weight.shape
    if weight.dtype == torch.float32:
        return weight.reshape(n // 16, k, 16).transpose(1, 2).reshape(n, k)
    return weight.reshape(n // 16, k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k)


def unpack_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a weight `pack` laid out, in row order: [*ids.shape, K] (an embedding lookup)."""
    n, k = weight.shape
    tile, row = ids // 16, ids % 16
    if weight.dtype == torch.float32:
        rows = weight.view(n // 16, k, 16)[tile, :, row]
    else:
        rows = weight.view(n // 16, k // 32, 16, 16, 2)[tile, :, :, row, :]
    return rows.reshape(*ids.shape, k)


def linear(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias), in x's dtype (float32 only for a float32 weight)."""
    bf16 = _is_bf16(x)
    if x.shape[-1] != weight.k or (weight.bits == 32 and bf16):
        raise NativeKernelError(
            f"linear: {x.dtype} x with {x.shape[-1]} features for a "
            f"{f'GGUF type {weight.ggml}' if weight.ggml else f'{weight.bits}-bit'} weight of {weight.k}"
        )
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], weight.n, dtype=x.dtype)
    status = library().kvd_linear(
        _struct("kvd_weight", weight), _ptr(x), bf16, x.numel() // weight.k, _ptr(y), bf16, _threads()
    )
    _check(status, "linear")
    return y


class ExpertWeights:
    """A mixture of experts as kvd_moe_forward takes it (cpu_kernels.h): the C struct and the array of its experts'
    weights, which this object keeps alive; `address` is the struct's, for kvd_layer.moe."""

    def __init__(
        self,
        router: LinearWeight,
        experts: list[tuple[tuple[LinearWeight, ...], LinearWeight]],
        top_k: int,
        intermediate: int,
        scoring: str,
        normalize: bool,
        activation: str,
        alpha: float = 0.0,
        limit: float = 0.0,
        shared: tuple[tuple[LinearWeight, ...], LinearWeight, LinearWeight, int] | None = None,
    ) -> None:
        """`experts`: each expert's gate/up parts and down; `shared`: a shared expert's parts, down, its gate [1,
        hidden] and its width, or None."""
        hidden = router.k
        if router.n != len(experts):
            raise NativeKernelError(f"moe: the router scores {router.n} experts, {len(experts)} given")
        if shared is not None and (shared[2].n, shared[2].k) != (1, hidden):
            raise NativeKernelError(
                f"moe: the shared expert's gate is [{shared[2].n}, {shared[2].k}], not [1, {hidden}]"
            )
        self.array = ffi.new("kvd_weight[]", len(experts) * EXPERT_WEIGHTS)
        for e, (parts, down) in enumerate(experts):
            _check_expert(f"expert {e}", parts, down, hidden, intermediate)
            _fill_expert(self.array[e * EXPERT_WEIGHTS : (e + 1) * EXPERT_WEIGHTS], parts, down)
        if shared is not None:
            _check_expert("the shared expert", shared[0], shared[1], hidden, shared[3])
        self.struct = ffi.new("kvd_moe *")
        if shared is not None:
            parts, down, gate, size = shared
            _fill_expert(self.struct.shared, parts, down)
            _fill(self.struct.shared_gate, gate)
            self.struct.shared_size = size
        _fill(self.struct.router, router)
        self.struct.experts = self.array
        self.struct.num_experts, self.struct.top_k = len(experts), top_k
        self.struct.hidden, self.struct.intermediate = router.k, intermediate
        self.struct.scoring, self.struct.normalize = MOE_SCORING[scoring], int(normalize)
        self.struct.act, self.struct.alpha, self.struct.limit = MOE_ACTIVATIONS[activation], alpha, limit
        self.address = int(ffi.cast("uintptr_t", self.struct))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mixture's output for x [T, hidden] (float32 or bfloat16), in x's dtype."""
        hidden = self.struct.hidden
        if x.dim() != 2 or x.shape[1] != hidden:
            raise NativeKernelError(f"moe: x must be [T, {hidden}], got {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty_like(x)
        status = library().kvd_moe_forward(
            self.struct, _ptr(x), _is_bf16(x), x.shape[0], _ptr(out), _threads()
        )
        _check(status, "mixture of experts")
        return out


def _check_expert(
    name: str, parts: tuple[LinearWeight, ...], down: LinearWeight, hidden: int, width: int
) -> None:
    """The kernel sizes its buffers by hidden and width: an expert of other shapes is refused before it runs."""
    if (
        sum(p.n for p in parts) != 2 * width
        or any(p.k != hidden for p in parts)
        or (down.n, down.k) != (hidden, width)
    ):
        raise NativeKernelError(
            f"moe: {name} is gate/up {[(p.n, p.k) for p in parts]} and down {(down.n, down.k)}, not "
            f"[{2 * width}, {hidden}] and [{hidden}, {width}]"
        )


def _fill_expert(slots: object, parts: tuple[LinearWeight, ...], down: LinearWeight) -> None:
    """One expert's weights into EXPERT_WEIGHTS kvd_weight slots: its gate/up parts, empty ones, then down."""
    if len(parts) >= EXPERT_WEIGHTS:
        raise NativeKernelError(f"an expert's gate/up: at most {EXPERT_WEIGHTS - 1} parts, got {len(parts)}")
    for p, part in enumerate(parts):
        _fill(slots[p], part)
    _fill(slots[EXPERT_WEIGHTS - 1], down)


def dequantize(weight: LinearWeight, first: int, out: torch.Tensor) -> torch.Tensor:
    """Rows first .. first + len(out) of a 4-, 5- or 8-bit or super-block weight into out [rows, K] (float32 or bfloat16,
    contiguous); returns out."""
    if weight.bits in (16, 32):
        raise NativeKernelError("dequantize takes a quantized weight; a float weight's rows are its values")
    if not out.is_contiguous() or out.shape[-1] != weight.k:
        raise NativeKernelError(f"dequantize: out must be [rows, {weight.k}], contiguous")
    status = library().kvd_dequantize(
        _struct("kvd_weight", weight), first, out.shape[0], _ptr(out), _is_bf16(out), _threads()
    )
    _check(status, "dequantize")
    return out


def _token_stride(x: torch.Tensor) -> int:
    """Elements from one token's row to the next in x [T, heads, D], whose heads must lie packed in a row."""
    strides = x.stride()
    if strides[-1] != 1 or strides[-2] != x.shape[-1]:
        raise NativeKernelError(f"heads of a {tuple(x.shape)} tensor with strides {strides} are not packed")
    return strides[0]


def kv8_row_bytes(head_dim: int) -> int:
    """Bytes of one head's row in an 8-bit pool: its codes and its scale."""
    return head_dim + library().KVD_KV8_SCALE_BYTES


def _check_pool(kv_cache: torch.Tensor, x: torch.Tensor) -> int:
    """The pool is [2, blocks, block_size, kv_heads, D], contiguous, in x's dtype, or int8 with D + 4 bytes a
    row (kv8); x's heads fit it. Returns kv8 (1 for an 8-bit pool)."""
    pool, rows = kv_cache.shape, x.shape
    if len(pool) != 5 or pool[0] != 2 or not kv_cache.is_contiguous():
        raise NativeKernelError(
            f"the KV pool must be a contiguous [2, blocks, block_size, kv_heads, D] tensor, got {tuple(pool)}"
        )
    kv8 = int(kv_cache.dtype == torch.int8)
    row = kv8_row_bytes(rows[-1]) if kv8 else rows[-1]
    if (kv_cache.dtype != x.dtype and not kv8) or row != pool[4] or rows[1] % pool[3]:
        raise NativeKernelError(
            f"a {x.dtype} {tuple(rows)} input does not fit a {kv_cache.dtype} pool of {pool[3]} heads of {pool[4]}"
        )
    return kv8


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [S, H, D] (one query per row) over the pool [2, blocks, block_size, kv_heads, D] in place (an int8
    pool: [..., D + 4], see kvd_paged_attention).

    block_tables int32 [S, width] and context_lens int32 [S]: each row's blocks and the tokens it sees (its own
    included); a prompt's rows share their sequence's table, each with its own causal length. `window`: each
    row sees only its context's last `window` tokens (a sliding-window layer). `sinks`: float32 [H], a logit per
    query head in each softmax's denominator (attention sinks).
    """
    kv8 = _check_pool(kv_cache, q)
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    seqs, head_dim = q.shape[0], q.shape[-1]
    _check_tensor(block_tables, "block_tables", torch.int32, (seqs, block_tables.shape[-1]))
    _check_tensor(context_lens, "context_lens", torch.int32, (seqs,))
    if sinks is not None:
        _check_tensor(sinks, "sinks", torch.float32, (q.shape[1],))
    out = torch.empty(q.shape, dtype=q.dtype)
    status = library().kvd_paged_attention(
        _ptr(q), _token_stride(q), _ptr(out), _ptr(kv_cache), _is_bf16(q), kv8, num_blocks, block_size,
        kv_heads, head_dim, seqs, q.shape[1], _ptr(block_tables), block_tables.shape[1], _ptr(context_lens),
        window or 0, ffi.NULL if sinks is None else _ptr(sinks), scale, _threads(),
    )  # fmt: skip
    _check(status, "paged attention")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k and v [T, kv_heads, D] into the pool's slots (long [T]; -1 = skip), quantized into an int8 pool."""
    kv8 = _check_pool(kv_cache, k)
    if v.dtype != k.dtype or v.shape != k.shape or k.shape[1] != kv_cache.shape[3]:
        raise NativeKernelError(f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} do not fit the pool")
    _check_tensor(slots, "slots", torch.int64, (k.shape[0],))
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    status = library().kvd_store_kv(
        _ptr(k), _token_stride(k), _ptr(v), _token_stride(v), _ptr(kv_cache), _is_bf16(k), kv8, num_slots,
        k.shape[1], k.shape[2], _ptr(slots), k.shape[0],
    )  # fmt: skip
    _check(status, "store_kv")


def rotary(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place by cos_sin's rows [positions] (cos | signed sin, x's dtype); returns x.
    A table [positions, 2 R] with R < D rotates each head's first R values only (partial rotary)."""
    head_dim, rotary_dim = x.shape[2], cos_sin.shape[-1] // 2
    if (
        cos_sin.dtype != x.dtype
        or not cos_sin.is_contiguous()
        or cos_sin.shape[-1] % 4
        or rotary_dim > head_dim
    ):
        raise NativeKernelError(
            f"rotary: the table must be a contiguous {x.dtype} [positions, 2 R] tensor, R even and at most the "
            f"head size (got {cos_sin.dtype} {tuple(cos_sin.shape)}, head size {head_dim})"
        )
    _check_tensor(positions, "positions", torch.int64, (x.shape[0],))
    status = library().kvd_rotary(
        _ptr(x), _token_stride(x), _is_bf16(x), x.shape[0], x.shape[1], head_dim, rotary_dim, _ptr(cos_sin),
        cos_sin.shape[0], _ptr(positions), _threads(),
    )  # fmt: skip
    _check(status, "rotary")
    return x


def _same_dtype(what: str, *tensors: torch.Tensor) -> int:
    """_is_bf16 of tensors that must share one dtype (float32 or bfloat16)."""
    if any(t.dtype != tensors[0].dtype for t in tensors):
        raise NativeKernelError(f"{what}: mixed dtypes {[str(t.dtype) for t in tensors]}")
    return _is_bf16(tensors[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight over x's last dimension; x [T, heads, D] with packed heads, or [T, D]."""
    bf16 = _same_dtype("rms_norm", x, weight)
    rows = x if x.dim() == 3 else x.contiguous().view(-1, 1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype)
    library().kvd_rms_norm(
        _ptr(rows), _token_stride(rows), _ptr(out), out.stride(0), rows.shape[0], rows.shape[1], rows.shape[2],
        _ptr(weight), eps, bf16,
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x); the sum is written into `residual` (contiguous)."""
    bf16 = _same_dtype("add_rms_norm", x, residual, weight)
    x = x.contiguous()
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    library().kvd_add_rms_norm(
        _ptr(x), _ptr(residual), _ptr(weight), _ptr(out), x.numel() // hidden, hidden, eps, bf16, _threads()
    )
    return out, residual


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up [T, I] whose rows lie equally far apart (views of one [T, 2I] output)."""
    return _gated_mul("silu_mul", gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (tanh approximation), gate and up as for silu_mul."""
    return _gated_mul("gelu_tanh_mul", gate, up)


def same_rows(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether two [T, I] tensors are rows of one stride, each row contiguous (a single row's stride is any)."""
    return gate.stride(1) == up.stride(1) == 1 and (gate.shape[0] == 1 or gate.stride(0) == up.stride(0))


def _gated_mul(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    bf16 = _same_dtype(name, gate, up)
    if gate.dim() != 2 or gate.shape != up.shape or not same_rows(gate, up):
        raise NativeKernelError(
            f"{name}: gate and up must be [T, I] rows of one stride, got {tuple(gate.shape)} "
            f"{gate.stride()} and {tuple(up.shape)} {up.stride()}"
        )
    out = torch.empty(gate.shape, dtype=gate.dtype)
    getattr(library(), f"kvd_{name}")(
        _ptr(gate), _ptr(up), gate.stride(0), _ptr(out), gate.shape[0], gate.shape[1], bf16, _threads()
    )
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x and gate of one shape (a gated attention's output)."""
    bf16 = _same_dtype("sigmoid_mul", x, gate)
    if x.shape != gate.shape:
        raise NativeKernelError(f"sigmoid_mul: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
    x, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1] if x.dim() else 1
    library().kvd_sigmoid_mul(_ptr(x), _ptr(gate), _ptr(out), x.numel() // max(n, 1), n, bf16, _threads())
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * weight * silu(gate) over x's last dimension (each head alone), x and gate of one shape."""
    bf16 = _same_dtype("gated_rms_norm", x, gate, weight)
    if x.shape != gate.shape or x.shape[-1] != weight.numel():
        raise NativeKernelError(
            f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight {tuple(weight.shape)} differ"
        )
    x, gate, weight = x.contiguous(), gate.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    D = x.shape[-1]
    library().kvd_gated_rms_norm(
        _ptr(x), _ptr(gate), _ptr(out), x.numel() // D, 1, D, _ptr(weight), eps, bf16, _threads()
    )
    return out


def recurrent_struct(weights: RecurrentWeights) -> tuple[object, int]:
    """kvd_recurrent for a Gated DeltaNet layer, and its address for kvd_layer.recurrent: the caller keeps the
    struct (and what it points at) alive."""
    struct = ffi.new("kvd_recurrent *")
    _fill(struct[0], weights)
    return struct, int(ffi.cast("uintptr_t", struct))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of x [rows, n] (float32), int64 [rows], as x.argmax(dim=-1) gives it, NaN and ties
    included (torch's CPU kernel took 1.8 ms for 64 rows of a 49152-token vocabulary)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        raise NativeKernelError(f"argmax: x must be float32 [rows, n >= 1], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().kvd_argmax(_ptr(x), x.shape[0], x.shape[1], _ptr(out), _threads())
    return out


def decode_layers(
    shape: ModelShape,
    layers: tuple[LayerWeights, ...],
    hidden: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    groups: list[tuple[torch.Tensor, torch.Tensor]],
    context_lens: torch.Tensor,
    recurrent: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """Every decoder layer of a decode step, in place on hidden and residual [S, hidden_size] (the model's
    dtype: shape.bf16); each layer's rotary table [shape.num_positions, 2 head_dim] in it too. groups: per KV
    group (LayerWeights.kv_group), the slots [S] of the new tokens' K/V and the block tables [S, width].
    recurrent: for Gated DeltaNet layers, the step's starts (the rows of each sequence: a prompt's chunk too)
    then gated_delta's `step` tensors."""
    seqs = hidden.shape[0]
    dtype = torch.bfloat16 if shape.bf16 else torch.float32
    for name, t in (("hidden", hidden), ("residual", residual)):
        _check_tensor(t, name, dtype, (seqs, shape.hidden))
    _check_tensor(positions, "positions", torch.int64, (seqs,))
    _check_tensor(context_lens, "context_lens", torch.int32, (seqs,))
    kv_groups = ffi.new("kvd_kv_group[]", len(groups))
    for entry, (slots, tables) in zip(kv_groups, groups, strict=True):
        _check_tensor(slots, "slots", torch.int64, (seqs,))
        _check_tensor(tables, "block_tables", torch.int32, (seqs, tables.shape[-1]))
        entry.slots, entry.tables, entry.table_width = _ptr(slots), _ptr(tables), tables.shape[1]
    step = ffi.NULL
    if recurrent is not None:
        starts, snap_starts = recurrent[0], recurrent[3]
        sequences = starts.shape[0] - 1
        _check_tensor(starts, "starts", torch.int64, (sequences + 1,))
        _check_tensor(snap_starts, "snapshot starts", torch.int64, (sequences + 1,))
        for name, t, size in zip(
            ("slots", "sources", "snapshot rows", "snapshot slots"),
            recurrent[1:3] + recurrent[4:],
            (sequences, sequences, int(snap_starts[-1]), int(snap_starts[-1])),
            strict=True,
        ):
            _check_tensor(t, name, torch.int64, (size,))
        step = ffi.new("kvd_recurrent_step *", [sequences, *(_ptr(t) for t in recurrent)])
    status = library().kvd_decode_layers(
        _struct("kvd_shape", shape), _layer_array(layers), len(layers), _ptr(hidden), _ptr(residual), seqs,
        _ptr(positions), kv_groups, len(groups), _ptr(context_lens), step, _threads(),
    )  # fmt: skip
    _check(status, "decode layers")


def gated_delta(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    starts: torch.Tensor,
    step: tuple[torch.Tensor, ...],
    key_heads: int,
    tiled: bool = False,
) -> torch.Tensor:
    """A Gated DeltaNet layer's convolution and recurrence (kvd_gated_delta): out [T, value_heads x value_head_dim]
    in qkv's dtype; the sequences' windows in conv_state and states in state updated in place. step: per sequence
    its slot and source (int64 [S] each), its snapshots' starts (int64 [S + 1]), then every snapshot's row and slot
    (int64 [N] each; RecurrentStep.kernel_args); tiled: value head h reads key head
    h % key_heads (else h // (value heads per key head))."""
    bf16 = _is_bf16(qkv)
    rows, channels = qkv.shape
    num_slots, heads, key_dim, value_dim = state.shape
    kernel = conv_weight.shape[1]
    seqs = starts.shape[0] - 1
    for name, t, shape in (
        ("qkv", qkv, (rows, channels)),
        ("a", a, (rows, heads)),
        ("b", b, (rows, heads)),
        ("conv_state", conv_state, (num_slots, kernel - 1, channels)),
    ):
        _check_tensor(t, name, qkv.dtype, shape)
    for name, t, shape in (
        ("conv_weight", conv_weight, (channels, kernel)),
        ("A_log", A_log, (heads,)),
        ("dt_bias", dt_bias, (heads,)),
        ("state", state, (num_slots, heads, key_dim, value_dim)),
    ):
        _check_tensor(t, name, torch.float32, shape)
    _check_tensor(starts, "starts", torch.int64, (seqs + 1,))
    slots, sources, snap_starts, snap_rows, snap_slots = step
    for name, t, shape in (
        ("slots", slots, (seqs,)),
        ("sources", sources, (seqs,)),
        ("snapshot starts", snap_starts, (seqs + 1,)),
        ("snapshot rows", snap_rows, (int(snap_starts[-1]),)),
        ("snapshot slots", snap_slots, (int(snap_starts[-1]),)),
    ):
        _check_tensor(t, name, torch.int64, shape)
    if int(starts[-1]) != rows or channels != 2 * key_heads * key_dim + heads * value_dim:
        raise NativeKernelError(
            f"gated delta: {rows} rows of {channels} channels do not match the step's {int(starts[-1])} rows or "
            f"{key_heads} key heads and {heads} value heads of {key_dim} x {value_dim}"
        )
    out = torch.empty(rows, heads * value_dim, dtype=qkv.dtype)
    status = library().kvd_gated_delta(
        _ptr(qkv), _ptr(a), _ptr(b), _ptr(conv_weight), _ptr(A_log), _ptr(dt_bias), _ptr(conv_state), _ptr(state),
        num_slots, _ptr(starts), *(_ptr(t) for t in step), seqs, key_heads, heads, key_dim, value_dim, kernel,
        int(tiled), bf16, _ptr(out), _threads(),
    )  # fmt: skip
    _check(status, "gated delta")
    return out

"""Linear layers whose weight may stack several Hugging Face projections (fused q/k/v, fused gate/up)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvd.distributed.comm import all_reduce
from kvd.distributed.shard import WHOLE, Shard
from kvd.kernels import cpu_native

# Rows up to which kvd's native float32 kernel (weights streamed once for all rows) beats torch's matmul on the
# CPU: 1.5-4x at 1-8 rows on SmolLM2's shapes, even at 16 (AVX2, 2 threads); beyond, MKL's sgemm wins. With batch
# invariance (the default) the native kernel takes every row count: MKL and oneDNN round a row differently
# depending on how many rows share the call.
NATIVE_MAX_ROWS = 16


def native_rows(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool) -> bool:
    """Whether x @ weight^T runs in the native kernel: float32, or bfloat16 with batch invariance."""
    if not cpu_native.supports(x) or x.dtype != weight.dtype:
        return False
    if batch_invariant:
        return True
    return x.dtype == torch.float32 and x.numel() <= NATIVE_MAX_ROWS * x.shape[-1]


def _native_weight(
    weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: bool = False
) -> cpu_native.LinearWeight:
    """The kernel adds a float32 bias itself; a bfloat16 one is added by the caller (see _bias_after)."""
    bits = 16 if weight.dtype == torch.bfloat16 else 32
    return cpu_native.linear_weight(bits, weight, bias=bias if bits == 32 else None, tiles=tiles)


def vocab_parallel_lookup(
    rows: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, start: int, count: int, shard: Shard
) -> torch.Tensor:
    """The embeddings of `ids` from a table of which this rank holds rows [start, start + count), read by
    rows(local ids): the ids that fall there are looked up, the others zeroed, and the ranks' rows all-reduced
    (x + 0 is exact: TP=1's values)."""
    if not shard.sharded:
        return rows(ids)
    local = ids - start
    outside = (local < 0) | (local >= count)
    found = rows(local.masked_fill(outside, 0))
    return all_reduce(found.masked_fill_(outside[..., None], 0.0), shard)


def _bias_after(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None or bias.dtype == torch.float32 else y.add_(bias)


class KernelOrder:
    """A weight that batch invariance may lay out in the order of kvd's own kernels (kvd.model.batch_invariance)."""

    tiles = False  # the weight lies in kvd's kernel order; only that kernel (and unpack) reads it
    weight: nn.Parameter

    def row_weight(self) -> torch.Tensor:
        """The [out, in] weight in row order, whatever order this layer keeps it in (see `tiles`)."""
        return cpu_native.unpack(self.weight) if self.tiles else self.weight


class Linear(KernelOrder, nn.Module):
    """y = x W^T (+ b). With several out_sizes, W stacks that many checkpoint matrices row-wise, in order.

    A stacked weight carries `shard_sizes`, the rows each checkpoint tensor goes to.
    Parameters are left uninitialized: the loader fills every one of them.
    """

    batch_invariant = True  # set per model by kvd.model.batch_invariance
    quantizable = True  # whether quantization (kvd.model.layers.quantized_linear) may replace it

    def __init__(self, in_features: int, out_sizes: int | Sequence[int], bias: bool) -> None:
        super().__init__()
        sizes = [out_sizes] if isinstance(out_sizes, int) else list(out_sizes)
        self.out_sizes = sizes
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(sizes)), requires_grad=False) if bias else None
        if len(sizes) > 1:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.shard_sizes = sizes

    def set_weight(self, weight: torch.Tensor) -> None:
        """Copy a [out, in] weight in row order into this layer, in the order it keeps."""
        self.weight.data.copy_(cpu_native.pack(weight.to(self.weight.dtype)) if self.tiles else weight)

    def native_weight(self) -> cpu_native.LinearWeight:
        """The native kernel's view of the float32 or bfloat16 weight (see cpu_native.linear_weight)."""
        return _native_weight(self.weight, self.bias, self.tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native_rows(x, self.weight, self.batch_invariant):
            return _bias_after(cpu_native.linear(x, self.native_weight()), self.bias)
        # A packed weight outside kvd's kernel (while torch.compile traces, say): correct, if not invariant.
        return F.linear(x, self.row_weight(), self.bias)

    def forward_shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per stacked matrix (q, k, v or gate, up)."""
        native = native_rows(x, self.weight, self.batch_invariant)
        if native or x.dtype != torch.float32 or x.device.type != "cpu":
            return list(self.forward(x).split(self.out_sizes, dim=-1))
        # Only float32 on CPU splits: there MKL's sgemm ran a whole SmolLM2 step 3-6 % faster with the stacked
        # matrices one by one (decode batch 16, prefill; AVX2, one thread), while bfloat16 ran 5 % faster
        # fused at decode batches 1-16 (benchmarks in docs/cpu_kernels.md). The views cost no copy.
        weights = self.row_weight().split(self.out_sizes)
        biases = [None] * len(weights) if self.bias is None else self.bias.split(self.out_sizes)
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


class Embedding(KernelOrder, nn.Module):
    """Token embedding table [vocab, hidden]; tied models reuse it as the output projection.

    Vocab-parallel under tensor parallelism: this rank holds rows [vocab_start, vocab_start + num_embeddings),
    looks up the ids that fall there, zeros the others and all-reduces (x + 0 is exact: TP=1's values)."""

    batch_invariant = True  # set per model by kvd.model.batch_invariance

    def __init__(
        self, num_embeddings: int, embedding_dim: int, shard: Shard = WHOLE, vocab_start: int = 0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.shard = shard
        self.vocab_start = vocab_start

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_native.unpack_rows(self.weight, ids) if self.tiles else F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(
            self._rows, input_ids, self.vocab_start, self.weight.shape[0], self.shard
        )

    def as_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ table^T: the output projection of a model with tied embeddings."""
        if native_rows(hidden, self.weight, self.batch_invariant):
            return cpu_native.linear(hidden, _native_weight(self.weight, tiles=self.tiles))
        return F.linear(hidden, self.row_weight())

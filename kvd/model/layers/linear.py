"""Linear layers whose weight may stack several Hugging Face projections (fused q/k/v, fused gate/up)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvd.kernels import cpu_native

# Rows up to which kvd's native float32 kernel (weights streamed once for all rows) beats torch's matmul on the
# CPU: 1.5-4x at 1-8 rows on SmolLM2's shapes, even at 16 (AVX2, 2 threads); beyond, MKL's sgemm wins.
NATIVE_MAX_ROWS = 16


def native_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T runs in the native float32 kernel (see NATIVE_MAX_ROWS)."""
    return (
        weight.dtype == torch.float32
        and x.numel() <= NATIVE_MAX_ROWS * x.shape[-1]
        and cpu_native.supports(x)
        and x.dtype == torch.float32
    )


class Linear(nn.Module):
    """y = x W^T (+ b). With several out_sizes, W stacks that many checkpoint matrices row-wise, in order.

    A stacked weight carries `shard_sizes`, the rows each checkpoint tensor goes to.
    Parameters are left uninitialized: the loader fills every one of them.
    """

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

    def native_weight(self) -> cpu_native.LinearWeight:
        """The native kernel's view of the float32 weight (see cpu_native.linear_weight)."""
        return cpu_native.linear_weight(32, self.weight, bias=self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native_rows(x, self.weight):
            return cpu_native.linear(x, self.native_weight())
        return F.linear(x, self.weight, self.bias)

    def forward_shards(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One output per stacked matrix (q, k, v or gate, up)."""
        if native_rows(x, self.weight) or x.dtype != torch.float32 or x.device.type != "cpu":
            return list(self.forward(x).split(self.out_sizes, dim=-1))
        # Only float32 on CPU splits: there MKL's sgemm ran a whole SmolLM2 step 3-6 % faster with the stacked
        # matrices one by one (decode batch 16, prefill; AVX2, one thread), while bfloat16 ran 5 % faster
        # fused at decode batches 1-16 (benchmarks in docs/architecture.md). The views cost no copy.
        weights = self.weight.split(self.out_sizes)
        biases = [None] * len(weights) if self.bias is None else self.bias.split(self.out_sizes)
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; tied models reuse it as the output projection."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def as_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ table^T: the output projection of a model with tied embeddings."""
        if native_rows(hidden, self.weight):
            return cpu_native.linear(hidden, cpu_native.linear_weight(32, self.weight))
        return F.linear(hidden, self.weight)

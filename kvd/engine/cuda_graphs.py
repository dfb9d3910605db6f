"""CUDA graphs for decode steps: one graph per batch size, replayed over static input buffers.

A decode batch of n sequences runs the graph of the smallest captured size >= n; the rows past n are padding:
token 0 at position 0, slot -1 (their K/V are not written), context length 1 over block 0 (read, never
written, so the padding attends to something finite and disturbs nothing). Only backends whose decode reads
fixed-shape tensors (GraphDecodeBackend: triton, flash-attn) can be captured.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvd.model.layers.graph_decode import GraphDecodeBackend
from kvd.model.llama import CausalLM


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to the first size that holds max_num_seqs."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 16 else sizes[-1] + 16)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The captured size a batch of num_seqs runs as; None when it is larger than every captured size."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The inputs a captured decode step reads, sized for the largest graph; a size-b graph reads rows :b."""

    input_ids: torch.Tensor  # long [max_batch]
    positions: torch.Tensor  # long [max_batch]
    slot_mapping: torch.Tensor  # long [max_batch]
    context_lens: torch.Tensor  # int32 [max_batch]
    block_tables: torch.Tensor  # int32 [max_batch, max_blocks]

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        """Buffers holding padding rows (see the module docstring), safe to run before any fill."""

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch, dtype=torch.long),
            positions=zeros(max_batch, dtype=torch.long),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.long, device=device),
            context_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            block_tables=zeros(max_batch, max_blocks, dtype=torch.int32),
        )

    def fill(
        self,
        input_ids: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        block_size: int,
        batch_size: int,
    ) -> None:
        """Copy one decode step (each sequence's last token) into rows :batch_size, padding past the batch.

        Table columns past the longest table keep old values: no context length reaches them.
        """
        n = len(input_ids)
        pad = batch_size - n
        positions = [c - 1 for c in context_lens]
        slots = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(block_tables, positions, strict=True)
        ]
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables] + [[0] * width] * pad

        def put(buffer: torch.Tensor, values: list) -> None:
            host = torch.tensor(values, dtype=buffer.dtype)
            target = buffer[: host.shape[0]]
            if host.dim() == 2:
                target = target[:, : host.shape[1]]
            target.copy_(host)

        put(self.input_ids, input_ids + [0] * pad)
        put(self.positions, positions + [0] * pad)
        put(self.slot_mapping, slots + [-1] * pad)
        put(self.context_lens, context_lens + [1] * pad)
        put(self.block_tables, tables)


class DecodeGraphRunner:
    """Captures the model's decode step for each size of capture_sizes(max_num_seqs) and replays it."""

    def __init__(
        self, model: CausalLM, block_size: int, max_num_seqs: int, max_model_len: int, device: torch.device
    ) -> None:
        backend = model.attention_backend
        if not isinstance(backend, GraphDecodeBackend):
            raise TypeError(
                f"the {backend.name} attention backend cannot be captured in a CUDA graph; "
                "use triton or flash-attn, or run with enforce_eager"
            )
        self.model = model
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device)
        b = self.buffers
        self.metadata = {
            size: backend.decode_metadata(
                b.slot_mapping[:size], b.block_tables[:size], b.context_lens[:size], block_size, max_model_len
            )
            for size in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def forward_static(self, batch_size: int) -> torch.Tensor:
        """The model over the buffers' first batch_size rows: what a graph of that size captures."""
        b = self.buffers
        return self.model(b.input_ids[:batch_size], b.positions[:batch_size], self.metadata[batch_size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (only one graph runs at a time)."""
        pool = None
        for size in reversed(self.sizes):
            self.forward_static(
                size
            )  # warm-up: compiles kernels and creates library handles outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward_static(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return padded_batch_size(num_seqs, self.sizes) is not None

    def run(
        self, input_ids: list[int], block_tables: list[list[int]], context_lens: list[int]
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step (one new token per sequence, its last); valid until the
        next replay."""
        size = padded_batch_size(len(input_ids), self.sizes)
        self.buffers.fill(input_ids, block_tables, context_lens, self.block_size, size)
        self.graphs[size].replay()
        return self.outputs[size][: len(input_ids)]

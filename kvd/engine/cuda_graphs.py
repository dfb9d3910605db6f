"""CUDA graphs for decode steps: one graph per batch size, replayed over static input buffers.

A decode batch of n sequences runs the graph of the smallest captured size >= n; the rows past n are padding:
token 0 at position 0, slot -1 (their K/V are not written), context length 1 over the pool's null block (a
block the block manager never hands out, so padding reads nothing a sequence owns). Only backends whose decode
reads fixed-shape tensors (GraphDecodeBackend: triton, flash-attn) can be captured.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kvd.model.decoder import CausalLM
from kvd.model.layers.attention.graph_decode import GraphDecodeBackend

# Larger decode batches run eagerly: each graph keeps its own launch parameters, and past a few hundred rows
# the launch overhead a graph saves is small next to the step's own work (vLLM caps at 512 likewise).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to the first size that holds max_num_seqs (at most MAX_CAPTURE_SIZE)."""
    sizes = [1]
    while sizes[-1] < min(max_num_seqs, MAX_CAPTURE_SIZE):
        sizes.append(sizes[-1] * 2 if sizes[-1] < 16 else sizes[-1] + 16)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The captured size a batch of num_seqs runs as; None when it is larger than every captured size."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The inputs a captured decode step reads, sized for the largest graph; a size-b graph reads rows :b.

    Each step is written into persistent host buffers (pinned on CUDA) and copied without blocking: the copy
    is ordered before the replay on the stream, and the host buffers are rewritten only at the next step,
    after the sampler has read this step's tokens back (which waits for the stream).
    """

    input_ids: torch.Tensor  # long [max_batch]
    positions: torch.Tensor  # long [max_batch]
    slot_mapping: torch.Tensor  # long [max_batch]
    context_lens: torch.Tensor  # int32 [max_batch]
    block_tables: torch.Tensor  # int32 [max_batch, max_blocks]
    null_block: int
    host: dict[str, torch.Tensor]  # the same five, on the host

    @classmethod
    def allocate(
        cls, max_batch: int, max_blocks: int, device: torch.device, null_block: int
    ) -> DecodeBuffers:
        """Buffers holding padding rows (see the module docstring), safe to run before any fill."""
        pin = device.type == "cuda"

        def padding() -> dict[str, torch.Tensor]:
            return {
                "input_ids": torch.zeros(max_batch, dtype=torch.long, pin_memory=pin),
                "positions": torch.zeros(max_batch, dtype=torch.long, pin_memory=pin),
                "slot_mapping": torch.full((max_batch,), -1, dtype=torch.long, pin_memory=pin),
                "context_lens": torch.ones(max_batch, dtype=torch.int32, pin_memory=pin),
                "block_tables": torch.full(
                    (max_batch, max_blocks), null_block, dtype=torch.int32, pin_memory=pin
                ),
            }

        on_device = {name: t.to(device) for name, t in padding().items()}
        return cls(**on_device, null_block=null_block, host=padding())

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
        width = max(len(t) for t in block_tables)
        host = {name: t.numpy() for name, t in self.host.items()}  # views: writes land in the buffers
        positions = [c - 1 for c in context_lens]
        host["input_ids"][:n] = input_ids
        host["positions"][:n] = positions
        host["slot_mapping"][:n] = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(block_tables, positions, strict=True)
        ]
        host["context_lens"][:n] = context_lens
        tables = host["block_tables"]
        tables[:batch_size, :width] = self.null_block
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        for name, padding in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("context_lens", 1)):
            host[name][n:batch_size] = padding
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            getattr(self, name)[:batch_size].copy_(self.host[name][:batch_size], non_blocking=True)
        self.block_tables[:batch_size, :width].copy_(
            self.host["block_tables"][:batch_size, :width], non_blocking=True
        )


class DecodeGraphRunner:
    """Captures the model's decode step for each size of capture_sizes(max_num_seqs) and replays it."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        null_block: int,
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
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device, null_block)
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

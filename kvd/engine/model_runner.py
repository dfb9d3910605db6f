"""Turns scheduled chunks into one flat varlen batch, runs the model over the paged KV pool, returns logits."""

from __future__ import annotations

import torch

from kvd.engine.scheduler import ScheduledChunk
from kvd.model.config import ModelConfig
from kvd.model.layers.attention import build_attention_metadata
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.llama import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, dtype, device)
        model.bind_kv_cache(self.kv_caches)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Compute the chunks' K/V and return float32 logits for the chunks that sample, in order."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        for chunk in chunks:
            start = chunk.seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            input_ids.extend(chunk.seq.token_ids[start:end])
            positions.extend(range(start, end))
            if chunk.samples:
                logits_indices.append(len(input_ids) - 1)
        attn = build_attention_metadata(
            block_tables=[c.seq.block_table for c in chunks],
            context_lens=[c.seq.num_computed_tokens + c.num_new_tokens for c in chunks],
            query_lens=[c.num_new_tokens for c in chunks],
            block_size=self.block_size,
            device=self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            attn,
        )
        if not logits_indices:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(logits_indices, device=self.device)])

"""The paged KV pool: per layer one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from kvd.model.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim
    return per_layer * config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """One zeroed tensor per layer (zeroed: attention weights of 0 times stale NaN would still give NaN)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

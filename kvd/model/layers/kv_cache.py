"""The paged KV pool: per layer one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, row]: row = head_dim
values of the model's dtype, or in an int8 pool head_dim codes and their scale (kvd.kernels.cpu_native).

A model whose sliding-window layers sit beside full-attention ones keeps its layers' K/V in groups (KVGroups),
each with its own block table: a sliding group holds only the blocks its window still needs. Every group has
the same number of layers, so that one block of the pool serves any group: the layers at the same place in
their groups share one tensor, and a block id given to one group is that block in each of its layers.

Where a group's layers keep smaller pages than another's at the same places (Gemma 4: full layers with twice the
sliding ones' head size), the shared tensor is laid out in the largest page and a smaller layer sees it as `scale`
times as many pages of its own: the group's block b is its page b * scale (KVGroups.block_scales), so that a block
still owns the same bytes in every layer.

Linear-attention layers keep no K/V (kvd.model.layers.recurrent_state holds their state), nor do layers that attend
an earlier layer's (ModelConfig.kv_source): they are in no group's pool (NO_POOL); a sharing layer reads its source's
pool through the source's group."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvd.kernels import cpu_native
from kvd.model.config import LINEAR, SLIDING, ModelConfig, UnsupportedModelError
from kvd.model.huge_pages import pool_zeros

NO_POOL = -1  # KVGroups.layer_slot of a layer without K/V


@dataclass(frozen=True)
class KVGroups:
    """Which layers share a block table. Group 0 holds full-attention layers (or every layer, when they are all
    of one kind) and keeps every block of a sequence; a group of sliding-window layers frees the blocks behind
    its window (kvd.engine.block_manager)."""

    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[
        int, ...
    ]  # per layer: its place in the group, i.e. the pool tensor it shares; or NO_POOL
    windows: tuple[int | None, ...]  # per group: its layers' attention window, None for full attention
    block_scales: tuple[
        int, ...
    ] = ()  # per group: its block b is page b * scale of its layers' views; () = all 1

    def block_scale(self, group: int) -> int:
        return self.block_scales[group] if self.block_scales else 1

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        return max(self.layer_slot) + 1

    @property
    def pooled_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V in the pool, in order."""
        return tuple(i for i, slot in enumerate(self.layer_slot) if slot != NO_POOL)

    @property
    def release_windows(self) -> tuple[int | None, ...]:
        """Per group, the window behind which it frees blocks: None for group 0, which keeps them all (the
        prefix cache names content by group 0's blocks; every layer of a model that only slides is in it)."""
        return (None, *self.windows[1:])

    def describe(self) -> list[dict]:
        """Per group, its layers and the window behind which it frees blocks (for info)."""
        return [
            {"layers": sum(self.layer_group[i] == g for i in self.pooled_layers), "window": window}
            for g, window in enumerate(self.release_windows)
        ]

    def max_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest sequence a pool of `num_blocks` holds alone: a windowed group keeps the blocks its window
        spans, every other group a block per block_size tokens (the scheduler shrinks a prompt's chunks to fit)."""
        windows = [w for w in self.release_windows if w is not None]
        reserved = sum(-(-w // block_size) + 1 for w in windows)
        return max(0, (num_blocks - reserved) // (self.num_groups - len(windows))) * block_size


def kv_groups(config: ModelConfig) -> KVGroups:
    """One group of every attention layer, unless full and sliding layers mix: then groups of gcd(#full, #sliding)
    layers in layer order, the full groups first. Linear-attention layers sit in group 0 with NO_POOL, layers that
    share another's K/V in their source's group with NO_POOL."""
    n = config.num_hidden_layers
    window = config.attention_window
    attending = [i for i in range(n) if config.layer_types[i] != LINEAR and config.kv_source_of(i) == i]
    sliding = [i for i in attending if window is not None and config.layer_types[i] == SLIDING]
    full = [i for i in attending if i not in set(sliding)]
    layer_group, layer_slot = [0] * n, [NO_POOL] * n
    if not sliding or not full:
        for slot, layer in enumerate(attending):
            layer_slot[layer] = slot
        windows: tuple[int | None, ...] = (window,)
    else:
        size = math.gcd(len(full), len(sliding))
        for g, start in enumerate(range(0, len(attending), size)):
            for slot, layer in enumerate((full + sliding)[start : start + size]):
                layer_group[layer], layer_slot[layer] = g, slot
        windows = (None,) * (len(full) // size) + (window,) * (len(sliding) // size)
    for i in range(n):
        layer_group[i] = layer_group[config.kv_source_of(i)]
    kinds = [full, sliding] if full and sliding else [attending]
    pages = [_page(config, layers[0]) for layers in kinds]
    largest = max(pages)
    if any(largest % p for p in pages):
        raise UnsupportedModelError(
            f"the full and sliding layers' K/V rows ({pages[0]} and {pages[-1]} values a token) do not divide one "
            "another, so they cannot share the pool's pages"
        )
    scales = tuple(largest // pages[0 if w is None else -1] for w in windows)
    return KVGroups(tuple(layer_group), tuple(layer_slot), windows, scales if len(set(pages)) > 1 else ())


def _page(config: ModelConfig, layer: int) -> int:
    """Values of one token's K (or V) row in `layer`."""
    shape = config.layer_config(layer)
    return shape.num_key_value_heads * shape.head_dim


def pool_row(config: ModelConfig, dtype: torch.dtype) -> int:
    """Elements of one kv head's row in a pool of this dtype (`config` a layer's: ModelConfig.layer_config)."""
    return cpu_native.kv8_row_bytes(config.head_dim) if dtype == torch.int8 else config.head_dim


def _largest_page(config: ModelConfig, dtype: torch.dtype) -> int:
    """Elements of the largest token row (K or V) of any pooled layer: the pool's page per token."""
    pages = {
        config.layer_config(i).num_key_value_heads * pool_row(config.layer_config(i), dtype)
        for i in kv_groups(config).pooled_layers
    }
    if dtype == torch.int8 and len(pages) > 1:
        raise UnsupportedModelError(
            "an 8-bit KV pool needs every attention layer's rows alike; this model's full and sliding layers have "
            "different head sizes: serve it with --kv-cache-dtype auto"
        )
    return max(pages)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of the pool takes, K and V: the layers of one KV group (all of them when ungrouped)."""
    per_layer = 2 * block_size * _largest_page(config, dtype)
    return per_layer * kv_groups(config).layers_per_group * torch.empty((), dtype=dtype).element_size()


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    groups: KVGroups | None = None,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer that keeps K/V (KVGroups.pooled_layers; zeroed: attention weights of 0 times stale
    NaN would still give NaN), each [2, pages, block_size, kv_heads, row] in its layer's shape. With `groups` the
    layers at one place in their groups share theirs, so each group needs block tables of its own (scaled by its
    block_scale); without, any block table serves every layer."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    page = _largest_page(config, dtype)
    pooled = kv_groups(config).pooled_layers
    slots = [groups.layer_slot[i] for i in pooled] if groups is not None else range(len(pooled))
    shape = (2, num_blocks, block_size, 1, page)
    tensors = {s: pool_zeros(shape, dtype, torch.device(device)) for s in sorted(set(slots))}
    views: dict[tuple[int, int, int], torch.Tensor] = {}  # one object per place and shape, as layers share it
    pool = []
    for layer, slot in zip(pooled, slots, strict=True):
        layer_config = config.layer_config(layer)
        key = (slot, layer_config.num_key_value_heads, pool_row(layer_config, dtype))
        if key not in views:
            views[key] = tensors[slot].view(2, -1, block_size, *key[1:])
        pool.append(views[key])
    return pool

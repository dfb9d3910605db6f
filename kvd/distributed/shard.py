"""Which slice of every weight a rank holds: heads, KV heads, the MLP's width and the vocabulary split N ways."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvd.model.config import ModelConfig

# Split along the output rows (column-parallel): each rank computes its own heads / MLP columns.
_COLUMN_PARALLEL = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")
# Split along the input columns (row-parallel): each rank's partial sums are all-reduced.
_ROW_PARALLEL = (".o_proj.", ".down_proj.")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


class ShardingError(ValueError):
    """The model cannot be split this many ways (a head count or width not divisible by it)."""


@dataclass(frozen=True)
class Shard:
    """This process's place in the tensor-parallel group; the default is the whole model in one process."""

    rank: int = 0
    world_size: int = 1

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding table each rank holds: the vocabulary padded to a multiple of world_size."""
        return -(-vocab_size // self.world_size)

    def vocab_start(self, vocab_size: int) -> int:
        return self.rank * self.vocab_rows(vocab_size)


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's slice: 1/N of the heads, the KV heads, the MLP width and the vocabulary."""
    if not shard.sharded:
        return config
    n = shard.world_size
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % n:
            raise ShardingError(
                f"{name} is {value}, which {n} ranks cannot split evenly; use a tensor-parallel size that "
                f"divides it (heads {config.num_attention_heads}, KV heads {config.num_key_value_heads})"
            )
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,
        intermediate_size=config.intermediate_size // n,
        vocab_size=shard.vocab_rows(config.vocab_size),
    )


def shard_tensor(name: str, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor `name` (Hugging Face naming); norms are replicated."""
    if not shard.sharded:
        return tensor
    if any(part in name for part in _COLUMN_PARALLEL):
        return tensor.chunk(shard.world_size, dim=0)[shard.rank]
    if any(part in name for part in _ROW_PARALLEL):
        if name.endswith(".bias"):
            # Added once, by rank 0, to the sum the all-reduce forms: the others add zeros.
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        return tensor.chunk(shard.world_size, dim=1)[shard.rank]
    if name in _VOCAB_PARALLEL:
        vocab = tensor.shape[0]
        rows, start = shard.vocab_rows(vocab), shard.vocab_start(vocab)
        part = tensor[start : start + rows]
        if part.shape[0] < rows:  # the last rank's padding rows: never looked up, their logits cut off
            part = torch.cat((part, part.new_zeros(rows - part.shape[0], *part.shape[1:])))
        return part
    return tensor


WHOLE = Shard()  # the whole model in one process

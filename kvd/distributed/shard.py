"""Which slice of every weight a rank holds: heads, KV heads, the MLP's width and the vocabulary split N ways."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

# q/k/v and gate/up are split along their output rows (column-parallel: each rank computes its own heads and
# MLP columns), o and down along their input columns (row-parallel: the partial sums are all-reduced), the
# embedding table and lm_head along the vocabulary.
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


class ShardableConfig(Protocol):
    """What a plan reads of a model's config (kvd.model.config.ModelConfig is one): named here rather than
    imported, since the model imports this package and the import directions allow no way back."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int


C = TypeVar("C", bound=ShardableConfig)


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


def kv_head_range(num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    """(first, count) of this rank's KV heads: an even split, the first ranks taking one more when it is not.

    Query heads follow their KV head (whole GQA groups per rank), so 9 heads over 3 KV heads (SmolLM2) split
    6 + 3 on two ranks: uneven, but every rank's attention is the unsharded model's for its heads."""
    base, extra = divmod(num_kv_heads, shard.world_size)
    first = shard.rank * base + min(shard.rank, extra)
    return first, base + (shard.rank < extra)


@dataclass(frozen=True)
class ShardPlan(Generic[C]):
    """One rank's slice of a model: its config (a dataclass) and the part of each checkpoint tensor it keeps."""

    config: C  # the whole model's
    shard: Shard

    def local_config(self) -> C:
        """The config of this rank's slice: its heads and KV heads, 1/N of the MLP width and the vocabulary."""
        config, n = self.config, self.shard.world_size
        if not self.shard.sharded:
            return config
        if getattr(config, "qk_norm_all_heads", False):
            raise ShardingError(
                "this model norms q and k over all their heads at once (OLMo 2), which ranks holding some heads "
                "each cannot compute: run it at a tensor-parallel size of 1"
            )
        if getattr(config, "linear_attention", None) is not None:
            raise ShardingError(
                "this model has linear-attention layers (Gated DeltaNet), whose heads kvd does not split across "
                "ranks yet: run it at a tensor-parallel size of 1"
            )
        if getattr(config, "full_head_dim", None) is not None or getattr(config, "kv_source", ()):
            raise ShardingError(
                "this model's layers differ in head size or share K/V (Gemma 4), which kvd does not split across "
                "ranks yet: run it at a tensor-parallel size of 1"
            )
        if config.num_key_value_heads < n:
            raise ShardingError(
                f"the model has {config.num_key_value_heads} KV heads, fewer than {n} ranks: use a "
                "tensor-parallel size of at most that"
            )
        if config.intermediate_size % n:
            raise ShardingError(
                f"intermediate_size is {config.intermediate_size}, which {n} ranks cannot split evenly; use a "
                "tensor-parallel size that divides it"
            )
        _, kv_heads = kv_head_range(config.num_key_value_heads, self.shard)
        moe = getattr(config, "moe", None)  # each rank holds a slice of every expert, as of a dense MLP
        if moe is not None:
            if moe.intermediate_size % n:
                raise ShardingError(
                    f"the experts' width is {moe.intermediate_size}, which {n} ranks cannot split evenly; use a "
                    "tensor-parallel size that divides it"
                )
            if moe.shared_expert_size % n:
                raise ShardingError(
                    f"the shared expert's width is {moe.shared_expert_size}, which {n} ranks cannot split evenly; "
                    "use a tensor-parallel size that divides it"
                )
            moe = dataclasses.replace(
                moe,
                intermediate_size=moe.intermediate_size // n,
                shared_expert_size=moe.shared_expert_size // n,
            )
        return dataclasses.replace(
            config,
            num_attention_heads=kv_heads * self._group(),
            num_key_value_heads=kv_heads,
            intermediate_size=config.intermediate_size // n,
            vocab_size=self.shard.vocab_rows(config.vocab_size),
            **({} if moe is None else {"moe": moe}),
        )

    def split(self, name: str, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """(dim, start, length) of this rank's slice of the checkpoint tensor `name` (Hugging Face naming) of this
        shape, where it is one range of one dimension; None where it is kept whole or cut otherwise (tensor)."""
        if not self.shard.sharded:
            return None
        if ".q_proj." in name:
            return (0, *self._rows(self._group()))
        if name.endswith(".self_attn.sinks"):  # one logit per query head
            start, length = self._rows(self._group())
            return 0, start // self.config.head_dim, length // self.config.head_dim
        if ".k_proj." in name or ".v_proj." in name:
            return (0, *self._rows(1))
        if ".gate_proj." in name or ".up_proj." in name:
            return (0, *self._chunk(shape[0]))
        if name.endswith(".o_proj.weight"):
            return (1, *self._rows(self._group()))
        if name.endswith(".down_proj.weight"):
            return (1, *self._chunk(shape[1]))
        return None

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """(start, rows) of this rank's vocabulary rows; the last rank's may run past the table (padding rows:
        never looked up, their logits cut off)."""
        return self.shard.vocab_start(vocab), self.shard.vocab_rows(vocab)

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name` (Hugging Face naming); norms are replicated."""
        if not self.shard.sharded:
            return tensor
        cut = self.split(name, tensor.shape)
        if cut is not None:
            return tensor.narrow(*cut)
        if name.endswith((".o_proj.bias", ".down_proj.bias")):
            # Added once, by rank 0, to the sum the all-reduce forms: the others add zeros.
            return tensor if self.shard.rank == 0 else torch.zeros_like(tensor)
        if name in _VOCAB_PARALLEL:
            start, rows = self.vocab_range(tensor.shape[0])
            part = tensor[start : start + rows]
            if part.shape[0] == rows:
                return part  # a view: the table is not copied here
            return torch.cat((part, part.new_zeros(rows - part.shape[0], *part.shape[1:])))
        return tensor

    def _group(self) -> int:
        return self.config.num_attention_heads // self.config.num_key_value_heads

    def _rows(self, heads_per_kv_head: int) -> tuple[int, int]:
        """(start, length) in rows of a projection with heads_per_kv_head heads per KV head."""
        first, count = kv_head_range(self.config.num_key_value_heads, self.shard)
        size = heads_per_kv_head * self.config.head_dim
        return first * size, count * size

    def _chunk(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of `size` (local_config checks that it divides)."""
        share = size // self.shard.world_size
        return self.shard.rank * share, share


WHOLE = Shard()  # the whole model in one process

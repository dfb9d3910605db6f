"""Turns scheduled chunks into one flat varlen batch, runs the model over the paged KV pool, returns logits."""

from __future__ import annotations

import contextlib

import torch

from kvd.distributed.step import Command, RecurrentRows, StepChannel, StepInputs
from kvd.engine.cuda_graphs import DecodeGraphRunner
from kvd.engine.scheduler import ScheduledChunk
from kvd.engine.sequence import Sequence
from kvd.model.compile import compile_hot_paths
from kvd.model.config import ModelConfig
from kvd.model.decoder import CausalLM
from kvd.model.huge_pages import return_freed_heap
from kvd.model.layers.attention import build_attention_metadata, host_to_device
from kvd.model.layers.attention.graph_decode import GraphDecodeBackend
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.layers.recurrent_state import allocate_state


class MaxModelLenError(ValueError):
    """max_model_len is more than the positions the model has rotary angles for."""


class ModelRunner:
    """Owns the KV pool (num_blocks for the block manager, then one null block that CUDA-graph padding rows
    read), the recurrent state slots of a model with linear-attention layers (num_state_slots, handed out by the
    block manager) and, on CUDA, the compiled hot paths and the decode graphs.

    With tensor parallelism every rank has one, over its shard and its own pool: rank 0's sends each step and
    each logits projection through `channel` to the others, whose loop (kvd.distributed.worker) calls
    `execute` and `logits` with what it receives."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool,
        channel: StepChannel | None = None,
        num_state_slots: int = 0,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        if max_model_len > config.max_position_embeddings:
            raise MaxModelLenError(
                f"max_model_len {max_model_len} is more than the {config.max_position_embeddings} positions "
                "the model has; pass at most that (ModelConfig.cap_max_model_len)"
            )
        self.model = model
        self.block_size = block_size
        self.device = device
        self.channel = channel
        self.null_block = num_blocks
        for rotary in {id(r): r for r in model.layer_rotaries()}.values():
            rotary.truncate(max_model_len)  # no position reaches past the context served
        return_freed_heap()
        self.kv_caches = allocate_kv_cache(config, num_blocks + 1, block_size, dtype, device, model.kv_groups)
        model.bind_kv_cache(self.kv_caches)
        self.recurrent = model.config.has_recurrent_state
        # The convolution windows hold the model's activations (state_dtype; the KV pool's dtype may be int8).
        self.states = allocate_state(model.config, num_state_slots, state_dtype or dtype, device)
        model.bind_recurrent_state(self.states)
        self.graphs: DecodeGraphRunner | None = None
        self.num_graph_steps = 0  # steps replayed from a CUDA graph; the others ran eagerly
        self.num_eager_steps = 0
        # Sharded models run eagerly: the all-reduces between layers are not captured in graphs here; so do
        # models with sliding-window layers (the graphs' decode metadata has no sliding part yet) and mixtures of
        # experts (their grouped launches need no host sync, but capturing them is untested: no GPU at hand), and
        # models with recurrent state (their torch path on CUDA loops on the host).
        eager = (
            enforce_eager
            or model.shard.sharded
            or model.config.attention_window is not None
            or model.config.moe is not None
            or self.recurrent
        )
        if device.type == "cuda" and not eager:
            compile_hot_paths(model)
            if isinstance(model.attention_backend, GraphDecodeBackend):
                self.graphs = DecodeGraphRunner(
                    model, block_size, max_num_seqs, max_model_len, device, self.null_block
                )
                self.graphs.capture()

    def pool_bytes(self) -> int:
        """Bytes the KV pool and the recurrent state slots hold (each tensor once: the layers share views)."""
        tensors = [*self.kv_caches, *(t for state in self.states for t in (state.conv, state.state))]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        """Compute the chunks' K/V; the final hidden states and each chunk's first row in them.

        A chunk's draft tokens follow its tokens as decode rows of their own over the same block tables, each
        attending to the context up to itself (every layer writes the step's K/V before it attends): their
        rows are computed exactly as decode steps would compute them, with batch invariance bit for bit. A
        step of decode rows replayed from a CUDA graph gives one row per token, as an eager step does."""
        null = self.null_block
        inputs = StepInputs(
            [],
            [],
            [],
            [],
            [[] for _ in range(1, self.model.kv_groups.num_groups)],
            [] if self.recurrent else None,
        )
        starts: list[int] = []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            starts.append(len(inputs.input_ids))
            # A sliding group's released blocks (behind its window: no kernel reads them) name the null block.
            tables = [
                [null] * seq.num_released[g] + seq.block_tables[g][seq.num_released[g] :]
                for g in range(1, self.model.kv_groups.num_groups)
            ]
            rows = [(seq.token_ids[start : start + chunk.num_new_tokens], start + chunk.num_new_tokens)]
            rows += [([token], start + chunk.num_new_tokens + 1 + i) for i, token in enumerate(chunk.draft)]
            if inputs.recurrent is not None:
                inputs.recurrent.append(_recurrent_rows(seq, start, chunk))
            for ids, context_len in rows:
                inputs.input_ids.extend(ids)
                inputs.query_lens.append(len(ids))
                inputs.context_lens.append(context_len)
                inputs.block_tables.append(seq.block_table)
                for group_tables, table in zip(inputs.group_tables, tables, strict=True):
                    group_tables.append(table)
        if self._replays(inputs):
            self.num_graph_steps += 1
            return self.graphs.run(inputs.input_ids, inputs.block_tables, inputs.context_lens), starts
        self.num_eager_steps += 1
        with self._command(Command.STEP, lambda: inputs.encode(self.block_size)):
            return self.execute(inputs), starts

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's inputs, eagerly: the final hidden states, one row per token."""
        attn = build_attention_metadata(
            block_tables=inputs.block_tables,
            context_lens=inputs.context_lens,
            query_lens=inputs.query_lens,
            block_size=self.block_size,
            device=self.device,
            backend=self.model.attention_backend,
            kv_groups=self.model.kv_groups,
            group_tables=inputs.group_tables,
            recurrent=inputs.recurrent,
        )
        return self.model(
            host_to_device(inputs.input_ids, torch.long, self.device),
            host_to_device(inputs.positions, torch.long, self.device),
            attn,
        )

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """float32 logits of the given rows of `hidden`."""
        if not rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        with self._command(Command.LOGITS, lambda: rows):
            return self.model.compute_logits(hidden[host_to_device(rows, torch.long, self.device)])

    def _command(self, command: Command, payload) -> contextlib.AbstractContextManager:
        """Rank 0: send the command to the other ranks (payload built only then); alone: nothing to send."""
        if self.channel is None:
            return contextlib.nullcontext()
        return self.channel.command(command, payload())

    def _replays(self, inputs: StepInputs) -> bool:
        """A CUDA graph runs the step: every row is one token and a captured size holds the batch."""
        return (
            self.graphs is not None
            and all(q == 1 for q in inputs.query_lens)
            and self.graphs.can_run(len(inputs.query_lens))
        )


def _recurrent_rows(seq: Sequence, start: int, chunk: ScheduledChunk) -> RecurrentRows:
    """Where the sequence's state starts this step (zeros, a checkpoint after a prefix hit, or its own slot) and
    its snapshots: the checkpoint the block manager planned (kvd.engine.state_slots), and with a draft, the state
    after the chunk's last row and after each draft row but the last, into the draft's slots, so that the state
    after the accepted tokens stands however many are accepted (BlockManager.settle_draft_state)."""
    source = -1 if start == 0 else seq.restore_slot if seq.restore_slot is not None else seq.state_slot
    snapshots = [] if seq.snapshot is None else [(seq.snapshot.tokens - start - 1, seq.snapshot.slot)]
    last = chunk.num_new_tokens - 1
    snapshots += [(last + i, slot) for i, slot in enumerate(seq.draft_slots)]
    return RecurrentRows(seq.state_slot, source, tuple(sorted(snapshots)), len(chunk.draft))

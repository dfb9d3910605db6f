"""How many blocks the KV pool gets: an explicit budget, else on CUDA what the memory profile leaves (measured
by gpu_memory.py), else on a CPU a share of the host's available memory. A model with linear-attention layers
takes its recurrent state slots from the same budget first."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvd.engine.engine_args import EngineArgs
from kvd.engine.errors import MemoryBudgetError, RequestRejectedError
from kvd.engine.gpu_memory import DeviceMemory, profile_kv_cache_budget
from kvd.model.decoder import CausalLM
from kvd.model.layers.kv_cache import kv_cache_bytes_per_block
from kvd.model.layers.recurrent_state import state_bytes_per_slot
from kvd.parallel.group import weight_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    # A linear-attention model's recurrent state slots (kvd.engine.state_slots): one per sequence that runs at
    # once (at most max_num_seqs), and checkpoints; each takes state_bytes.
    num_live_states: int = 0
    num_checkpoints: int = 0
    state_bytes: int = 0


def plan_pool(
    args: EngineArgs,
    model: CausalLM,
    kv_dtype: torch.dtype,
    dtype: torch.dtype,
    max_model_len: int,
    baseline: DeviceMemory | None,
) -> PoolPlan:
    """This rank's pool: blocks of `args.block_size` tokens and the state slots. `max_model_len`: the model's
    cap of the setting, the longest sequence the profile runs; `dtype`: the model's (its states' windows); `baseline`: the CUDA device's memory before the
    model loaded (None off CUDA). Live states take at most half the budget (a hybrid model's sequence keeps
    K/V for a quarter of its layers only), checkpoints a quarter unless args.state_checkpoints says how many."""
    per_block = kv_cache_bytes_per_block(model.config, args.block_size, kv_dtype)
    budget = args.kv_cache_memory
    if budget is None and args.tensor_parallel_size > 1 and baseline is not None:
        raise RequestRejectedError(
            "tensor parallel on CUDA needs --kv-cache-memory (the pool of each rank): the profiling pass "
            "runs on one rank only",
            "kv_cache_memory",
        )
    if budget is None and baseline is not None:
        # With --memory the pool takes its fraction of what the weights leave of it, within what the device allows.
        share = None if args.memory is None else _share(args, weight_bytes(model))
        budget = profile_kv_cache_budget(
            model,
            args.block_size,
            args.max_num_batched_tokens,
            args.max_num_seqs,
            max_model_len,
            args.gpu_memory_utilization,
            baseline,
        )
        budget = budget if share is None else min(budget, share)
    elif budget is None and args.memory is not None:
        budget = _share(args, weight_bytes(model))
    elif budget is None:
        # The ranks of one host share its memory: each takes its part of the fraction.
        budget = int(_available_memory_bytes() * args.kv_cache_memory_fraction / args.tensor_parallel_size)
    per_state = state_bytes_per_slot(model.config, dtype)
    live = checkpoints = 0
    if per_state:
        quarter = budget // 4 // per_state
        live = min(args.max_num_seqs, max(1, budget // 2 // per_state))
        checkpoints = min(live, quarter) if args.state_checkpoints is None else args.state_checkpoints
        checkpoints *= args.enable_prefix_caching  # only prefix hits read them
        if args.enable_prefix_caching and not checkpoints and args.state_checkpoints is None:
            logger.warning(
                "the KV cache memory (%d bytes) leaves no room for a recurrent state checkpoint (%d bytes): no "
                "prefix caching for this model; raise kv_cache_memory",
                budget,
                per_state,
            )
    num_state_slots = live + checkpoints
    state_bytes = num_state_slots * per_state
    num_blocks = (budget - state_bytes) // per_block
    if args.memory is not None:
        num_blocks = _within_budget(args, weight_bytes(model), num_blocks, per_block, state_bytes)
    if num_blocks < 2:
        raise RequestRejectedError(
            f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes"
            + (
                f" beside {num_state_slots} recurrent state slots ({state_bytes} bytes)"
                if state_bytes
                else ""
            )
            + "; "
            "raise kv_cache_memory (on CUDA: gpu_memory_utilization, or free the device memory that "
            "another engine or process holds)"
        )
    return PoolPlan(num_blocks, live, checkpoints, per_state)


def _share(args: EngineArgs, weights: int) -> int:
    """A pool sized by the memory budget: --kv-cache-memory-fraction of what the weights leave of it."""
    return int(max(0, args.memory - weights) * args.kv_cache_memory_fraction)


def _within_budget(args: EngineArgs, weights: int, num_blocks: int, per_block: int, state_bytes: int) -> int:
    """The blocks that fit the memory budget beside the weights, the state slots and the pool's null block: a pool
    sized by the fraction shrinks to them, an explicit --kv-cache-memory that does not fit is refused."""
    room = (args.memory - weights - state_bytes) // per_block - 1
    wanted = num_blocks if args.kv_cache_memory is not None else 2  # the smallest pool that serves
    if room >= max(wanted, 2):
        return min(max(num_blocks, 2), room)  # a fraction too small for two blocks takes two, where they fit
    needed = weights + (max(wanted, 2) + 1) * per_block + state_bytes
    raise MemoryBudgetError(
        f"the model's weights ({weights} bytes) and its KV pool need {needed} bytes; the memory budget has "
        f"{args.memory}: raise --memory" + (" or lower --kv-cache-memory" if args.kv_cache_memory else ""),
        needed,
    )


def _available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory explicitly")

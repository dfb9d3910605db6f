"""Sizing the KV pool on CUDA: --gpu-memory-utilization of the device, less this process's own use at the peak
of the profiling steps (the largest batches the scheduler can form), less a reserve for what is made after the
pool (CUDA graph pools, compiled kernels). Other processes' memory is not charged to the fraction, but the pool
never takes more than is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvd.distributed.step import RecurrentRows
from kvd.engine.sampler import SamplingRow, sample
from kvd.model.decoder import CausalLM
from kvd.model.layers.attention import build_attention_metadata
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.layers.recurrent_state import allocate_state
from kvd.model.loader import check_device
from kvd.request.sampling_params import SamplingParams


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    torch_reserved: int  # held by this process's caching allocator

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        check_device(device)
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_reserved(device))


# Made after the pool is sized, so no profile sees it: the decode CUDA graphs' memory pool (activations of the
# largest captured batch, at most MAX_CAPTURE_SIZE tokens), Inductor's and Triton's loaded kernels, cuBLAS
# workspaces of shapes the profile did not run.
RUNTIME_RESERVE_BYTES = 1 << 30


def kv_cache_budget(
    utilization: float,
    baseline: DeviceMemory,
    after: DeviceMemory,
    torch_peak: int,
    torch_now: int,
    reserve: int = RUNTIME_RESERVE_BYTES,
) -> int:
    """Bytes for the pool, from readings at baseline (before loading) and after the profile (cache emptied).

    This process's use is torch's peak allocation (weights and the largest step's activations) plus memory
    that appeared outside torch's allocator since baseline (cuBLAS workspaces, loaded kernels), plus `reserve`.
    """
    outside_torch = (baseline.free - after.free) - (after.torch_reserved - baseline.torch_reserved)
    budget = int(utilization * after.total) - torch_peak - max(0, outside_torch) - reserve
    # Activations come back out of free memory at every step: the pool must leave room for them.
    return min(budget, after.free - (torch_peak - torch_now) - reserve)


@dataclass(frozen=True)
class ProfileStep:
    """One step's shape: per sequence, tokens in the cache after the step and tokens computed in it."""

    context_lens: list[int]
    query_lens: list[int]
    tables: list[list[int]] = field(default_factory=list)


def profile_steps(
    block_size: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[ProfileStep]:
    """The steps whose peaks bound every step's: a full token budget of fresh prompts (the largest matmuls),
    and the longest chunk over the longest cached prefix (the attention backends' gather of the whole context
    and their [chunk x context] mask, which grow with both)."""
    fresh = [
        min(max_model_len, max_num_batched_tokens - start)
        for start in range(0, max_num_batched_tokens, max_model_len)
    ]
    steps = [ProfileStep(fresh, fresh)]
    chunk = min(max_num_batched_tokens, max_model_len - 1)
    if chunk > 1:
        steps.append(ProfileStep([max_model_len], [chunk]))
    for step in steps:  # each step has the scratch pool to itself, from block 0
        first = 0
        for n in step.context_lens:
            step.tables.append(list(range(first, first + -(-n // block_size))))
            first += len(step.tables[-1])
    return steps


@torch.inference_mode()
def run_profile_step(
    model: CausalLM, block_size: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Run the profile_steps over one scratch pool, each sampling max_num_seqs rows with every sampler
    feature on; returns the scratch pool's bytes, which the caller leaves out of the peak. Runs on any device.
    """
    param = next(model.parameters())
    max_model_len = model.config.cap_max_model_len(max_model_len)
    steps = profile_steps(block_size, max_num_batched_tokens, max_num_seqs, max_model_len)
    num_blocks = max(sum(len(t) for t in step.tables) for step in steps)
    pool = allocate_kv_cache(model.config, num_blocks, block_size, param.dtype, param.device)
    model.bind_kv_cache(pool)
    # A linear-attention model's state slots, one per sequence of the largest step (each starts from zeros).
    slots = max(len(step.tables) for step in steps) if model.config.has_recurrent_state else 0
    states = allocate_state(model.config, slots, param.dtype, param.device)
    model.bind_recurrent_state(states)
    # The heaviest sampler path: a full sort (top-k/p), penalties over a long history, logprobs.
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, logprobs=20, repetition_penalty=1.1, frequency_penalty=0.5
    )
    history = list(range(max_model_len))
    for step in steps:
        attn = build_attention_metadata(
            step.tables,
            step.context_lens,
            step.query_lens,
            block_size,
            param.device,
            model.attention_backend,
            kv_groups=model.kv_groups,
            recurrent=[RecurrentRows(i, -1) for i in range(len(step.tables))] if states else None,
        )
        positions = torch.cat(
            [
                torch.arange(c - n, c, device=param.device)
                for c, n in zip(step.context_lens, step.query_lens, strict=True)
            ]
        )
        hidden = model(torch.zeros_like(positions), positions, attn)
        num_rows = min(max_num_seqs, hidden.shape[0])
        logits = model.compute_logits(hidden[-num_rows:])
        sample(logits, [SamplingRow(params, None, history, 1) for _ in range(num_rows)])
        del attn, hidden, logits
    tensors = [*pool, *(t for state in states for t in (state.conv, state.state))]
    scratch = sum(t.numel() * t.element_size() for t in tensors)
    # Unbind the scratch pool and states (a one-block pool and one slot take their place) so that their memory can
    # be returned.
    model.bind_kv_cache(allocate_kv_cache(model.config, 1, block_size, param.dtype, param.device))
    model.bind_recurrent_state(allocate_state(model.config, 1, param.dtype, param.device))
    return scratch


def profile_kv_cache_budget(
    model: CausalLM,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    utilization: float,
    baseline: DeviceMemory,
) -> int:
    """kv_cache_budget measured around run_profile_step on the model's CUDA device."""
    device = next(model.parameters()).device
    torch.cuda.reset_peak_memory_stats(device)
    scratch = run_profile_step(model, block_size, max_num_batched_tokens, max_num_seqs, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch
    torch.cuda.empty_cache()
    after = DeviceMemory.read(device)
    return kv_cache_budget(utilization, baseline, after, peak, torch.cuda.memory_allocated(device))

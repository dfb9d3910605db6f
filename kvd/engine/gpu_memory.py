"""Sizing the KV pool on CUDA: --gpu-memory-utilization of the device, less this process's own use at the peak
of a profiling step (the largest batch the scheduler can form). Other processes' memory is not charged to the
fraction, but the pool never takes more than is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvd.engine.sampler import SamplingRow, sample
from kvd.engine.sampling_params import SamplingParams
from kvd.model.layers.attention import build_attention_metadata
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.llama import CausalLM


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    torch_reserved: int  # held by this process's caching allocator

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_reserved(device))


def kv_cache_budget(
    utilization: float, baseline: DeviceMemory, after: DeviceMemory, torch_peak: int, torch_now: int
) -> int:
    """Bytes for the pool, from readings at baseline (before loading) and after the profile (cache emptied).

    This process's use is torch's peak allocation (weights and the largest step's activations) plus memory
    that appeared outside torch's allocator since baseline (cuBLAS workspaces, loaded kernels).
    """
    outside_torch = (baseline.free - after.free) - (after.torch_reserved - baseline.torch_reserved)
    budget = int(utilization * after.total) - torch_peak - max(0, outside_torch)
    # Activations come back out of free memory at every step: the pool must leave room for them.
    return min(budget, after.free - (torch_peak - torch_now))


@torch.inference_mode()
def run_profile_step(
    model: CausalLM, block_size: int, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Run the largest step the scheduler can form (a full token budget, max_num_seqs rows sampled) over a
    scratch pool; returns the scratch pool's bytes, which the caller leaves out of the peak. Runs on any device.
    """
    param = next(model.parameters())
    lens = [
        min(max_model_len, max_num_batched_tokens - start)
        for start in range(0, max_num_batched_tokens, max_model_len)
    ]
    num_blocks = sum(-(-n // block_size) for n in lens)
    pool = allocate_kv_cache(model.config, num_blocks, block_size, param.dtype, param.device)
    model.bind_kv_cache(pool)
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // block_size))))
        first += len(tables[-1])
    attn = build_attention_metadata(tables, lens, lens, block_size, param.device, model.attention_backend)
    positions = torch.cat([torch.arange(n, device=param.device) for n in lens])
    hidden = model(torch.zeros_like(positions), positions, attn)
    num_rows = min(max_num_seqs, hidden.shape[0])
    logits = model.compute_logits(hidden[-num_rows:])
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)  # the sampler's heaviest path: a full sort
    sample(logits, [SamplingRow(params, None, [0], 1) for _ in range(num_rows)])
    scratch = sum(t.numel() * t.element_size() for t in pool)
    # Unbind the scratch pool (a one-block pool takes its place) so that its memory can be returned.
    model.bind_kv_cache(allocate_kv_cache(model.config, 1, block_size, param.dtype, param.device))
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

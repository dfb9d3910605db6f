"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next: a causal convolution over the projected
q, k and v, then per value head a state matrix that decays, is corrected toward each token's value (the delta
rule) and answers each query; the output RMS-normed and gated by SiLU(z) per head.

On the CPU one native kernel (kvd_gated_delta) runs the convolution and the recurrence, each sequence's rows alone
in one order: a step's batch, its chunking and the other sequences never change their bits. Elsewhere the same
arithmetic runs here in torch, sequence by sequence and token by token (on a CPU without the native kernels,
torch's vectorized exp and sigmoid round a tensor's tail differently from its body, so there only to within
rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvd.kernels import cpu_native
from kvd.model.config import LinearAttention, ModelConfig
from kvd.model.layers.linear import Linear
from kvd.model.layers.recurrent_state import LayerState, RecurrentStep


class StateNotBoundError(RuntimeError):
    """forward ran before bind_recurrent_state gave the linear-attention layers their state slots."""


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, scaled by `scale` (not offset by 1, unlike the model's other norms), then
    multiplied by SiLU(gate) in float32 and rounded to the dtype (transformers' order)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if cpu_native.supports(x) and x.dtype == self.scale.dtype == gate.dtype:
            # each head in one fixed order, and the native layer loop's SiLU
            return cpu_native.gated_rms_norm(x, gate, self.scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.scale * h.to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class Conv1dWeight(nn.Module):
    """The convolution's depthwise filters as checkpoints hold them: weight [channels, 1, kernel]."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        shape: LinearAttention = config.linear_attention
        self.shape = shape
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, shape.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, shape.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, shape.num_value_heads, bias=False)
        self.in_proj_a = Linear(hidden, shape.num_value_heads, bias=False)
        self.conv1d = Conv1dWeight(shape.conv_dim, shape.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(shape.num_value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(shape.num_value_heads), requires_grad=False)
        self.out_norm = GatedRMSNorm(shape.value_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(shape.value_dim, hidden, bias=False)
        self.state: LayerState | None = None

    def forward(self, x: torch.Tensor, step: RecurrentStep | None) -> torch.Tensor:
        if self.state is None or step is None:
            raise StateNotBoundError(
                "call model.bind_recurrent_state(allocate_state(...)) and build the step's metadata with "
                "state_slots before forward"
            )
        shape, tokens = self.shape, x.shape[0]
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        weight = self.conv1d.weight.view(shape.conv_dim, shape.conv_kernel).float()
        if cpu_native.supports(qkv) and self.state.state.is_cpu:
            core = cpu_native.gated_delta(
                qkv.contiguous(), a.contiguous(), b.contiguous(), weight.contiguous(), self.A_log.float(),
                self.dt_bias.float(), self.state.conv, self.state.state, step.starts_t, step.kernel_args,
                shape.num_key_heads, shape.tiled_value_heads,
            )  # fmt: skip
        else:
            core = _gated_delta_torch(qkv, a, b, weight, self.A_log.float(), self.dt_bias.float(), self, step)
        heads = core.view(tokens, shape.num_value_heads, shape.value_head_dim)
        gate = z.view(tokens, shape.num_value_heads, shape.value_head_dim)
        return self.out_proj(self.out_norm(heads, gate).view(tokens, -1))


def _gated_delta_torch(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    layer: GatedDeltaNet,
    step: RecurrentStep,
) -> torch.Tensor:
    """kvd_gated_delta's arithmetic in torch (its rounding, not its summation order): each sequence alone."""
    shape, state = layer.shape, layer.state
    kernel, dtype = shape.conv_kernel, qkv.dtype
    group = shape.num_value_heads // shape.num_key_heads
    out = qkv.new_empty(qkv.shape[0], shape.value_dim)
    decay = torch.exp(-A_log.exp() * F.softplus(a.float() + dt_bias))
    beta = b.sigmoid().float()
    for first, end, rows_of in zip(step.starts[:-1], step.starts[1:], step.rows, strict=True):
        rows, slot, source = end - first, rows_of.slot, rows_of.source
        past = torch.zeros_like(state.conv[slot]) if source < 0 else state.conv[source].clone()
        window = torch.cat((past, qkv[first:end]))
        acc = window[:rows].float() * weight[:, 0]
        for j in range(1, kernel):
            acc = acc + window[j : j + rows].float() * weight[:, j]
        state.conv[slot] = window[rows:]
        for snap, snap_slot in rows_of.snapshots:
            state.conv[snap_slot] = window[snap + 1 : snap + kernel]
        mixed = F.silu(acc.to(dtype)).float()
        q, k, v = mixed.split([shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        q, k = (_per_value_head(t.reshape(rows, shape.num_key_heads, -1), group, shape) for t in (q, k))
        v = v.reshape(rows, shape.num_value_heads, -1)
        s = torch.zeros_like(state.state[slot]) if source < 0 else state.state[source].clone()
        for t in range(rows):
            qt = q[t] * torch.rsqrt((q[t] * q[t]).sum(-1, keepdim=True) + 1e-6) / shape.key_head_dim**0.5
            kt = k[t] * torch.rsqrt((k[t] * k[t]).sum(-1, keepdim=True) + 1e-6)
            s = s * decay[first + t, :, None, None]
            memory = (s * kt[:, :, None]).sum(-2)
            delta = (v[t] - memory) * beta[first + t, :, None]
            s = s + kt[:, :, None] * delta[:, None, :]
            out[first + t] = (s * qt[:, :, None]).sum(-2).reshape(-1).to(dtype)
            for snap, snap_slot in rows_of.snapshots:
                if snap == t:
                    state.state[snap_slot] = s
        state.state[slot] = s
    return out


def _per_value_head(x: torch.Tensor, group: int, shape: LinearAttention) -> torch.Tensor:
    """Key heads [rows, key_heads, dim] repeated for the value heads that read them (LinearAttention's orders)."""
    return x.repeat(1, group, 1) if shape.tiled_value_heads else x.repeat_interleave(group, dim=1)

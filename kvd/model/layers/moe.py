"""A mixture-of-experts MLP: a router scores every expert for each token, the top k run, their outputs are summed
with the router's weights (Qwen3-MoE, Mixtral, gpt-oss; kvd.model.config.MoE holds each one's variant).

The tokens of a step are grouped by expert, so each chosen expert's weights are read once for all of its tokens
(llama.cpp's MUL_MAT_ID does the same). Batch invariance holds as for dense layers: every expert's linears compute
each row alone (kvd's kernels), and a token's k outputs are summed in one order, by expert id, whatever the other
tokens of the step chose.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from kvd.distributed.comm import all_reduce
from kvd.distributed.shard import Shard
from kvd.kernels import cpu_native
from kvd.model.config import CLAMPED_SWIGLU, SOFTMAX_THEN_TOPK, ModelConfig, MoE
from kvd.model.layers.activation import clamped_swiglu, gated_activation
from kvd.model.layers.linear import Linear
from kvd.model.layers.mlp import GatedMLP
from kvd.model.layers.native_weights import native_linear, native_parts

# The config's names -> the native kernel's (cpu_native.MOE_SCORING, MOE_ACTIVATIONS).
_NATIVE_SCORING = {SOFTMAX_THEN_TOPK: "softmax_topk"}
_NATIVE_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", CLAMPED_SWIGLU: "clamped_swiglu"}


class RouterLinear(Linear):
    """The router's projection, kept in the model's float dtype when the experts are quantized: a small error
    in a logit can flip which experts a token gets (GGUF files keep it in float32 too)."""

    quantizable = False


def expert_activation(moe: MoE) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if moe.activation == CLAMPED_SWIGLU:
        return clamped_swiglu(moe.swiglu_alpha, moe.swiglu_limit)
    return gated_activation(moe.activation)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        moe = config.moe
        self.moe = moe
        self.shard = shard
        self.gate = RouterLinear(config.hidden_size, moe.num_experts, bias=moe.router_bias)
        activation = expert_activation(moe)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, moe.intermediate_size, moe.expert_bias, activation)
            for _ in range(moe.num_experts)
        )
        shared = moe.shared_expert_size
        self.shared_expert = GatedMLP(config.hidden_size, shared, False, activation) if shared else None
        self.shared_expert_gate = RouterLinear(config.hidden_size, 1, bias=False) if shared else None

    def native(self) -> cpu_native.ExpertWeights | None:
        """The whole mixture as kvd's native kernel runs it (one call a step: the router, the top k, each expert's
        tokens together, the sums), or None where the kernels are not built or an expert's linear has no native
        form that computes it as its Python forward does. Made on first use, again when a weight was replaced."""
        dtype = self.gate.weight.dtype
        # What replaces or moves the weights (quantization and GGUF installs replace the experts' linears; batch
        # invariance lays float weights out anew; .to() moves them) changes where their first tensors lie.
        key = tuple(
            _first_tensor(m).data_ptr()
            for m in (self.gate, self.experts[0].gate_up_proj, self.experts[-1].down_proj)
        )
        if getattr(self, "_native_key", None) == key:
            return self._native
        mlps = [*self.experts, *([self.shared_expert] if self.shared_expert is not None else [])]
        linears = [p for e in mlps for p in (e.gate_up_proj, e.down_proj)]
        routers = [self.gate, *([self.shared_expert_gate] if self.shared_expert_gate is not None else [])]
        usable = (
            cpu_native.available()
            and self.gate.weight.device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and all(isinstance(r, RouterLinear) for r in routers)
            and all(native_linear(m, dtype) for m in linears)
        )
        self._native_key, self._native = key, self._build_native() if usable else None
        return self._native

    def _build_native(self) -> cpu_native.ExpertWeights:
        bias = None if self.gate.bias is None else self.gate.bias.float()
        self._router_bias = bias  # the kernel reads it in place: kept alive here
        experts = [(native_parts(e.gate_up_proj), native_parts(e.down_proj)[0]) for e in self.experts]
        shared = self.shared_expert
        if shared is not None:
            shared = (
                native_parts(shared.gate_up_proj),
                native_parts(shared.down_proj)[0],
                _float_weight(self.shared_expert_gate, None),
                self.moe.shared_expert_size,
            )
        return cpu_native.ExpertWeights(
            _float_weight(self.gate, bias),
            experts,
            self.moe.top_k,
            self.moe.intermediate_size,
            _NATIVE_SCORING.get(self.moe.scoring, "topk_softmax"),
            self.moe.normalize_top_k,
            _NATIVE_ACTIVATIONS[self.moe.activation],
            self.moe.swiglu_alpha,
            self.moe.swiglu_limit,
            shared,
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k]): each token's experts in ascending id order."""
        logits = self.gate(x).float()
        k = self.moe.top_k
        if self.moe.scoring == SOFTMAX_THEN_TOPK:
            weights, ids = logits.softmax(dim=-1).topk(k, dim=-1)
            if self.moe.normalize_top_k:
                weights = weights / _row_sums(weights)
        else:
            top, ids = logits.topk(k, dim=-1)
            weights = top.softmax(dim=-1)
        ids, order = ids.sort(dim=-1)
        return weights.gather(-1, order), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mixture's output, all-reduced over the tensor-parallel ranks (each holds a slice of every expert)."""
        native = self.native() if cpu_native.supports(x) and x.dtype == self.gate.weight.dtype else None
        if native is not None:
            return all_reduce(native.forward(x.reshape(-1, x.shape[-1])).view(x.shape), self.shard)
        weights, ids = self.route(x)
        outputs = self._grouped(x, ids) if x.device.type == "cuda" else self._per_expert(x, ids)
        # Slot by slot (ascending expert id), elementwise: a token's sum never depends on the others'.
        outputs = outputs.view(*ids.shape, -1)
        total = outputs[:, 0].float() * weights[:, :1]
        for slot in range(1, ids.shape[1]):
            total += outputs[:, slot].float() * weights[:, slot : slot + 1]
        out = total.to(x.dtype)
        if self.shared_expert is not None:
            # As transformers adds it: routed + sigmoid(gate) x shared, in the dtype.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out, self.shard)

    def _per_expert(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot)'s expert output [T x top_k, hidden], expert by expert over its tokens (torch)."""
        k = ids.shape[1]
        outputs = x.new_empty(ids.numel(), x.shape[-1])
        slots = ids.flatten().argsort(stable=True)  # grouped by expert
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                mine = slots[start : start + count]
                outputs[mine] = expert(x[mine // k])
                start += count
        return outputs

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """_per_expert's outputs from two grouped Triton launches (kvd.kernels.grouped_experts): no host sync."""
        from kvd.kernels.grouped_experts import grouped_linear, plan_rows

        gate_up, gate_up_bias, down, down_bias = self.stacked_weights()
        plan = plan_rows(ids, len(self.experts))
        hidden = grouped_linear(x.contiguous(), gate_up, gate_up_bias, ids, plan, per_token=True)
        act = self.experts[0].activation(*hidden.split(self.moe.intermediate_size, dim=-1))
        return grouped_linear(act.contiguous(), down, down_bias, ids, plan, per_token=False)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(gate/up [E, 2 width, hidden], its biases [E, 2 width], down [E, hidden, width], its biases) of the
        experts, stacked once in row order: each expert's parameters become views of the stacks (no second copy)."""
        if getattr(self, "_stacks", None) is None:
            stacks = []
            for name in ("gate_up_proj", "down_proj"):
                linears = [getattr(e, name) for e in self.experts]
                stack = torch.stack([lin.row_weight() for lin in linears])
                biases = None if linears[0].bias is None else torch.stack([lin.bias.data for lin in linears])
                for e, lin in enumerate(linears):
                    lin.weight.data, lin.tiles = stack[e], False
                    if biases is not None:
                        lin.bias.data = biases[e]
                stacks += [stack, biases]
            self._stacks = tuple(stacks)
        return self._stacks


def _first_tensor(module: nn.Module) -> torch.Tensor:
    return next(itertools.chain(module.parameters(), module.buffers()))


def _float_weight(linear: Linear, bias: torch.Tensor | None) -> cpu_native.LinearWeight:
    """A router's float weight as the native kernel reads it, with a float32 bias (added before any rounding)."""
    bits = 16 if linear.weight.dtype == torch.bfloat16 else 32
    return cpu_native.linear_weight(bits, linear.weight, bias=bias, tiles=linear.tiles)


def _row_sums(weights: torch.Tensor) -> torch.Tensor:
    """[T, 1]: each row's sum, column by column (a reduction kernel may order a row's adds by the batch's shape)."""
    total = weights[:, :1].clone()
    for column in range(1, weights.shape[1]):
        total += weights[:, column : column + 1]
    return total


def describe_experts(model: nn.Module, weight_bytes: int) -> dict | None:
    """info's "experts" for a model with mixture-of-experts layers (None without): the experts' parameters and
    bytes in all, and the bytes a token reads: every weight but the experts it is not routed to and, where another
    matrix projects the logits, the embedding table (one row of it is looked up)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return None
    embedding = model.model.embed_tokens
    output = model.output_proj or model.lm_head  # what projects the logits (None: the tied table itself)
    looked_up = output is not None and output is not getattr(
        embedding, "table", None
    )  # a GGUF file's tied table
    table_bytes = sum(t.numel() * t.element_size() for t in _tensors(embedding)) if looked_up else 0
    moe, hidden = layers[0].moe, layers[0].gate.weight.shape[-1]
    per_expert = 3 * hidden * moe.intermediate_size + (2 * moe.intermediate_size + hidden) * moe.expert_bias
    expert_bytes = sum(t.numel() * t.element_size() for m in layers for t in _tensors(m.experts))
    idle = (moe.num_experts - moe.top_k) / moe.num_experts
    return {
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "sparse_layers": len(layers),
        "expert_parameters": len(layers) * moe.num_experts * per_expert,
        "active_expert_parameters": len(layers) * moe.top_k * per_expert,
        "expert_bytes": expert_bytes,
        "active_bytes_per_token": round(weight_bytes - table_bytes - idle * expert_bytes),
    }


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]

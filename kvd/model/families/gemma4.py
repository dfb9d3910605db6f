"""Gemma 4 (text): Gemma 3's sandwich of norms (plain-weight RMSNorms here), q/k norms and a value norm without scale
in place of the attention scale, full layers with their own head size (and KV heads where their keys also give the
values), proportional RoPE on the full layers, the last layers attending earlier layers' K/V (KV sharing, with MLPs
twice as wide where the config says so), per-layer inputs (a second embedding table mixed with a projection of the
token embeddings, added by each layer through a gate after its MLP), a scalar per layer, and in 26B-A4B a mixture
of experts beside each layer's dense MLP."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvd.distributed.comm import all_reduce
from kvd.distributed.shard import Shard
from kvd.model.config import FULL, Layout, ModelConfig, MoE, UnsupportedModelError
from kvd.model.decoder import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    KVCacheNotBoundError,
    SelfAttention,
    WeightLoadError,
    text_model_name,
)
from kvd.model.families.gemma3 import Gemma3ForCausalLM
from kvd.model.layers.activation import gated_activation
from kvd.model.layers.attention import AttentionBackend, AttentionMetadata
from kvd.model.layers.linear import Embedding, Linear
from kvd.model.layers.moe import SparseMoE
from kvd.model.layers.norm import RMSNorm, UnscaledRMSNorm
from kvd.model.layers.rotary import RotaryRows, apply_rotary

# A released Gemma 4 checkpoint (Gemma4ForConditionalGeneration) holds its text model beside the vision and audio
# towers, which kvd does not run.
_NOT_TEXT = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_GLOBAL_HEAD_DIM = 512  # transformers' default for a config without global_head_dim
_SHARED_KV_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm|v_norm)\.\w+")


class Gemma4Attention(SelfAttention):
    """Values normed without a scale and attention unscaled (q and k are normed); a full layer's keys may give its
    values too (k_eq_v). A layer that `shares` another's K/V projects queries only and attends its source's pool
    with the K/V the source computed this step (writing them again where they already are: the same bits)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        shard: Shard,
        window: int | None,
        shares: bool,
        k_eq_v: bool,
    ) -> None:
        super().__init__(config, backend, shard, window, kv_parts=0 if shares else 1 if k_eq_v else 2)
        # The attention whose K/V this one reads (Gemma4Model binds it); a list, so that it is no submodule here.
        self.source: list[Gemma4Attention] = []
        self.feeds_others = False  # other layers read this one's K/V: it keeps the step's (step_kv)
        self.v_norm = None if shares else UnscaledRMSNorm(config.head_dim, config.rms_norm_eps)
        if shares:
            self.k_norm = None
        self.step_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # with feeds_others: this step's K/V

    def forward(self, x: torch.Tensor, rope: RotaryRows, attn: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise KVCacheNotBoundError("call model.bind_kv_cache(allocate_kv_cache(...)) before forward")
        tokens = x.shape[0]
        parts = [p.view(tokens, -1, self.head_dim) for p in self.qkv_proj.forward_shards(x)]
        q = apply_rotary(self.q_norm(parts[0]), rope)
        if self.source:
            k, v = self.source[0].step_kv
        else:
            k = parts[1]
            v = self.v_norm(parts[-1])  # before k's norm and rotation, which may run in k's memory
            k = apply_rotary(self.k_norm(k), rope)
            if self.feeds_others:
                self.step_kv = (k, v)
        out = self.backend.forward(q, k, v, self.kv_cache, attn, self.scale).reshape(tokens, -1)
        return all_reduce(self.o_proj(out), self.shard)


class Gemma4DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, shard: Shard, index: int) -> None:
        super().__init__(config, backend, shard, index)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)
        width = config.per_layer_input_size
        self.per_layer_input_gate = Linear(config.hidden_size, width, False) if width else None
        self.per_layer_projection = Linear(width, config.hidden_size, False) if width else None
        self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if width else None
        self.per_layer_activation = gated_activation(config.hidden_act)
        # The mixture of experts beside the dense MLP (26B-A4B): routed from the residual stream normed without a
        # scale, the router's scales and the experts' input norm folded into their weights as they load
        # (Gemma4ForCausalLM.load_weights), each branch's output normed before the two are added.
        experts = config.moe is not None
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if experts else None
        self.moe = SparseMoE(config, shard) if experts else None
        self.moe_input_norm = UnscaledRMSNorm(config.hidden_size, config.rms_norm_eps) if experts else None
        self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm, copy.deepcopy(norm)

    def make_attention(
        self, config: ModelConfig, backend: AttentionBackend, shard: Shard, window: int | None, index: int
    ) -> SelfAttention:
        shares = config.kv_source_of(index) != index
        return Gemma4Attention(config, backend, shard, window, shares, config.full_k_eq_v and window is None)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        rope: RotaryRows,
        attn: AttentionMetadata,
        layer_input: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole residual stream as its first output (the second zeroed): the per-layer input and the layer's
        scalar come after the MLP's add."""
        hidden, residual = self.attend(hidden, residual, rope, attn)
        out = self.mlp(hidden)
        if self.moe is not None:
            routed = self.moe(self.moe_input_norm(residual))
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        stream = residual.add_(self.mlp_output_norm(out))
        if layer_input is not None:
            gated = self.per_layer_activation(self.per_layer_input_gate(stream), layer_input)
            stream = stream + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        out = stream * self.layer_scalar
        return out, residual.zero_()


class Gemma4Model(DecoderModel):
    LAYER = Gemma4DecoderLayer

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, shard: Shard, vocab_start: int
    ) -> None:
        super().__init__(config, backend, shard, vocab_start)
        for index, layer in enumerate(self.layers):
            source = config.kv_source_of(index)
            if source != index:
                layer.self_attn.source.append(self.layers[source].self_attn)
                self.layers[source].self_attn.feeds_others = True
        width, layers = config.per_layer_input_size, config.num_hidden_layers
        if width:
            self.embed_tokens_per_layer = Embedding(config.per_layer_vocab_size, layers * width)
            self.per_layer_model_projection = Linear(config.hidden_size, layers * width, False)
            self.per_layer_projection_norm = RMSNorm(width, config.rms_norm_eps)


class Gemma4ForCausalLM(CausalLM):
    MODEL = Gemma4Model
    WEIGHT_RENAMES = Gemma3ForCausalLM.WEIGHT_RENAMES

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        name = text_model_name(name, _NOT_TEXT)
        if name is None:
            return []
        # Google's E2B / E4B checkpoints (and files converted from them) hold K/V projections and norms for the
        # layers that share another's K/V too, which no layer reads (transformers skips them as well).
        match = _SHARED_KV_TENSOR.fullmatch(name)
        if match and config.kv_source_of(int(match[1])) != int(match[1]):
            return []
        return [(name, tensor)]

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        """Gemma 3's layout (its windows, RoPE bases, norms, scaled embeddings, soft-capping) with plain norm weights,
        attention unscaled and the last layer full, and Gemma 4's own pieces."""
        # "vision" only changes the mask over image tokens, which a text model never sees.
        if hf_config.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError("use_bidirectional_attention 'all' is not supported; only causal is")
        gemma3 = Gemma3ForCausalLM.read_layout(
            {k: v for k, v in hf_config.items() if k != "use_bidirectional_attention"}
        )
        types = [*gemma3.layer_types[:-1], FULL]  # as transformers forces the last layer
        layers = len(types)
        k_eq_v = bool(hf_config.get("attention_k_eq_v", False))
        full_head_dim, full_kv_heads = _full_layer_shape(hf_config, types, k_eq_v)
        shared = int(hf_config.get("num_kv_shared_layers") or 0)
        sources = _kv_sources(types, shared)
        width = int(hf_config.get("hidden_size_per_layer_input") or 0)
        table_rows = int(hf_config.get("vocab_size_per_layer_input") or 0) if width else 0
        if width and table_rows < int(hf_config["vocab_size"]):
            raise UnsupportedModelError(
                f"vocab_size_per_layer_input {table_rows} is below vocab_size ({hf_config['vocab_size']}): the tokens "
                "past it would have no per-layer input"
            )
        return dataclasses.replace(
            gemma3,
            layer_types=tuple(types),
            norm_weight_offset=0.0,
            attention_multiplier=1.0,
            full_head_dim=full_head_dim,
            full_kv_heads=full_kv_heads,
            full_k_eq_v=k_eq_v,
            value_norm=True,
            kv_source=sources if shared else None,
            wide_mlp_layers=tuple(range(layers - shared, layers))
            if hf_config.get("use_double_wide_mlp")
            else (),
            per_layer_input_size=width,
            per_layer_vocab_size=table_rows,
            moe=_experts(hf_config, layers) if hf_config.get("enable_moe_block") else None,
        )

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], offset_norms: bool = True
    ) -> None:
        super().load_weights(_folded_experts(named_tensors, self.config.hidden_size), offset_norms)

    def layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> list[tuple[torch.Tensor | None]]:
        """Each layer's slice of the per-layer inputs: (its projection of the scaled token embeddings, normed, plus
        its rows of the per-layer table, scaled) / sqrt(2), as transformers mixes them."""
        config, model = self.config, self.model
        width, layers = config.per_layer_input_size, config.num_hidden_layers
        if not width:
            return [(None,)] * layers
        tokens = hidden.shape[0]
        projected = model.per_layer_model_projection(hidden) * config.hidden_size**-0.5
        projected = model.per_layer_projection_norm(projected.view(tokens, layers, width))
        table = model.embed_tokens_per_layer(input_ids).view(tokens, layers, width) * width**0.5
        mixed = ((projected + table) * 2.0**-0.5).transpose(0, 1).contiguous()  # a layer's rows side by side
        return [(mixed[i],) for i in range(layers)]


def _full_layer_shape(
    hf_config: dict[str, Any], types: list[str], k_eq_v: bool
) -> tuple[int | None, int | None]:
    """The full layers' head size and KV heads: per_layer_config's (as transformers saves a config), else
    global_head_dim and, where keys give the values, num_global_key_value_heads."""
    per_layer = hf_config.get("per_layer_config")
    if per_layer is not None:  # empty where every layer has the model's shape
        by_index = {int(k): v for k, v in per_layer.items()}  # transformers zero-pads the keys ("05")
        shapes = {i: by_index.get(i) or {} for i in range(len(types))}
        full = {tuple(sorted(shapes[i].items())) for i, t in enumerate(types) if t == FULL}
        if len(full) > 1 or any(shapes[i] for i, t in enumerate(types) if t != FULL):
            raise UnsupportedModelError(
                "per_layer_config must give every full_attention layer the same shape and no other layer one"
            )
        shape = dict(next(iter(full), ()))
        unknown = set(shape) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedModelError(
                f"per_layer_config sets {sorted(unknown)}; only head_dim and num_key_value_heads"
            )
        return shape.get("head_dim"), shape.get("num_key_value_heads")
    kv_heads = hf_config.get("num_global_key_value_heads") if k_eq_v else None
    return int(hf_config.get("global_head_dim") or _GLOBAL_HEAD_DIM), None if kv_heads is None else int(
        kv_heads
    )


def _kv_sources(types: list[str], shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it attends: the last `shared` layers each the last earlier layer of their kind
    (transformers' kv_sharing_modes)."""
    first = len(types) - shared
    if not 0 <= shared < len(types):
        raise UnsupportedModelError(
            f"num_kv_shared_layers {shared} must be below num_hidden_layers ({len(types)})"
        )
    sources = list(range(len(types)))
    for i in range(first, len(types)):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise UnsupportedModelError(
                f"layer {i} shares the K/V of an earlier {types[i]} layer, and there is none before layer {first}"
            )
        sources[i] = earlier[-1]
    return tuple(sources)


def _experts(hf_config: dict[str, Any], layers: int) -> MoE:
    """The mixture beside every layer's dense MLP: softmax over the experts, the top k's weights rescaled to 1."""
    experts, top_k = hf_config.get("num_experts"), hf_config.get("top_k_experts")
    if not experts or not top_k or not hf_config.get("moe_intermediate_size"):
        raise UnsupportedModelError(
            "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
        )
    if not 0 < int(top_k) <= int(experts):
        raise UnsupportedModelError(f"top_k_experts {top_k} is not between 1 and num_experts ({experts})")
    return MoE(
        int(experts),
        int(top_k),
        int(hf_config["moe_intermediate_size"]),
        normalize_top_k=True,
        activation=hf_config.get("hidden_activation") or "gelu_pytorch_tanh",
        dense_layers=tuple(range(layers)),  # each layer's own MLP stays; the experts sit beside it
    )


# A layer's tensors of its mixture, which load folded into one another (_fold).
_EXPERT_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.(router\.proj\.weight|router\.scale|router\.per_expert_scale|experts\.gate_up_proj"
    r"|experts\.down_proj|pre_feedforward_layernorm_2\.weight)"
)
_EXPERT_PARTS = 6


def _folded_experts(
    named_tensors: Iterable[tuple[str, torch.Tensor]], hidden_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's mixture folded (_fold) once all of its parts have come."""
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        parts = pending.setdefault(int(match[1]), {})
        parts[match[2]] = tensor
        if len(parts) == _EXPERT_PARTS:
            yield from _fold(int(match[1]), pending.pop(int(match[1])), hidden_size)
    if pending:
        layer, parts = next(iter(pending.items()))
        raise WeightLoadError(f"checkpoint has only {sorted(parts)} of layer {layer}'s mixture of experts")


def _fold(layer: int, parts: dict[str, torch.Tensor], hidden_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' router projects norm(x) x scale / sqrt(hidden) and weighs expert e's output by its
    per_expert_scale; its experts take norm(x) x the pre_feedforward_layernorm_2 weight: in float32, the scales
    go into the router's columns, the norm weight into the experts' gate/up columns and each expert's scale into
    its down rows, so that router and experts both take norm(x) (one input: kvd.model.layers.moe's)."""
    prefix = f"model.layers.{layer}.moe"
    scale = parts["router.scale"].float() * hidden_size**-0.5
    yield f"{prefix}.gate.weight", parts["router.proj.weight"].float() * scale
    norm = parts["pre_feedforward_layernorm_2.weight"].float()
    per_expert = parts["router.per_expert_scale"].float()
    gate_up, down = parts["experts.gate_up_proj"], parts["experts.down_proj"]
    for e in range(gate_up.shape[0]):
        gate, up = (gate_up[e].float() * norm).chunk(2)  # transformers' fused rows: gate, then up
        yield f"{prefix}.experts.{e}.gate_proj.weight", gate
        yield f"{prefix}.experts.{e}.up_proj.weight", up
        yield f"{prefix}.experts.{e}.down_proj.weight", down[e].float() * per_expert[e]

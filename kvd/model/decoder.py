"""The decoder every family builds on (kvd.model.families): attention, MLP (dense, or a mixture of experts), the
layer stack and CausalLM, whose optional pieces (biases, q/k norm) the ModelConfig switches on, and Hugging Face
weight loading."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvd.distributed.comm import all_reduce, gather_vocab
from kvd.distributed.shard import WHOLE, Shard, ShardPlan
from kvd.kernels import cpu_native
from kvd.model.config import LINEAR, SLIDING, Layout, ModelConfig
from kvd.model.layers.activation import gated_activation
from kvd.model.layers.attention import AttentionBackend, AttentionMetadata, AttentionMetadataError
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend
from kvd.model.layers.gated_delta import GatedDeltaNet
from kvd.model.layers.kv_cache import kv_groups, pool_row
from kvd.model.layers.linear import Embedding, Linear
from kvd.model.layers.mlp import GatedMLP
from kvd.model.layers.moe import SparseMoE
from kvd.model.layers.norm import RMSNorm
from kvd.model.layers.recurrent_state import LayerState
from kvd.model.layers.rotary import RotaryEmbedding, RotaryRows, apply_rotary
from kvd.model.native_decode import NativeDecoder

# Hugging Face projection names that live stacked in one of our fused weights: (hf part, our part, shard).
_STACKED = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class WeightLoadError(ValueError):
    """Checkpoint tensors do not match the model: an unknown, missing or wrongly shaped weight."""


class KVCacheNotBoundError(RuntimeError):
    """forward ran before bind_kv_cache gave the layers their pool tensors."""


class SelfAttention(nn.Module):
    """With tensor parallelism: this rank's heads and KV heads (config is the rank's slice); o is
    row-parallel, so its partial sums are all-reduced. A sliding layer (`window`) attends over its last
    `window` tokens, given its KV group's metadata (CausalLM.kv_groups). With config.attention_output_gate the
    query projection holds, head by head, the query and then a gate whose sigmoid scales the head's output.
    `kv_parts`: the projections after the query's, keys' and values' (a family's layer may project fewer)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        shard: Shard,
        window: int | None,
        kv_parts: int = 2,
    ) -> None:
        super().__init__()
        self.shard = shard
        self.window = window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.backend = backend
        self.output_gate = config.attention_output_gate
        q_size = config.q_size * (2 if self.output_gate else 1)
        self.qkv_proj = Linear(
            config.hidden_size, [q_size] + [config.kv_size] * kv_parts, bias=config.attention_bias
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm_all_heads = config.qk_norm_all_heads
        q_width, k_width = (
            (config.q_size, config.kv_size) if self.qk_norm_all_heads else (config.head_dim,) * 2
        )
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps) if config.qk_norm else None
        sinks = torch.empty(config.num_attention_heads) if config.attention_sinks else None
        self.sinks = None if sinks is None else nn.Parameter(sinks, requires_grad=False)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: RotaryRows, attn: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise KVCacheNotBoundError("call model.bind_kv_cache(allocate_kv_cache(...)) before forward")
        tokens = x.shape[0]
        q, k, v = self.qkv_proj.forward_shards(x)
        gate = None
        if self.output_gate:
            heads = q.view(tokens, -1, 2 * self.head_dim)
            q, gate = (
                heads[..., : self.head_dim].contiguous(),
                heads[..., self.head_dim :].reshape(tokens, -1),
            )
        if self.q_norm is not None and self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(tokens, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # float32 whatever the model's dtype (the weights' values, as transformers holds them): every backend adds
        # them to float32 scores.
        sinks = None if self.sinks is None else self.sinks.float()
        out = self.backend.forward(q, k, v, self.kv_cache, attn, self.scale, sinks).reshape(tokens, -1)
        if gate is not None:  # the native layer loop's sigmoid where the kernels run
            out = cpu_native.sigmoid_mul(out, gate) if cpu_native.supports(out) else out * torch.sigmoid(gate)
        return all_reduce(self.o_proj(out), self.shard)


class MLP(GatedMLP):
    """The dense MLP; row-parallel down, so its partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__(
            config.hidden_size, config.intermediate_size, config.mlp_bias, gated_activation(config.hidden_act)
        )
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.shard)


class DecoderLayer(nn.Module):
    """input_layernorm before attention, post_attention_layernorm before the MLP (Hugging Face Llama's names;
    neither without config.input_norms), and with config.output_norms an RMSNorm on each sublayer's output
    (Gemma's sandwich, OLMo 2's post-norms). A linear-attention layer (LINEAR) has linear_attn in self_attn's
    place."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, shard: Shard, index: int) -> None:
        super().__init__()
        kind = config.layer_types[index]
        window = config.sliding_window if kind == SLIDING else None
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.input_norms else None
        self.input_layernorm, self.post_attention_layernorm = norm, copy.deepcopy(norm)
        layer_config = config.layer_config(index)
        self.self_attn = (
            None if kind == LINEAR else self.make_attention(layer_config, backend, shard, window, index)
        )
        self.linear_attn = GatedDeltaNet(config) if kind == LINEAR else None
        sparse = config.moe is not None and index not in config.moe.dense_layers
        self.mlp = SparseMoE(config, shard) if sparse else MLP(layer_config, shard)
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.output_norms else None
        self.attn_output_norm, self.mlp_output_norm = norm, copy.deepcopy(norm)
        self.residual_multiplier = config.residual_multiplier

    def make_attention(
        self, config: ModelConfig, backend: AttentionBackend, shard: Shard, window: int | None, index: int
    ) -> SelfAttention:
        """Layer `index`'s attention (`config` its shape: ModelConfig.layer_config); a family may give its own."""
        return SelfAttention(config, backend, shard, window)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        rope: RotaryRows,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it); the caller adds them (fused into the next norm)."""
        hidden, residual = self.attend(hidden, residual, rope, attn)
        return self._output(self.mlp(hidden), self.mlp_output_norm), residual

    def attend(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        rope: RotaryRows,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its MLP: (the MLP's normed input, the residual stream with the attention's output in)."""
        hidden, residual = _add_and_norm(hidden, residual, self.input_layernorm)
        mixed = (
            self.linear_attn(hidden, attn.recurrent)
            if self.self_attn is None
            else self.self_attn(hidden, rope, attn)
        )
        hidden = self._output(mixed, self.attn_output_norm)
        return _add_and_norm(hidden, residual, self.post_attention_layernorm)

    def _output(self, out: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """A sublayer's output as the residual stream takes it: normed (Gemma), scaled (Granite; rounded in the
        dtype, as transformers' residual + out * m rounds it)."""
        out = out if norm is None else norm(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


def _add_and_norm(
    hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sublayer's input, the residual stream with `hidden` added in place): normed, or the stream itself."""
    if norm is not None:
        return norm.add_and_norm(hidden, residual)
    residual.add_(hidden)
    return residual, residual


class DecoderModel(nn.Module):
    LAYER: type[DecoderLayer] = DecoderLayer  # a family's own layer subclasses it

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, shard: Shard, vocab_start: int
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, shard, vocab_start)
        self.layers = nn.ModuleList(
            self.LAYER(config, backend, shard, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], attn) -> hidden [T, H]; compute_logits on the rows to sample.

    With a sharded `shard` (tensor parallel), `config` is the whole model's and `self.config` this rank's
    slice (kvd.distributed.shard): its heads, KV heads, MLP columns and vocabulary rows.

    A family subclasses it (kvd.model.registry names the class for each architecture) and says in read_layout
    which optional pieces its config.json turns on, and in WEIGHT_RENAMES where its checkpoint names differ."""

    # (Hugging Face name part, ours): the first that a tensor name holds is replaced, before _STACKED's.
    WEIGHT_RENAMES: tuple[tuple[str, str], ...] = ()
    # The chat template for a checkpoint whose tokenizer has none (GGUF files often carry none).
    CHAT_TEMPLATE: str | None = None
    MODEL: type[DecoderModel] = DecoderModel  # a family's own layer stack subclasses it

    def __init__(
        self, config: ModelConfig, attention_backend: AttentionBackend | None = None, shard: Shard = WHOLE
    ) -> None:
        super().__init__()
        self.shard = shard
        self.vocab_size = config.vocab_size
        config = ShardPlan(config, shard).local_config()
        self.config = config
        self.kv_groups = kv_groups(config)  # which layers share a block table (kvd.model.layers.kv_cache)
        self.attention_backend = attention_backend or TorchAttentionBackend()
        self.model = self.MODEL(config, self.attention_backend, shard, shard.vocab_start(self.vocab_size))
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False)
        )
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.sliding_rotary = (  # the sliding layers' own RoPE base (Gemma 3); None: they share self.rotary
            None
            if config.sliding_rope_theta is None
            else RotaryEmbedding(
                config.sliding_rotary_dim, config.max_position_embeddings, config.sliding_rope_theta, None
            )
        )
        # A quantized copy of the output projection (kvd.model.layers.quantized_linear), set after loading.
        self.output_proj: nn.Module | None = None
        # The native layer loop for decode steps, bound on first use (None: not yet, False: not applicable).
        self._native_decoder: NativeDecoder | bool | None = None

    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        """The optional pieces this family's config.json (as a dict) turns on; by default none."""
        return Layout()

    @staticmethod
    def checkpoint_tensors(
        config: ModelConfig, name: str, tensor: torch.Tensor
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors in Hugging Face Llama's names that a checkpoint tensor holds (the loader cuts a tensor-parallel
        rank's slice from these): by default the tensor itself."""
        return [(name, tensor)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        group_attn = self._group_metadata(attn)
        # The residual stream starts at zero, so layer 0's fused add leaves it equal to the embeddings.
        residual = torch.zeros_like(hidden)
        decoder = self._decoder_for(hidden, attn)
        if decoder is not None:
            decoder.forward(hidden, residual, positions, attn)
        else:
            rows = {id(r): r.lookup(positions) for r in (self.rotary, self.sliding_rotary) if r is not None}
            layers = zip(
                self.model.layers,
                self.layer_rotaries(),
                self.kv_groups.layer_group,
                self.layer_inputs(input_ids, hidden),
                strict=True,
            )
            for layer, rotary, group, inputs in layers:
                hidden, residual = layer(hidden, residual, rows[id(rotary)], group_attn[group], *inputs)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, what its forward takes after the attention metadata (a family's own inputs): none here."""
        return [()] * len(self.model.layers)

    def layer_rotaries(self) -> list[RotaryEmbedding]:
        """Each layer's rotary table: the sliding layers' own where the model has one (Gemma 3)."""
        return [
            self.sliding_rotary
            if self.sliding_rotary is not None and layer.self_attn is not None and layer.self_attn.window
            else self.rotary
            for layer in self.model.layers
        ]

    def _group_metadata(self, attn: AttentionMetadata) -> tuple[AttentionMetadata, ...]:
        """The step's metadata for each KV group, checked against the model's groups."""
        groups = (attn, *attn.other_groups)
        if tuple(a.window for a in groups) != self.kv_groups.windows:
            raise AttentionMetadataError(
                f"this model's KV groups have the windows {self.kv_groups.windows}, the step's metadata "
                f"{tuple(a.window for a in groups)}: build it with "
                "build_attention_metadata(..., kv_groups=model.kv_groups)"
            )
        return groups

    def _decoder_for(self, hidden: torch.Tensor, attn: AttentionMetadata) -> NativeDecoder | None:
        """The native layer loop when it can run this step (kvd.model.native_decode), else None."""
        # The native loop runs every layer in one C call: no place for the all-reduces between them.
        if self.shard.sharded or self._native_decoder is False or not NativeDecoder.decodes(hidden, attn):
            return None
        if self._native_decoder is None or not self._native_decoder.valid_for(self):
            self._native_decoder = NativeDecoder(self) if NativeDecoder.applies(self) else False
        decoder = self._native_decoder
        return decoder if decoder and decoder.takes(hidden) else None

    def float_output(self) -> Embedding | Linear:
        """The float output projection: the embedding table of a tied model, else lm_head."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the N rows given (only the rows that will be sampled).

        Sharded: each rank projects onto its vocabulary rows and rank 0 gathers them (the others get their own
        slice back); every logit is one rank's whole dot product, so the values are TP=1's bits."""
        if self.output_proj is not None:
            local = self.output_proj(hidden)
        elif self.lm_head is None:
            local = self.model.embed_tokens.as_output(hidden)
        else:
            local = self.lm_head(hidden)
        logits = gather_vocab(local.float(), self.shard, self.vocab_size)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each layer that keeps K/V (KVGroups.pooled_layers) its pool tensor [2, num_blocks, block_size,
        kv_heads, head_dim]."""
        pooled = self.kv_groups.pooled_layers
        if len(kv_caches) != len(pooled):
            raise ValueError(f"got {len(kv_caches)} KV cache tensors for {len(pooled)} attention layers")
        layers = self.model.layers
        for index, cache in zip(pooled, kv_caches, strict=True):
            shape = self.config.layer_config(index)
            heads, row = shape.num_key_value_heads, pool_row(shape, cache.dtype)
            if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[-2:] != (heads, row):
                raise ValueError(
                    f"KV cache tensor of shape {tuple(cache.shape)} is not "
                    f"[2, num_blocks, block_size, {heads}, {row}]: use allocate_kv_cache"
                )
            layers[index].self_attn.kv_cache = cache
        for index, layer in enumerate(layers):  # a layer that shares another's K/V reads its pool
            source = self.config.kv_source_of(index)
            if source != index:
                layer.self_attn.kv_cache = layers[source].self_attn.kv_cache
        self._native_decoder = None

    def bind_recurrent_state(self, states: list[LayerState]) -> None:
        """Give each linear-attention layer its state slots (kvd.model.layers.recurrent_state.allocate_state)."""
        layers = [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]
        if len(states) != len(layers):
            raise ValueError(f"got {len(states)} recurrent states for {len(layers)} linear-attention layers")
        for layer, state in zip(layers, states, strict=True):
            layer.state = state
        self._native_decoder = None  # the native loop points at the states: bound anew

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], offset_norms: bool = True
    ) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters, casting to their dtype; norm weights
        with config.norm_weight_offset added unless `offset_norms` is False (a file that holds them so)."""
        params = dict(self.named_parameters())
        pending = {
            (name, shard)
            for name, p in params.items()
            for shard in range(len(getattr(p, "shard_sizes", [0])))
        }
        for hf_name, tensor in named_tensors:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy of the embeddings
            name, shard = _our_name(self.rename_weight(hf_name))
            param = params.get(name)
            if param is None:
                raise WeightLoadError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.config.model_type} model"
                )
            target = param.data
            if shard is not None and not hasattr(param, "shard_sizes"):  # a projection of one part (q alone)
                if shard:
                    raise WeightLoadError(
                        f"checkpoint tensor {hf_name!r} has no place in {self.config.model_type} model"
                    )
            elif shard is not None:
                sizes = param.shard_sizes
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if target.shape != tensor.shape:
                raise WeightLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            if offset_norms and self.config.norm_weight_offset and name.endswith("norm.weight"):
                tensor = tensor.float() + self.config.norm_weight_offset  # as the family's norm adds it
            target.copy_(tensor)
            pending.discard((name, shard or 0))
        if pending:
            missing = sorted(self.rename_weight(_hf_name(name, shard), back=True) for name, shard in pending)
            raise WeightLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")

    def rename_weight(self, name: str, back: bool = False) -> str:
        """A checkpoint tensor's name as ours (WEIGHT_RENAMES), or with `back` ours as the checkpoint's."""
        for theirs, ours in self.WEIGHT_RENAMES:
            old, new = (ours, theirs) if back else (theirs, ours)
            if old in name:
                return name.replace(old, new)
        return name


def text_model_name(name: str, not_text: tuple[str, ...]) -> str | None:
    """A multimodal checkpoint's tensor name as its text model's (model.language_model.X -> model.X), or None for
    the other towers' (`not_text`: their prefixes), which kvd does not run."""
    if name.startswith(not_text):
        return None
    return name.replace("model.language_model.", "model.", 1)


def _our_name(hf_name: str) -> tuple[str, int | None]:
    for hf_part, our_part, shard in _STACKED:
        if hf_part in hf_name:
            return hf_name.replace(hf_part, our_part), shard
    return hf_name, None


def _hf_name(name: str, shard: int) -> str:
    for hf_part, our_part, index in _STACKED:
        if our_part in name and index == shard:
            return name.replace(our_part, hf_part)
    return name

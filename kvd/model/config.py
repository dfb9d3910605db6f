"""ModelConfig: the decoder-family settings kvd needs, read from a Hugging Face config.json dict."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from kvd.model.registry import SUPPORTED_ARCHITECTURES, family_class

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "proportional", "yarn")
# The MLP's gate activation (config.json's hidden_act, or Gemma's hidden_activation) -> kvd.model.layers.activation.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# layer_types' values: attention over a window, over the whole context, or a linear-attention layer with a recurrent
# state instead of K/V (kvd.model.layers.gated_delta).
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
_DEFAULT_ROPE_THETA = 10000.0


class UnsupportedModelError(ValueError):
    """The config names an architecture or a feature this implementation does not cover."""


# How a router turns its logits into the top-k experts' weights (MoE.scoring).
SOFTMAX_THEN_TOPK = (
    "softmax_then_topk"  # probabilities over all experts, the k largest kept (Qwen3-MoE, Mixtral)
)
TOPK_THEN_SOFTMAX = "topk_then_softmax"  # the k largest logits, a softmax over them only (gpt-oss)
# The experts' gated activation: an MLP activation of SUPPORTED_ACTIVATIONS, or gpt-oss's clamped SwiGLU.
CLAMPED_SWIGLU = "clamped_swiglu"


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP (kvd.model.layers.moe): a router picks top_k of num_experts gated MLPs per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    scoring: str = SOFTMAX_THEN_TOPK
    normalize_top_k: bool = False  # the kept probabilities rescaled to sum to 1 (softmax_then_topk)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = (
        1.702  # CLAMPED_SWIGLU: gate * sigmoid(alpha * gate) * (up + 1), both clamped to limit
    )
    swiglu_limit: float = 7.0
    # Layers whose MLP stays dense (of the model's intermediate_size); every other layer is sparse.
    dense_layers: tuple[int, ...] = ()
    # The width of a shared expert every token runs beside its routed ones, its output scaled by sigmoid(a learned
    # gate) (Qwen2-MoE); 0: none.
    shared_expert_size: int = 0


# Router settings of other MoE families (DeepSeek's) that none of kvd's implements otherwise: refused by name.
_ROUTER_DEFAULTS = {"scoring_func": "softmax", "topk_method": "greedy"}


def _dense_width(d: dict[str, Any], layout: Layout) -> int:
    """The dense MLP's width: a model whose every layer is a mixture may not give one (Qwen3.5-MoE), and then
    none is built of it (its experts' width stands in)."""
    if d.get("intermediate_size"):
        return int(d["intermediate_size"])
    if layout.moe is not None and not layout.moe.dense_layers:
        return layout.moe.intermediate_size
    raise UnsupportedModelError("config.json lacks intermediate_size")


def read_moe(hf_config: dict[str, Any], intermediate_key: str, **variant: Any) -> MoE:
    """The MoE of a config.json: its expert count (num_experts or num_local_experts), top k, the experts' width
    (`intermediate_key`), and the family's router and expert `variant` (MoE's other fields)."""
    for key, value in _ROUTER_DEFAULTS.items():
        if hf_config.get(key, value) != value:
            raise UnsupportedModelError(f"{key} {hf_config[key]!r} is not supported; only {value!r} is")
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not experts or not hf_config.get("num_experts_per_tok"):
        raise UnsupportedModelError(
            "config.json lacks num_experts (or num_local_experts) or num_experts_per_tok"
        )
    top_k = int(hf_config["num_experts_per_tok"])
    if not 0 < top_k <= int(experts):
        raise UnsupportedModelError(
            f"num_experts_per_tok {top_k} is not between 1 and num_experts ({experts})"
        )
    return MoE(int(experts), top_k, int(hf_config[intermediate_key]), **variant)


@dataclass(frozen=True)
class LinearAttention:
    """The shape of a model's Gated DeltaNet layers (the layers layer_types marks LINEAR; Qwen3.5, Qwen3-Next): value
    heads share key heads, as grouped-query attention shares K/V heads: value head h reads key head h // (value
    heads per key head), or with tiled_value_heads (llama.cpp's files reorder them so) key head h % key heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the causal convolution's width over q, k and v before the recurrence
    tiled_value_heads: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution runs over: q's, k's and v's."""
        return 2 * self.key_dim + self.value_dim

    def fused_rows(self, parts: tuple[int, ...], part: int) -> list[int]:
        """The rows of part `part` of a projection fused per key head (Qwen3-Next's: each key head's `parts` rows in
        turn, e.g. its betas then its decay inputs), key head by key head."""
        size, start = sum(parts), sum(parts[:part])
        return [h * size + start + r for h in range(self.num_key_heads) for r in range(parts[part])]

    @property
    def qkvz_parts(self) -> tuple[int, ...]:
        """A key head's rows of Qwen3-Next's fused q/k/v/z projection: its query, its key, then the values and the
        output gates of the value heads that read it."""
        per_key = self.num_value_heads // self.num_key_heads * self.value_head_dim
        return (self.key_head_dim, self.key_head_dim, per_key, per_key)

    @property
    def ba_parts(self) -> tuple[int, ...]:
        """A key head's rows of Qwen3-Next's fused beta/decay projection: one each per value head that reads it."""
        per_key = self.num_value_heads // self.num_key_heads
        return (per_key, per_key)


@dataclass(frozen=True)
class Layout:
    """The optional pieces of the shared decoder that one family's config turns on (kvd.model.families)."""

    attention_bias: bool = False  # bias on the q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    qk_norm_all_heads: bool = False  # with qk_norm: over all of q's heads and all of k's at once (OLMo 2)
    attention_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    input_norms: bool = True  # an RMSNorm before attention and before the MLP (OLMo 2 norms outputs only)
    sliding_window: int | None = None  # the attention window of the layers layer_types marks SLIDING
    # Each layer's attention, SLIDING or FULL; None: every layer slides when there is a window.
    layer_types: tuple[str, ...] | None = None
    sliding_rope_theta: float | None = None  # sliding layers' own RoPE base (Gemma 3), without scaling
    # Gemma: RMSNorm scales by (1 + weight), so this is added to every norm weight as it loads; an RMSNorm on
    # each attention and MLP output before its residual add; the logits soft-capped (tanh(x / cap) x cap).
    norm_weight_offset: float = 0.0
    output_norms: bool = False
    final_logit_softcapping: float | None = None
    # Granite's multipliers: of the token embeddings, of each attention and MLP output before the residual add,
    # the attention scores' scale (None: 1 / sqrt(head_dim)), and the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    moe: MoE | None = None  # None: every MLP is dense
    # The query projection's second half gates the attention output by its sigmoid, head by head (Qwen3.5).
    attention_output_gate: bool = False
    linear_attention: LinearAttention | None = None  # the LINEAR layers' shape, where layer_types has any
    # Gemma 4: the FULL layers' own head size and KV heads (None: the model's), their keys' projection also giving
    # the values (full_k_eq_v), every value normed (RMSNorm without a scale) and attention unscaled (q/k norms).
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    full_k_eq_v: bool = False
    value_norm: bool = False
    # Per layer, the layer whose K/V it attends (KV shared across layers: Gemma 4's last layers compute none);
    # None: each its own.
    kv_source: tuple[int, ...] | None = None
    wide_mlp_layers: tuple[int, ...] = ()  # layers whose MLP is twice intermediate_size wide (Gemma 4)
    # Gemma 4's per-layer inputs: a width per layer of a second embedding table (of per_layer_vocab_size rows),
    # mixed with a projection of the token embeddings, that each layer adds through a gate after its MLP.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # the leading values of each head that RoPE rotates: head_dim, or less (partial rotary)
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else the scaling parameters with a "rope_type" key (SUPPORTED_ROPE_TYPES).
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    qk_norm_all_heads: bool = False  # this and the next two: see Layout
    input_norms: bool = True
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    sliding_window: int | None = None  # this and the next six: see Layout
    layer_types: tuple[str, ...] = ()  # one per layer
    sliding_rope_theta: float | None = None
    norm_weight_offset: float = 0.0
    output_norms: bool = False
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    torch_dtype: str | None = None  # the checkpoint's dtype name ("bfloat16", ...), if the config says
    embedding_multiplier: float = 1.0  # these four: see Layout
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    moe: MoE | None = None  # see Layout
    attention_output_gate: bool = False  # this and the next: see Layout
    linear_attention: LinearAttention | None = None
    full_head_dim: int | None = None  # this and the next seven: see Layout
    full_kv_heads: int | None = None
    full_k_eq_v: bool = False
    value_norm: bool = False
    kv_source: tuple[int, ...] = ()  # empty: each layer its own
    wide_mlp_layers: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def attention_window(self) -> int | None:
        """The window of the sliding-window layers; None when every layer attends over the whole context."""
        return self.sliding_window if SLIDING in self.layer_types else None

    @property
    def has_recurrent_state(self) -> bool:
        """Some layers keep a recurrent state per sequence beside (or instead of) K/V (LINEAR layers)."""
        return LINEAR in self.layer_types

    @property
    def max_head_dim(self) -> int:
        """The widest attention head of any layer."""
        return max(self.head_dim, self.full_head_dim or 0)

    @property
    def sliding_rotary_dim(self) -> int:
        """The sliding layers' rotary width: rotary_dim, or their own head size where FULL layers have another."""
        return self.rotary_dim if self.full_head_dim in (None, self.head_dim) else self.head_dim

    def layer_config(self, index: int) -> ModelConfig:
        """Layer `index`'s shape: the model's, with a FULL layer's own head size and KV heads and a wide MLP's
        width where the model has them (Gemma 4)."""
        changes: dict[str, Any] = {}
        if self.layer_types[index] == FULL:
            if self.full_head_dim is not None:
                changes["head_dim"] = self.full_head_dim
            if self.full_kv_heads is not None:
                changes["num_key_value_heads"] = self.full_kv_heads
        if index in self.wide_mlp_layers:
            changes["intermediate_size"] = 2 * self.intermediate_size
        return dataclasses.replace(self, **changes) if changes else self

    def kv_source_of(self, index: int) -> int:
        """The layer whose K/V layer `index` attends: itself, unless it shares an earlier layer's."""
        return self.kv_source[index] if self.kv_source else index

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def cap_max_model_len(self, requested: int | None) -> int:
        """The context length to serve: `requested` (None: the model's), at most max_position_embeddings.

        Positions past it have no rotary angle (the table, scaled RoPE included, covers exactly that many;
        a longer context would index past it, which on CUDA is a device assert that kills every request).
        """
        if requested is None or requested <= self.max_position_embeddings:
            return requested or self.max_position_embeddings
        logger.warning(
            "max_model_len %d is more than the %d positions this model has (max_position_embeddings); serving %d",
            requested,
            self.max_position_embeddings,
            self.max_position_embeddings,
        )
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a config.json dict (transformers 4 or 5 layout); UnsupportedModelError if not covered."""
        d = _text_part(d)
        model_type = _model_type(d)
        missing = [k for k in ("num_attention_heads", "hidden_size", "num_hidden_layers") if k not in d]
        if missing:
            raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")
        activation_key = "hidden_activation" if "hidden_activation" in d else "hidden_act"
        activation = d.get(activation_key) or "silu"
        if activation not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"{activation_key} {activation!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        for key in ("attn_logit_softcapping",):  # Gemma 2's; no family here uses it
            if d.get(key) is not None:
                raise UnsupportedModelError(f"{key} {d[key]} is not supported; only null is")
        num_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        if num_heads % int(d.get("num_key_value_heads") or num_heads):
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        rope_theta, rope_scaling, partial_rotary = _rope(d)
        # The family reads its own keys (importing its module, and torch, on first use).
        layout = family_class(model_type).read_layout(d)
        num_layers = int(d["num_hidden_layers"])
        layer_types = _layer_types(layout, num_layers)
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        full_head_dim = layout.full_head_dim or head_dim
        rotary_dim = int(full_head_dim * partial_rotary)  # as transformers rounds it
        if rotary_dim % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial_rotary} rotates {rotary_dim} of {head_dim} values a head; "
                "RoPE needs an even number"
            )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=_dense_width(d, layout),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=layout.attention_bias,
            o_proj_bias=layout.o_proj_bias,
            mlp_bias=layout.mlp_bias,
            qk_norm=layout.qk_norm,
            qk_norm_all_heads=layout.qk_norm_all_heads,
            attention_sinks=layout.attention_sinks,
            input_norms=layout.input_norms,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
            architectures=tuple(d.get("architectures") or ()),
            sliding_window=layout.sliding_window,
            layer_types=layer_types,
            sliding_rope_theta=layout.sliding_rope_theta,
            norm_weight_offset=layout.norm_weight_offset,
            output_norms=layout.output_norms,
            final_logit_softcapping=layout.final_logit_softcapping,
            hidden_act=activation,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            embedding_multiplier=layout.embedding_multiplier,
            residual_multiplier=layout.residual_multiplier,
            attention_multiplier=layout.attention_multiplier,
            logits_scaling=layout.logits_scaling,
            moe=layout.moe,
            attention_output_gate=layout.attention_output_gate,
            linear_attention=layout.linear_attention,
            full_head_dim=layout.full_head_dim,
            full_kv_heads=layout.full_kv_heads,
            full_k_eq_v=layout.full_k_eq_v,
            value_norm=layout.value_norm,
            kv_source=layout.kv_source or (),
            wide_mlp_layers=layout.wide_mlp_layers,
            per_layer_input_size=layout.per_layer_input_size,
            per_layer_vocab_size=layout.per_layer_vocab_size,
        )


def _layer_types(layout: Layout, num_layers: int) -> tuple[str, ...]:
    """Each layer's kind; without a window, the layers a config marks SLIDING attend over everything."""
    if layout.layer_types is None:
        return (FULL if layout.sliding_window is None else SLIDING,) * num_layers
    kinds = {SLIDING, FULL} | ({LINEAR} if layout.linear_attention is not None else set())
    types = tuple(layout.layer_types)
    if len(types) != num_layers or not set(types) <= kinds:
        raise UnsupportedModelError(
            f"layer_types must name {num_layers} layers, each one of {sorted(kinds)}; got {list(types)}"
        )
    return tuple(FULL if t == SLIDING and layout.sliding_window is None else t for t in types)


def _text_part(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language model (Qwen3.5's released ForConditionalGeneration checkpoints): its
    text_config under the checkpoint's architecture; kvd serves the text model alone."""
    if not isinstance(d.get("text_config"), dict):
        return d
    text = dict(d["text_config"])
    for key in ("architectures", "tie_word_embeddings"):
        if key in d:
            text[key] = d[key]
    return text


def _model_type(d: dict[str, Any]) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    architectures = d.get("architectures") or []
    if architectures:
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {arch!r} is not supported; supported: {supported}")
        return SUPPORTED_ARCHITECTURES[arch]
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise UnsupportedModelError(
            f"model_type {model_type!r} (no architectures in config) is not supported; supported: {supported}"
        )
    return model_type


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, the share of each head rotated) from transformers 5's rope_parameters or the older
    rope_theta + rope_scaling."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if FULL in params:  # one set per layer type (Gemma 3): the full layers' here, the sliding ones' in Layout
        params = dict(params[FULL] or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or _DEFAULT_ROPE_THETA)
    legacy_type = params.pop("type", None)  # transformers 4 wrote "type" before "rope_type"
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
    if not 0.0 < partial <= 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported; it must be in (0, 1]")
    if rope_type == "proportional":  # every value of a head rotates, the share past `partial` by angle 0
        return theta, {"rope_type": rope_type, "partial_rotary_factor": partial, **params}, 1.0
    if rope_type == "default":
        return theta, None, partial
    if rope_type in ("llama3", "longrope", "yarn"):
        # transformers falls back to the config's own keys when the parameters do not give them.
        original = d.get("original_max_position_embeddings") or d.get("max_position_embeddings", 2048)
        params.setdefault("original_max_position_embeddings", original)
    if rope_type in ("longrope", "yarn"):
        params["max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    return theta, {"rope_type": rope_type, **params}, partial

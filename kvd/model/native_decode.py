"""Decode steps through all decoder layers in one native call (CPU, float32 or bfloat16).

Between kernels, a Python layer loop costs more than the kernels of a small model at batch 1: each layer makes
a dozen calls, and the weights streamed through the caches evict the interpreter's own data between them. When
every piece of the model has a native kernel, a step whose tokens all decode (one new token per sequence) runs
the layer loop in C instead: the same kernels in the same order as the Python loop, so the results are equal.
A layer may be attention (gated or not) or a Gated DeltaNet (Qwen3.5's linear attention: kvd_layer.recurrent,
with the step's recurrent rows).
Quantized linears take any batch; float32 ones up to linear.NATIVE_MAX_ROWS (beyond, torch's matmul is faster)
unless batch invariance keeps them native; bfloat16 ones only with batch invariance (else torch multiplies them).
"""

from __future__ import annotations

import torch

from kvd.kernels import cpu_native
from kvd.model.layers.attention import AttentionMetadata
from kvd.model.layers.attention.native_attention import NativeAttentionBackend, NativeDecodePlan
from kvd.model.layers.gated_delta import GatedDeltaNet
from kvd.model.layers.linear import NATIVE_MAX_ROWS, Linear
from kvd.model.layers.moe import SparseMoE
from kvd.model.layers.native_weights import native_linear, native_parts


def _mixer_linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """A layer's attention linears, or its Gated DeltaNet's."""
    if layer.self_attn is not None:
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj
    g = layer.linear_attn
    return g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a, g.out_proj


def _linears(layers: torch.nn.ModuleList) -> list[torch.nn.Module]:
    """Every layer's attention (or Gated DeltaNet) and dense MLP linears (a mixture of experts answers for its own:
    SparseMoE.native)."""
    return [
        m
        for layer in layers
        for m in (
            *_mixer_linears(layer),
            *(() if isinstance(layer.mlp, SparseMoE) else (layer.mlp.gate_up_proj, layer.mlp.down_proj)),
        )
    ]


def _attention(layers: torch.nn.ModuleList) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in layers if layer.self_attn is not None]


def _deltas(layers: torch.nn.ModuleList) -> list[GatedDeltaNet]:
    return [layer.linear_attn for layer in layers if layer.linear_attn is not None]


_NO_WEIGHT = cpu_native.LinearWeight(qs=0, d=0, mn=0, qh=0, bias=0, n=0, k=0, bits=0, tiles=0, ggml=0)


def _mixtures(layers: torch.nn.ModuleList) -> list[SparseMoE]:
    return [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]


def _norm(module: torch.nn.Module | None) -> int:
    return 0 if module is None else module.weight.data_ptr()


class NativeDecoder:
    """The decoder layers of one model, bound to its KV pool, as the native layer loop sees them."""

    def __init__(self, model: torch.nn.Module) -> None:
        config, layers = model.config, model.model.layers
        cache, dtype = _attention(layers)[0].kv_cache, model.rotary.cos_sin_cache.dtype
        self.shape = cpu_native.ModelShape(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary_dim=config.rotary_dim,
            intermediate=config.intermediate_size,
            num_blocks=cache.shape[1],
            block_size=cache.shape[2],
            num_positions=model.rotary.cos_sin_cache.shape[0],
            eps=config.rms_norm_eps,
            scale=config.attention_scale,
            bf16=int(dtype == torch.bfloat16),
            kv8=int(cache.dtype == torch.int8),
            output_gate=int(config.attention_output_gate),
        )
        self._moes = [
            m.native() for m in _mixtures(layers)
        ]  # their structs, which the loop reads, kept alive
        # The sinks as the loop reads them: float32 (a bf16 model holds them in bf16, as transformers does).
        self._sinks = [
            None if attn is None or attn.sinks is None else attn.sinks.float()
            for attn in (layer.self_attn for layer in layers)
        ]
        # The Gated DeltaNet layers' structs and the float32 copies they point at, kept alive here.
        self._deltas = [
            None if layer.linear_attn is None else _DeltaStruct(layer.linear_attn) for layer in layers
        ]
        self.layers = tuple(
            cpu_native.LayerWeights(
                input_norm=_norm(layer.input_layernorm),
                post_attention_norm=_norm(layer.post_attention_layernorm),
                q_norm=_norm(attn and attn.q_norm),
                k_norm=_norm(attn and attn.k_norm),
                attn_output_norm=_norm(layer.attn_output_norm),
                mlp_output_norm=_norm(layer.mlp_output_norm),
                cos_sin=rotary.cos_sin_cache.data_ptr(),
                qkv=native_parts(attn.qkv_proj) if attn else (_NO_WEIGHT,),
                o=attn.o_proj.native_weight() if attn else _NO_WEIGHT,
                gate_up=(_NO_WEIGHT,) if moe else native_parts(layer.mlp.gate_up_proj),
                down=_NO_WEIGHT if moe else layer.mlp.down_proj.native_weight(),
                kv_cache=attn.kv_cache.data_ptr() if attn else 0,
                window=(attn and attn.window) or 0,
                sinks=cpu_native.address(sinks),
                gelu=int(config.hidden_act == "gelu_pytorch_tanh"),
                kv_group=group,
                moe=layer.mlp.native().address if moe else 0,
                recurrent=delta.address if delta else 0,
            )
            for layer, rotary, group, sinks, delta in zip(
                layers,
                model.layer_rotaries(),
                model.kv_groups.layer_group,
                self._sinks,
                self._deltas,
                strict=True,
            )
            for moe, attn in ((isinstance(layer.mlp, SparseMoE), layer.self_attn),)
        )
        self.key = self._key(model)
        # Float32 linears leave large steps to torch's matmul, unless batch invariance keeps them native.
        float_linears = [m for m in _linears(layers) if isinstance(m, Linear)]
        self.max_rows = NATIVE_MAX_ROWS if float_linears and not float_linears[0].batch_invariant else None

    @staticmethod
    def _key(model: torch.nn.Module) -> tuple[int, ...]:
        """The first layer's projection and where its weight and pool lie: a model whose modules were replaced
        or whose buffers moved is bound anew."""
        layers = model.model.layers
        attn = _attention(layers)[0]
        # A Gated DeltaNet's first projection, like the attention's: replaced or moved, the loop is bound anew.
        firsts = [attn.qkv_proj, *(g.in_proj_qkv for g in _deltas(layers)[:1])]
        # A mixture of experts rebuilt (its weights replaced or moved) has a new native struct: bound anew.
        moes = tuple(getattr(m.native(), "address", 0) for m in _mixtures(layers))
        states = tuple(g.state.state.data_ptr() for g in _deltas(layers) if g.state is not None)
        return (
            *(id(m) for m in firsts),
            *(native_parts(m)[0].qs if hasattr(m, "native_weight") else 0 for m in firsts),
            attn.kv_cache.data_ptr(),
            *moes,
            *states,
        )

    @staticmethod
    def applies(model: torch.nn.Module) -> bool:
        """Whether every piece of the model's decode step has a native kernel here, in one dtype."""
        layers = model.model.layers
        if not isinstance(model.attention_backend, NativeAttentionBackend) or not cpu_native.available():
            return False
        config = model.config
        if config.per_layer_input_size or config.kv_source or config.value_norm:
            return False  # the loop has no per-layer input, shared K/V nor value norm
        cache, dtype = _attention(layers)[0].kv_cache, model.rotary.cos_sin_cache.dtype
        if (
            cache is None
            or dtype not in (torch.float32, torch.bfloat16)
            or cache.dtype not in (dtype, torch.int8)
        ):
            return False
        caches = [attn.kv_cache for attn in _attention(layers)]
        norms = [
            n
            for layer in layers
            for n in (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.self_attn and layer.self_attn.q_norm,
                layer.attn_output_norm,
            )
            if n is not None
        ]
        if not all(_delta_native(g, dtype) for g in _deltas(layers)):
            return False
        tables = [rotary.cos_sin_cache for rotary in model.layer_rotaries()]
        return (
            model.config.residual_multiplier == 1.0  # the C loop adds sublayer outputs as they are
            and model.config.input_norms  # ... norms each sublayer's input ...
            and not model.config.qk_norm_all_heads  # ... and q and k per head
            and model.config.hidden_act in ("silu", "gelu_pytorch_tanh")
            and all(t.dtype == dtype and t.shape == tables[0].shape and t.is_contiguous() for t in tables)
            and all(native_linear(m, dtype) for m in _linears(layers))
            and all(m.native() is not None for m in _mixtures(layers))
            and all(n.weight.dtype == dtype for n in norms)
            and all(c.dtype == cache.dtype and c.is_contiguous() for c in caches)
        )

    def valid_for(self, model: torch.nn.Module) -> bool:
        return self.key == self._key(model)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether this bound loop runs a step of hidden.shape[0] tokens (see max_rows)."""
        return self.max_rows is None or hidden.shape[0] <= self.max_rows

    @staticmethod
    def decodes(hidden: torch.Tensor, attn: AttentionMetadata) -> bool:
        """A step in which every sequence decodes one token, in batch order."""
        decode = getattr(attn, "decode", None)
        return isinstance(decode, NativeDecodePlan) and attn.prefill is None and decode.rows is None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
    ) -> None:
        """Run every layer in place on hidden and residual [S, hidden_size] (contiguous, the model's dtype)."""
        groups = [(a.slot_mapping, a.decode.block_tables) for a in (attn, *attn.other_groups)]
        step = attn.recurrent
        cpu_native.decode_layers(
            self.shape,
            self.layers,
            hidden,
            residual,
            positions.contiguous(),
            groups,
            attn.decode.context_lens,
            None if step is None else (step.starts_t, *step.kernel_args),
        )


def _delta_native(g: GatedDeltaNet, dtype: torch.dtype) -> bool:
    """Whether the loop can run this Gated DeltaNet: its slots bound on the CPU in the shapes kvd_gated_delta
    writes (the loop reads only their addresses), its norm in the model's dtype."""
    shape, s = g.shape, g.state
    return (
        s is not None
        and s.state.device.type == "cpu"
        and s.state.dtype == torch.float32
        and s.conv.dtype == dtype
        and s.state.is_contiguous()
        and s.conv.is_contiguous()
        and s.conv.shape == (s.state.shape[0], shape.conv_kernel - 1, shape.conv_dim)
        and s.state.shape[1:] == (shape.num_value_heads, shape.key_head_dim, shape.value_head_dim)
        and g.out_norm.scale.dtype == dtype
    )


class _DeltaStruct:
    """A Gated DeltaNet layer as the native loop reads it (kvd_recurrent), with the float32 filters and decay
    parameters its Python forward makes each step, made once here."""

    def __init__(self, g: GatedDeltaNet) -> None:
        shape, state = g.shape, g.state
        self.floats = (
            g.conv1d.weight.view(shape.conv_dim, shape.conv_kernel).float().contiguous(),
            g.A_log.float().contiguous(),
            g.dt_bias.float().contiguous(),
        )
        self.struct, self.address = cpu_native.recurrent_struct(
            cpu_native.RecurrentWeights(
                qkv=native_parts(g.in_proj_qkv),
                z=native_parts(g.in_proj_z),
                b=native_parts(g.in_proj_b),
                a=native_parts(g.in_proj_a),
                out=g.out_proj.native_weight(),
                conv_weight=self.floats[0].data_ptr(),
                A_log=self.floats[1].data_ptr(),
                dt_bias=self.floats[2].data_ptr(),
                norm=g.out_norm.scale.data_ptr(),
                conv_state=state.conv.data_ptr(),
                state=state.state.data_ptr(),
                num_slots=state.state.shape[0],
                key_heads=shape.num_key_heads,
                value_heads=shape.num_value_heads,
                key_dim=shape.key_head_dim,
                value_dim=shape.value_head_dim,
                conv_kernel=shape.conv_kernel,
                tiled=int(shape.tiled_value_heads),
            )
        )

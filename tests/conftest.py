"""Shared fixtures. Sections: model (tiny random Hugging Face checkpoints and a paged-pool driver)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# ---------------------------------------------------------------------------------------------------------------
# Model: tiny random checkpoints of each supported family, saved offline with transformers, and PagedRunner, which
# drives a kvd CausalLM over a paged KV pool the way the engine does (flat varlen batches, block tables).
# ---------------------------------------------------------------------------------------------------------------

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    # Larger than the 0.02 default so that logits are peaked enough for bf16 greedy comparisons to mean something.
    initializer_range=0.1,
)


def phi3_longrope(trained: int, rotated: float, head_dim: int = 16) -> dict:
    """A tiny Phi-3's LongRoPE settings: trained on `trained` positions, rotating that share of each head (and a
    padding id inside the tiny vocabulary)."""
    pairs = int(head_dim * rotated) // 2
    return {
        "partial_rotary_factor": rotated,
        "original_max_position_embeddings": trained,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + i / 8 for i in range(pairs)],
            "long_factor": [2.0 + i for i in range(pairs)],
        },
        "pad_token_id": 0,
    }


_PHI3_TOKENS = {"eos_token_id": 1, "bos_token_id": 2}  # inside the tiny vocabulary, as pad is

# The hybrid families' shape (kvd.model.layers.gated_delta), and their mixtures' experts.
_HYBRID = {
    "num_hidden_layers": 4,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
}
_HYBRID_EXPERTS = {"num_experts": 8, "moe_intermediate_size": 32}

# family name -> (transformers config class name, extra config kwargs). Each exercises one config switch.
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),  # GQA, untied embeddings
    "llama3_rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "linear_rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # YaRN with its defaults (betas 32 and 1, the correction range rounded); gpt_oss below has it unrounded.
    "yarn_rope": (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    # head_dim 32 != hidden_size / heads (16), as in Mistral-Nemo and Qwen3: q/o projections are not square.
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 32}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),  # q/k/v bias, tied embeddings
    # Layer 0 full, layer 1 sliding over 8 tokens: a window in a model the native layer loop runs.
    "qwen2_window": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # q/k RMSNorm
    # Granite's multipliers, each away from 1 so that a missing one shows.
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 3.0,
        },
    ),
    "olmo2": ("Olmo2Config", {}),  # output norms only, q/k norms over all heads
    # Fused qkv and gate_up; LongRoPE's short factors (the table is no longer than the trained length); half of
    # each head rotated, as Phi-4-mini rotates three quarters.
    "phi3": ("Phi3Config", phi3_longrope(trained=256, rotated=0.5) | _PHI3_TOKENS),
    # LongRoPE's long factors and attention factor: a table past the trained 16 positions (the prompts are
    # longer, so that transformers takes the long factors too).
    "phi3_long": ("Phi3Config", phi3_longrope(trained=16, rotated=1.0) | _PHI3_TOKENS),
    # A sliding layer (window 8: the parity prompts are longer) before a full one, each with its own RoPE base;
    # the attention scale off 1 / sqrt(head_dim) and the logits soft-capped, so that each shows.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 20,
            "final_logit_softcapping": 5.0,
        },
    ),
    # Gemma 4 (E2B's shape in small): sliding layers of head size 16 and full ones of 32 (proportional RoPE on a
    # quarter), the last two layers attending layers 2 and 3's K/V with MLPs twice as wide, per-layer inputs of 8
    # values a layer, soft-capped logits.
    "gemma4": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "global_head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 256,
            "final_logit_softcapping": 5.0,
        },
    ),
    # Gemma 4 (31B's shape in small): full layers whose keys give their values, with one KV head of 32 values
    # against the sliding layers' two of 16; no per-layer inputs nor shared K/V.
    "gemma4_k_eq_v": (
        "Gemma4TextConfig",
        {
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
        },
    ),
    # Gemma 4 (26B-A4B's shape in small): 8 experts, 2 a token, beside each layer's dense MLP.
    "gemma4_moe": (
        "Gemma4TextConfig",
        {
            "head_dim": 16,
            "global_head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    # Qwen3.5: three Gated DeltaNet layers (value heads two to a key head, a convolution of 4) and a full-attention
    # layer with a gated output and a quarter of each head rotated.
    "qwen3_5": ("Qwen3_5TextConfig", _HYBRID),
    # Qwen3-Next: Qwen3.5's layers (input projections fused per key head in its checkpoints) with a shared expert
    # beside 8 routed ones (2 a token, rescaled) on every layer.
    "qwen3_next": (
        "Qwen3NextConfig",
        _HYBRID | {"num_experts_per_tok": 2, "shared_expert_intermediate_size": 48, **_HYBRID_EXPERTS},
    ),
    # Qwen3.5-MoE: Qwen3.5's layers, every MLP a mixture (8 experts, 3 a token, always rescaled) with a shared expert.
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        _HYBRID | {"num_experts_per_tok": 3, "shared_expert_intermediate_size": 64, **_HYBRID_EXPERTS},
    ),
    # Mixtures of experts: 8 experts, 2 a token (the router's weights drawn wide, see save_tiny_checkpoint).
    # Qwen3-MoE: layer 0 dense (mlp_only_layers), the top 2 not renormalized, experts narrower than the dense MLP.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64}),
    # Qwen2-MoE: a shared expert beside 8 routed ones (4 a token, rescaled), every other layer sparse.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
        },
    ),
    # gpt-oss: a sliding layer (window 8) before a full one, sinks, YaRN RoPE, the router's bias, the experts'
    # biases and clamped SwiGLU (a limit low enough to clamp).
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "swiglu_limit": 1.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
        },
    ),
}


def save_tiny_checkpoint(
    family: str, folder: Path, seed: int = 0, tokenizer: object = None, **settings: object
) -> Path:
    """Save a random float32 model of `family` (see TINY_FAMILIES) with config `settings` over its own, and a tiny
    tokenizer (or `tokenizer`, the vocabulary then as large as it is); returns the folder."""
    import transformers
    from tiny_models import byte_level_tokenizer

    class_name, extra = TINY_FAMILIES[family]
    vocab = {} if tokenizer is None else {"vocab_size": len(tokenizer)}
    if tokenizer is not None and "vocab_size_per_layer_input" in extra:
        vocab["vocab_size_per_layer_input"] = len(tokenizer)
    config = getattr(transformers, class_name)(**(_TINY | extra | vocab | settings))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # transformers initializes norms to 1 and biases to 0, which would leave qk-norm and qkv-bias untested.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith(
                (
                    "mlp.gate.weight",
                    "mlp.router.weight",
                    "block_sparse_moe.gate.weight",
                    "expert_gate.weight",
                    "router.proj.weight",
                )
            ):
                param.normal_(0.0, 1.0)  # routers: distinct experts for distinct tokens, not a near tie
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's, 1 as initialized
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias") or name == "sinks" or name.endswith(".sinks"):
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, 1 as initialized
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    # load_model wants one; most tests feed token ids
    (byte_level_tokenizer() if tokenizer is None else tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_checkpoint(family) -> folder with config.json + model.safetensors (built once per session)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = save_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny_{family}"))
        return made[family]

    return get


def load_kvd_model(folder: Path, dtype: torch.dtype = torch.float32):
    """kvd's CausalLM for a checkpoint folder, through the loader."""
    from kvd.model.loader import load_model

    return load_model(folder, dtype=dtype).model


def load_hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


class PagedRunner:
    """Feeds token chunks of named sequences through a CausalLM over a paged pool, as the engine's runner does.

    Blocks come from a free list (shuffled when `shuffle_seed` is set, so tables are non-contiguous); a
    sequence can `share_prefix` another's full blocks, as a prefix-cache hit would.
    """

    def __init__(
        self,
        model,
        num_blocks: int = 128,
        block_size: int = 4,
        shuffle_seed: int | None = None,
    ) -> None:
        from kvd.model.layers.kv_cache import allocate_kv_cache
        from kvd.model.layers.recurrent_state import allocate_state

        self.model = model
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        model.bind_kv_cache(allocate_kv_cache(model.config, num_blocks, block_size, dtype, "cpu"))
        # Linear-attention layers: a state slot per sequence name, in order of first appearance.
        self.recurrent = model.config.has_recurrent_state
        model.bind_recurrent_state(allocate_state(model.config, 16, dtype, "cpu"))
        self.state_slots: dict[str, int] = {}
        self.free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def share_prefix(self, seq: str, source: str, num_tokens: int) -> None:
        """Start `seq` with `source`'s first num_tokens (a whole number of blocks) already in the cache."""
        num_blocks = num_tokens // self.block_size
        if num_blocks * self.block_size != num_tokens:
            raise ValueError("share whole blocks only")
        self.tables[seq] = self.tables[source][:num_blocks]
        self.lens[seq] = num_tokens

    def _recurrent_rows(self, seq: str):
        from kvd.distributed.step import RecurrentRows

        slot = self.state_slots.setdefault(seq, len(self.state_slots))
        return RecurrentRows(slot, slot if self.lens.get(seq, 0) else -1)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[str, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """Run one flat batch; float32 logits of each chunk's last token [S, V] (or of every row, [T, V])."""
        from kvd.model.layers.attention import build_attention_metadata

        ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(tokens):
                table.append(self.free.pop())
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            last_rows.append(len(ids) - 1)
        attn = build_attention_metadata(
            block_tables=[self.tables[s] for s, _ in chunks],
            context_lens=[self.lens.get(s, 0) + len(t) for s, t in chunks],
            query_lens=[len(t) for _, t in chunks],
            block_size=self.block_size,
            device="cpu",
            backend=self.model.attention_backend,
            kv_groups=self.model.kv_groups,
            recurrent=[self._recurrent_rows(s) for s, _ in chunks] if self.recurrent else None,
        )
        for seq, tokens in chunks:
            self.lens[seq] = self.lens.get(seq, 0) + len(tokens)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), attn)
        return self.model.compute_logits(hidden if all_logits else hidden[last_rows])


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    """The PagedRunner class: paged_runner(model, num_blocks=..., block_size=..., shuffle_seed=...)."""
    return PagedRunner


from daemon_fixtures import tiny_daemon, tiny_daemon_model  # noqa: E402, F401 - daemon e2e fixtures

"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) in the engine: state slots and
checkpoints in info, prefix hits that resume from a checkpoint with the same tokens, what it refuses, and no
slot or block left behind after many mixed requests."""

from __future__ import annotations

import json

import pytest

from kvd import LLM, SamplingParams
from kvd.distributed.shard import Shard, ShardingError, ShardPlan
from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.engine.ngram import NgramIndex
from kvd.kernels import cpu_native
from kvd.model.config import ModelConfig, UnsupportedModelError

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native kernels need a C compiler")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
INTERVAL = 2  # blocks of 16 tokens between checkpoints in these tests


def _llm(folder, **engine) -> LLM:
    settings = {"dtype": "float32", "kv_cache_memory": "16M", "max_num_seqs": 4} | engine
    return LLM(str(folder), state_checkpoint_interval=INTERVAL, **settings)


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


def test_info_names_the_state_slots_and_checkpoints(folder):
    info = _llm(folder).engine.info()
    state = info["recurrent_state"]
    assert state["linear_layers"] == 3 and state["slots"] == 4 and state["checkpoints"] == 4
    assert state["checkpoint_interval_tokens"] == INTERVAL * info["block_size"]
    assert state["bytes"] == 8 * state["bytes_per_slot"] > 0
    assert [g["layers"] for g in info["kv_groups"]] == [1]  # the one full-attention layer keeps K/V


def test_a_later_turn_resumes_from_a_checkpoint_with_the_same_tokens(folder):
    """Turn 2 repeats turn 1 and its answer: the hit reaches the last checkpoint at or before their end (whole
    intervals of 32 tokens), the rest is recomputed, and every token is the uncached run's."""
    turn1 = [(5 * i + 1) % 250 for i in range(45)]
    uncached = _llm(folder, enable_prefix_caching=False)
    answer = _tokens(uncached, turn1)
    turn2 = turn1 + answer + [9, 8, 7]  # 58 tokens: checkpoints at 32 (turn 1's prefill) and none at 64 yet
    want = _tokens(uncached, turn2)
    llm = _llm(folder)
    assert _tokens(llm, turn1) == answer
    assert _tokens(llm, turn2) == want
    stats = llm.engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == 32  # between two checkpoint positions (32 and 64): resumed from 32
    assert llm.engine.info()["recurrent_state"]["checkpoints_held"] >= 1
    llm.engine.block_manager.check_invariants()


def test_without_checkpoints_no_prefix_is_read(folder):
    prompt = list(range(3, 80))
    llm = _llm(folder, state_checkpoints=0)
    first = _tokens(llm, prompt)
    assert _tokens(llm, prompt) == first
    assert llm.engine.stats()["prefix_cache"]["hit_tokens"] == 0
    assert llm.engine.info()["recurrent_state"]["checkpoints"] == 0


def test_many_mixed_requests_leave_no_slot_or_block_behind(folder):
    """1,000 requests of mixed lengths, sharing prefixes, through 4 state slots and a small pool (preemptions):
    afterwards every live slot and block is free again and the checkpoints are all the cache holds."""
    shared = list(range(10, 60))
    prompts = [(shared[: (7 * i) % 50] + [(3 * i + j) % 250 for j in range(1 + i % 23)]) for i in range(1000)]
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 5, ignore_eos=True) for i in range(1000)]
    llm = _llm(
        folder, kv_cache_memory=100_000, max_num_seqs=4
    )  # 5 blocks beside 4 live states, 2 checkpoints
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.usage().used_blocks == 0
    assert bm.states.num_free_live == bm.states.num_live
    assert llm.engine.stats()["prefix_cache"]["hit_tokens"] > 0
    assert llm.engine.stats()["num_preemptions"] > 0


def test_drafts_keep_every_token_and_leave_no_slot_behind(folder, monkeypatch):
    """Speculative decoding: a draft's rows leave their states in free slots, and the state after the accepted
    tokens is the sequence's after the step. 160 mixed requests through 4 state slots, a small pool (preemptions)
    and checkpoints (prefix hits), drafting their own continuations with every third token wrong (a random model
    seldom repeats an n-gram): the same tokens as without drafts, and afterwards every live slot and block is free
    again."""
    shared = list(range(10, 60))
    prompts = [shared[: (7 * i) % 50] + [(3 * i + j) % 250 for j in range(1 + i % 23)] for i in range(160)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i % 9, ignore_eos=True) for i in range(160)]
    settings = {"kv_cache_memory": 100_000, "max_num_seqs": 4}
    plain = _llm(folder, **settings).generate(prompts, params, use_tqdm=False)
    texts = {tuple(p): p + o.token_ids for p, o in zip(prompts, plain, strict=True)}

    def propose(self, token_ids: list[int], most: int) -> list[int]:
        for prompt, text in texts.items():
            if text[: len(token_ids)] == token_ids and len(prompt) <= len(token_ids):
                return [t ^ (i % 3 == 2) for i, t in enumerate(text[len(token_ids) : len(token_ids) + most])]
        return []

    monkeypatch.setattr(NgramIndex, "propose", propose)
    llm = _llm(folder, speculative="ngram", **settings)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    stats = llm.engine.stats()
    spec = stats["speculative"]
    assert spec["num_accepted_tokens"] > 0 and spec["num_rejected_tokens"] > 0
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["num_preemptions"] > 0
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.usage().used_blocks == 0 and bm.states.num_free_live == bm.states.num_live


def test_tensor_parallel_is_refused_before_any_weight_loads(folder):
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    with pytest.raises(ShardingError, match="linear-attention layers"):
        ShardPlan(config, Shard(0, 2)).local_config()


@pytest.mark.parametrize(
    ("value", "message"), [(-1, "state_checkpoints"), (1.5, "state_checkpoints"), (True, "state_checkpoints")]
)
def test_bad_checkpoint_settings_are_refused_naming_the_field(value, message):
    with pytest.raises(EngineArgsError, match=message):
        EngineArgs(model="x", state_checkpoints=value)
    with pytest.raises(EngineArgsError, match="state_checkpoint_interval"):
        EngineArgs(model="x", state_checkpoint_interval=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"linear_conv_kernel_dim": 40}, "linear_conv_kernel_dim"),
        ({"layer_types": ["linear_attention"] * 4}, "no full_attention layer"),
    ],
)
def test_configs_kvd_cannot_run_are_refused_naming_the_field(folder, overrides, message):
    config = json.loads((folder / "config.json").read_text()) | overrides
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict(config)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_released_multimodal_checkpoint_serves_its_text_model(tmp_path, tiny_checkpoint, family):
    """Qwen3.5's and Qwen3.5-MoE's released checkpoints are ...ForConditionalGeneration: text_config, the text model
    under model.language_model, a vision tower beside it. kvd serves the text model, with the tokens its text-only
    twin (the same weights as ...ForCausalLM) gives."""
    import torch
    import transformers

    folder = tiny_checkpoint(family)
    text = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    prefix = "Qwen3_5" if family == "qwen3_5" else "Qwen3_5Moe"
    config = getattr(transformers, f"{prefix}Config")(text_config=text.config.to_dict(), vision_config=vision)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    missing = model.model.language_model.load_state_dict(text.model.state_dict())
    assert not missing.missing_keys
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    prompt = [(3 * i + 2) % 250 for i in range(20)]
    assert _tokens(_llm(tmp_path), prompt) == _tokens(_llm(folder), prompt)


def test_the_memory_profile_step_runs_with_state_slots(folder):
    """The CUDA memory profile's step (it runs on any device) binds scratch state slots for the sequences of its
    largest step, counts them in its scratch bytes, and leaves one slot bound after."""
    from kvd.engine.gpu_memory import profile_steps, run_profile_step
    from kvd.model.loader import load_model

    model = load_model(folder, dtype="float32").model
    shape = {"max_num_batched_tokens": 100, "max_num_seqs": 4, "max_model_len": 40}
    steps = profile_steps(16, **shape)
    scratch = run_profile_step(model, block_size=16, **shape)
    per_block = 2 * 16 * model.config.num_key_value_heads * model.config.head_dim * 4  # one attention layer
    pool = max(sum(len(t) for t in step.tables) for step in steps) * per_block
    states = [layer.linear_attn.state for layer in model.model.layers if layer.linear_attn is not None]
    per_slot = sum(
        t.numel() * 4 for state in states for t in (state.conv, state.state)
    )  # float32, one slot now
    assert scratch == pool + max(len(step.tables) for step in steps) * per_slot
    assert all(state.state.shape[0] == 1 for state in states)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_experts_stacked_in_one_tensor_load_as_each_experts(tmp_path, tiny_checkpoint, family):
    """A Qwen3.5-MoE or Qwen3-Next checkpoint may hold each layer's experts stacked (transformers' fused layout:
    gate_up_proj [experts, 2 x width, hidden], gate then up; down_proj [experts, hidden, width]): the same tokens as
    per expert."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    folder = tiny_checkpoint(family)
    (weights,) = folder.glob("*.safetensors")
    tensors, stacks = {}, {}
    for name, tensor in load_file(weights).items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if match is None:
            tensors[name] = tensor
        else:
            stacks.setdefault(match[1], {}).setdefault(match[3], []).append((int(match[2]), tensor))
    for prefix, parts in stacks.items():
        gate, up, down = (torch.stack([t for _, t in sorted(parts[kind])]) for kind in ("gate", "up", "down"))
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        tensors[f"{prefix}.down_proj"] = down
    for path in folder.iterdir():
        if path != weights:
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(tensors, tmp_path / weights.name, metadata={"format": "pt"})
    prompt = [(5 * i + 1) % 250 for i in range(20)]
    assert _tokens(_llm(tmp_path), prompt) == _tokens(_llm(folder), prompt)


def test_the_moe_variants_configs_as_released(tiny_checkpoint):
    """Qwen3.5-MoE's config has no dense width (every layer a mixture: the experts' stands in) and no
    norm_topk_prob (it always rescales); Qwen3-Next rescales unless its config says not to (transformers' default)."""
    config = json.loads((tiny_checkpoint("qwen3_5_moe") / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("intermediate_size", "norm_topk_prob")}
    read = ModelConfig.from_hf_dict(config)
    assert read.intermediate_size == read.moe.intermediate_size == 32 and read.moe.normalize_top_k
    config = json.loads((tiny_checkpoint("qwen3_next") / "config.json").read_text())
    assert ModelConfig.from_hf_dict(
        {k: v for k, v in config.items() if k != "norm_topk_prob"}
    ).moe.normalize_top_k
    assert not ModelConfig.from_hf_dict(config | {"norm_topk_prob": False}).moe.normalize_top_k
    with pytest.raises(UnsupportedModelError, match="intermediate_size"):  # a dense layer needs a width
        ModelConfig.from_hf_dict(
            {k: v for k, v in config.items() if k != "intermediate_size"} | {"mlp_only_layers": [0]}
        )

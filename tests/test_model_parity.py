"""kvd's CausalLM against transformers on the same tiny random checkpoints: logits and greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from conftest import TINY_FAMILIES, load_hf_model, load_kvd_model

from kvd.model.config import ModelConfig, UnsupportedModelError
from kvd.model.decoder import CausalLM, WeightLoadError

FAMILIES = list(TINY_FAMILIES)
PROMPT_LEN = 19  # not a multiple of the runner's block size (4): the last block is partly filled
DECODE_STEPS = 16


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """family -> (kvd model, transformers model), float32, built once per module."""
    cache = {}

    def get(family: str):
        if family not in cache:
            folder = tiny_checkpoint(family)
            cache[family] = (load_kvd_model(folder), load_hf_model(folder))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family, models, paged_runner):
    ours, ref = models(family)
    ids = prompt(1)
    logits = paged_runner(ours).step([("a", ids)], all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert logits.shape == expected.shape
    assert rel_err(logits, expected) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_transformers(family, models, paged_runner):
    ours, ref = models(family)
    ids = prompt(2)
    runner = paged_runner(ours)
    logits = runner.step([("a", ids)])[0]
    with torch.no_grad():
        out = ref(torch.tensor([ids]), use_cache=True)
        for step in range(DECODE_STEPS + 1):
            expected = out.logits[0, -1]
            assert rel_err(logits, expected) < 1e-4, f"step {step}"
            token = int(expected.argmax())
            assert int(logits.argmax()) == token, f"greedy token differs at step {step}"
            if step == DECODE_STEPS:
                break
            out = ref(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
            logits = runner.step([("a", [token])])[0]


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "granite", "gemma3", "gemma4", "olmo2", "qwen3_moe", "gpt_oss", "qwen3_5"]
)
def test_chunked_prefill_equals_one_shot(family, models, paged_runner):
    ours, _ = models(family)
    ids = prompt(3, 30)
    one_shot = paged_runner(ours).step([("a", ids)], all_logits=True)
    runner = paged_runner(ours)
    # Chunk ends at 7 and 20: not on block boundaries, so chunks start mid-block.
    chunks = [runner.step([("a", part)], all_logits=True) for part in (ids[:7], ids[7:20], ids[20:])]
    assert rel_err(torch.cat(chunks), one_shot) < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "gemma4", "mixtral"])
def test_prefill_over_cached_prefix_equals_one_shot(family, models, paged_runner):
    ours, _ = models(family)
    shared, suffix = prompt(4, 16), prompt(5, 9)
    one_shot = paged_runner(ours).step([("b", shared + suffix)], all_logits=True)
    runner = paged_runner(ours)
    runner.step([("a", shared + prompt(6, 5))])
    runner.share_prefix("b", "a", 16)  # b finds a's first 4 blocks cached and computes only its suffix
    logits = runner.step([("b", suffix)], all_logits=True)
    assert rel_err(logits, one_shot[16:]) < 1e-5


def test_mixed_batch_equals_each_sequence_alone(models, paged_runner):
    """Fresh prefills, a chunk over a cached part and decodes of different lengths in one flat batch."""
    ours, _ = models("llama")
    prompts = {
        name: prompt(10 + i, n) for i, (name, n) in enumerate([("a", 5), ("b", 23), ("c", 12), ("d", 9)])
    }
    alone = {}
    for name, ids in prompts.items():
        runner = paged_runner(ours)
        alone[name] = runner.step([(name, ids)], all_logits=True)

    runner = paged_runner(ours, shuffle_seed=1)
    runner.step([("a", prompts["a"][:-1]), ("b", prompts["b"][:10])])
    logits = runner.step(
        [
            ("a", prompts["a"][-1:]),  # decode-like: one new token
            ("c", prompts["c"]),  # fresh prefill
            ("b", prompts["b"][10:]),  # chunk after a cached part
            ("d", prompts["d"]),  # another fresh prefill of a different length
        ],
        all_logits=True,
    )
    expected = torch.cat([alone["a"][-1:], alone["c"], alone["b"][10:], alone["d"]])
    assert rel_err(logits, expected) < 1e-5


def test_batched_decode_equals_each_sequence_alone(models, paged_runner):
    ours, _ = models("qwen3")
    lengths = {"a": 3, "b": 17, "c": 8, "d": 30}
    runner = paged_runner(ours, shuffle_seed=2)
    runner.step([(name, prompt(20 + i, n)) for i, (name, n) in enumerate(lengths.items())])
    tokens = {name: [7 * i + 1, 3 * i + 2] for i, name in enumerate(lengths)}
    batched = [runner.step([(name, [toks[step]]) for name, toks in tokens.items()]) for step in range(2)]
    for i, (name, n) in enumerate(lengths.items()):
        alone = paged_runner(ours)
        alone.step([(name, prompt(20 + i, n))])
        for step in range(2):
            assert rel_err(batched[step][i], alone.step([(name, [tokens[name][step]])])[0]) < 1e-5


def test_shuffled_block_tables_give_identical_results(models, paged_runner):
    ours, _ = models("llama")
    results = []
    for shuffle_seed in (None, 3):
        runner = paged_runner(ours, shuffle_seed=shuffle_seed)
        steps = [runner.step([("a", prompt(30, 13)), ("b", prompt(31, 6))])]
        steps += [runner.step([("a", [5]), ("b", [9])]) for _ in range(3)]
        results.append(torch.stack(steps))
    assert runner.tables["a"] != sorted(runner.tables["a"])  # the shuffled run really used scattered blocks
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_bf16_greedy_agrees_with_transformers_bf16(tiny_checkpoint, paged_runner):
    """bf16 rounds differently in places, so ask for agreement, not identity: >= 90% of teacher-forced steps."""
    folder = tiny_checkpoint("llama")
    ours, ref = load_kvd_model(folder, torch.bfloat16), load_hf_model(folder, torch.bfloat16)
    agree = total = 0
    for seed in range(4):
        ids = prompt(40 + seed)
        runner = paged_runner(ours)
        logits = runner.step([("a", ids)])[0]
        with torch.no_grad():
            out = ref(torch.tensor([ids]), use_cache=True)
            for _ in range(8):
                token = int(out.logits[0, -1].argmax())
                agree += int(logits.argmax()) == token
                total += 1
                out = ref(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
                logits = runner.step([("a", [token])])[0]
    print(f"bf16 greedy agreement with transformers: {agree}/{total}")
    assert agree >= 0.9 * total


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as excinfo:
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(excinfo.value)
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelConfig.from_hf_dict(_llama_dict(rope_scaling={"type": "dynamic", "factor": 4.0}))


def test_config_reads_both_rope_layouts():
    """transformers 4 wrote rope_theta + rope_scaling (with "type"); transformers 5 writes rope_parameters."""
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    old = ModelConfig.from_hf_dict(_llama_dict(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling}))
    new = ModelConfig.from_hf_dict(
        _llama_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling})
    )
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **scaling}
    plain = ModelConfig.from_hf_dict(_llama_dict())
    assert plain.rope_theta == 10000.0 and plain.rope_scaling is None


def test_sliding_windows_come_from_each_familys_config():
    mistral = ModelConfig.from_hf_dict(
        _llama_dict(architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768)
    )
    # A window slides past its size: the whole context is served, every Mistral layer windowed.
    assert mistral.max_position_embeddings == 32768 and mistral.attention_window == 4096
    assert mistral.layer_types == ("sliding_attention",) * 2
    qwen2 = ModelConfig.from_hf_dict(
        _llama_dict(
            architectures=["Qwen2ForCausalLM"],
            sliding_window=64,
            use_sliding_window=True,
            max_window_layers=1,
        )
    )
    assert qwen2.layer_types == ("full_attention", "sliding_attention")
    unused = ModelConfig.from_hf_dict(_llama_dict(architectures=["Qwen2ForCausalLM"], sliding_window=64))
    assert unused.attention_window is None
    gemma = ModelConfig.from_hf_dict(
        _llama_dict(
            architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, sliding_window=16, rope_theta=1e6
        )
    )
    assert gemma.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert gemma.sliding_rope_theta == 10000.0 and gemma.rope_theta == 1e6 and gemma.norm_weight_offset == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "relu2"}, "hidden_act 'relu2' is not supported; supported: silu, gelu_pytorch_tanh"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 8,
                "layer_types": ["sliding_attention"],
            },
            "layer_types must name 2 layers",
        ),
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}},
            },
            "rope_parameters.sliding_attention.rope_type 'yarn' is not supported",
        ),
    ],
)
def test_config_features_kvd_lacks_are_refused_naming_the_field(overrides, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf_dict(_llama_dict(**overrides))


def test_olmo2_is_refused_at_tensor_parallel_before_any_weight_loads(tiny_checkpoint):
    from kvd.distributed.shard import Shard, ShardingError, ShardPlan

    config = ModelConfig.from_hf_dict(json.loads((tiny_checkpoint("olmo2") / "config.json").read_text()))
    with pytest.raises(ShardingError, match=r"all their heads at once.*tensor-parallel size of 1"):
        ShardPlan(config, Shard(0, 2)).local_config()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"enable_moe_block": True},
            "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size",
        ),
        (
            {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8},
            "top_k_experts 5 is not between 1 and num_experts (4)",
        ),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all' is not supported"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers 6 must be below num_hidden_layers (6)"),
        # The shared layers' kind (full) has no earlier layer of its own before them.
        (
            {
                "num_kv_shared_layers": 4,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                "per_layer_config": {"5": {"head_dim": 32}},
            },
            "layer 5 shares the K/V of an earlier full_attention layer",
        ),
        ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config must give every full_attention"),
        ({"vocab_size_per_layer_input": 200}, "vocab_size_per_layer_input 200 is below vocab_size (256)"),
        (
            {"per_layer_config": {"2": {"sliding_window": 4}, "5": {"sliding_window": 4}}},
            "['sliding_window']",
        ),
    ],
)
def test_gemma4_options_kvd_lacks_are_refused_naming_the_field(tiny_checkpoint, overrides, message):
    config = json.loads((tiny_checkpoint("gemma4") / "config.json").read_text()) | overrides
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        ModelConfig.from_hf_dict(config)


def test_gemma4_reads_a_released_checkpoints_config(tiny_checkpoint):
    """A hub checkpoint's config (Gemma4ForConditionalGeneration, the text model under text_config, the full
    layers' shape as global_head_dim / num_global_key_value_heads) gives the shape transformers saves."""
    saved = json.loads((tiny_checkpoint("gemma4_k_eq_v") / "config.json").read_text())
    text = {k: v for k, v in saved.items() if k not in ("per_layer_config", "architectures")}
    released = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        # "vision" bidirectional attention (31B's) only concerns image tokens
        "text_config": text
        | {"global_head_dim": 32, "num_global_key_value_heads": 1, "use_bidirectional_attention": "vision"},
    }
    # transformers zero-pads per_layer_config's keys in a model of 10 layers or more
    padded = saved | {"per_layer_config": {f"{int(k):02d}": v for k, v in saved["per_layer_config"].items()}}
    ours, theirs = ModelConfig.from_hf_dict(released), ModelConfig.from_hf_dict(padded)
    assert (ours.full_head_dim, ours.full_kv_heads, ours.full_k_eq_v) == (32, 1, True)
    assert dataclasses.replace(ours.layer_config(1), architectures=()) == dataclasses.replace(
        theirs.layer_config(1), architectures=()
    )
    assert ours.layer_config(0).head_dim == 16 and ours.rotary_dim == 32 and ours.sliding_rotary_dim == 16


@pytest.mark.parametrize("family", ["gemma4", "gemma4_k_eq_v"])
def test_gemma4_is_refused_at_tensor_parallel_before_any_weight_loads(tiny_checkpoint, family):
    from kvd.distributed.shard import Shard, ShardingError, ShardPlan

    config = ModelConfig.from_hf_dict(json.loads((tiny_checkpoint(family) / "config.json").read_text()))
    with pytest.raises(ShardingError, match=r"Gemma 4.*tensor-parallel size of 1"):
        ShardPlan(config, Shard(0, 2)).local_config()


def test_gemma4_experts_lacking_a_part_are_named(tiny_checkpoint):
    """The router's scales and the experts' input norm fold into the experts as a layer's parts all arrive: a
    checkpoint without one of them names what the layer has."""
    from safetensors.torch import load_file

    weights = load_file(tiny_checkpoint("gemma4_moe") / "model.safetensors")
    del weights["model.layers.1.router.per_expert_scale"]
    model = load_kvd_model(tiny_checkpoint("gemma4_moe"))
    with pytest.raises(
        WeightLoadError, match=r"only \['experts.down_proj'.* of layer 1's mixture of experts"
    ):
        model.load_weights(weights.items())


def test_gemma4_skips_the_kv_weights_of_layers_that_share_kv(tiny_checkpoint, tmp_path):
    """Google's E2B / E4B checkpoints hold k/v projections and k norms for the layers that read earlier layers' K/V
    too: they load (and are left unused) as transformers loads them, the logits unchanged; a k/v weight of a layer
    that projects q alone has no place otherwise."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "e2b_like"
    shutil.copytree(tiny_checkpoint("gemma4"), folder)
    weights = load_file(folder / "model.safetensors")
    for layer, source in ((4, 3), (5, 2)):  # the tiny model's shared layers and their sources
        for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            weights[f"model.layers.{layer}.self_attn.{part}"] = (
                weights[f"model.layers.{source}.self_attn.{part}"] + 1
            )
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    ids = torch.tensor([prompt(7)])
    with torch.no_grad():
        assert torch.equal(
            load_hf_model(folder)(ids).logits, load_hf_model(tiny_checkpoint("gemma4"))(ids).logits
        )
    ours, original = load_kvd_model(folder), load_kvd_model(tiny_checkpoint("gemma4"))
    expected = original.state_dict()
    assert ours.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in ours.state_dict().items())
    with pytest.raises(WeightLoadError, match=re.escape("layers.4.self_attn.k_proj.weight' has no place")):
        ours.load_weights(
            [("model.layers.4.self_attn.k_proj.weight", weights["model.layers.4.self_attn.k_proj.weight"])]
        )


def test_load_weights_rejects_unknown_missing_and_misshaped(tiny_checkpoint):
    from safetensors.torch import load_file

    folder = tiny_checkpoint("llama")
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    weights = load_file(folder / "model.safetensors")
    with pytest.raises(WeightLoadError, match="no place"):
        CausalLM(config).load_weights([*weights.items(), ("model.layers.0.extra.weight", torch.zeros(1))])
    with pytest.raises(WeightLoadError, match=r"lacks 1 weights.*layers\.1\.self_attn\.k_proj"):
        CausalLM(config).load_weights(
            (n, t) for n, t in weights.items() if n != "model.layers.1.self_attn.k_proj.weight"
        )
    bad = dict(weights, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(WeightLoadError, match="shape"):
        CausalLM(config).load_weights(bad.items())


def _llama_dict(**overrides) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    return d | overrides

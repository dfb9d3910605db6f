"""KV groups: which layers share a block table, the pool they share, and a sliding group freeing its blocks as
the window passes, through the engine (the block manager's own rules: test_block_manager*.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvd import LLM, SamplingParams
from kvd.model.config import FULL, SLIDING, ModelConfig
from kvd.model.layers.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block, kv_groups

BASE = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, rotary_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
)  # fmt: skip


def _config(pattern: str, window: int | None = 512) -> ModelConfig:
    """A config whose layer i is sliding where pattern[i] == 's', full where 'f'."""
    types = tuple(SLIDING if c == "s" else FULL for c in pattern)
    return dataclasses.replace(BASE, num_hidden_layers=len(pattern), sliding_window=window, layer_types=types)


def test_gemma3_270m_layers_form_one_full_and_five_sliding_groups_of_three():
    groups = kv_groups(_config("sssssf" * 3))  # Gemma 3 270M: 18 layers, every sixth full
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers_per_group == 3
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert groups.layer_group[:5] == (1, 1, 1, 2, 2)  # the sliding layers in order, three a group
    assert all(groups.layer_group.count(g) == 3 for g in range(6))
    assert groups.release_windows == (None, 512, 512, 512, 512, 512)


def test_uneven_counts_group_by_their_greatest_common_divisor():
    groups = kv_groups(_config("sssssf" * 4 + "ss"))  # Gemma 3 1B: 26 layers, 4 full and 22 sliding
    assert groups.layers_per_group == 2 and groups.windows == (None, None) + (512,) * 11
    assert groups.release_windows[:2] == (None, None)  # a second full group keeps every block too


@pytest.mark.parametrize("pattern", ["ssss", "ffff"])
def test_one_kind_of_layer_is_one_group_that_keeps_every_block(pattern):
    groups = kv_groups(_config(pattern))
    assert groups.num_groups == 1 and groups.layers_per_group == 4
    assert groups.windows == ((512,) if pattern == "ssss" else (None,)) and groups.release_windows == (None,)


def test_a_grouped_pool_shares_a_tensor_per_place_and_a_block_costs_one_groups_layers():
    config = _config("sssssf" * 3)
    groups = kv_groups(config)
    pool = allocate_kv_cache(config, 4, 16, torch.float32, "cpu", groups)
    assert len({id(t) for t in pool}) == 3
    assert all(
        pool[i] is pool[j] for i, j in ((0, 3), (5, 0), (17, 2))
    )  # first, first, third in their groups
    ungrouped = allocate_kv_cache(config, 4, 16, torch.float32, "cpu")
    assert len({id(t) for t in ungrouped}) == 18
    per_layer = 2 * 16 * config.num_key_value_heads * config.head_dim * 4
    assert kv_cache_bytes_per_block(config, 16, torch.float32) == 3 * per_layer


def test_the_engine_frees_the_sliding_groups_blocks_as_the_window_passes(tiny_checkpoint):
    """Tiny Gemma 3: a sliding layer (window 8) and a full one, one group each. A 200-token prompt in chunks of
    32, then 40 tokens: the sliding group never holds more than the window's blocks plus a chunk's, the full one
    every token's; the tokens are those of the prompt computed in one chunk."""
    llm = LLM(
        str(tiny_checkpoint("gemma3")),
        dtype="float32",
        kv_cache_memory="16M",
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    engine = llm.engine
    assert engine.info()["kv_groups"] == [{"layers": 1, "window": None}, {"layers": 1, "window": 8}]
    prompt = [(11 * i + 5) % 250 for i in range(200)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("r", prompt, greedy)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens += out.new_token_ids
        engine.block_manager.check_invariants()
        full, sliding = engine.stats()["kv_cache"]["groups"]
        assert sliding["window"] == 8 and sliding["used_blocks"] <= 3, sliding  # 8 + 32 tokens span 3 blocks
        seq = next(iter(engine.requests.values())).seq if engine.requests else None
        if seq is not None:
            # The whole prompt's from admission on, then a block per 16 tokens computed.
            assert full["used_blocks"] == max(-(-len(prompt) // 16), -(-seq.num_computed_tokens // 16))
    assert len(tokens) == 40
    done = engine.stats()["kv_cache"]["groups"]
    assert done[0]["used_blocks"] == done[1]["used_blocks"] == 0 and done[1]["cached_blocks"] > 0
    whole = LLM(str(tiny_checkpoint("gemma3")), dtype="float32", kv_cache_memory="16M")
    assert whole.generate([prompt], greedy, use_tqdm=False)[0].token_ids == tokens


def _gemma4_like(pattern: str, shared: tuple[int, ...] = ()) -> ModelConfig:
    """_config's layers with full layers of twice the head size (Gemma 4) and `shared`'s layers attending the last
    earlier layer of their kind."""
    config = _config(pattern)
    sources = list(range(len(pattern)))
    for i in shared:
        sources[i] = max(j for j in range(i) if pattern[j] == pattern[i] and j not in shared)
    return dataclasses.replace(config, full_head_dim=32, kv_source=tuple(sources) if shared else ())


def test_smaller_pages_see_the_shared_tensor_as_more_pages_and_their_blocks_scale():
    """Full layers of 32 values a token, sliding ones of 16: the sliding groups' block b is their page 2b, which is
    the first half of the bytes block b owns in the full layers' view."""
    config = _gemma4_like("ssf" * 2)
    groups = kv_groups(config)
    assert groups.windows == (None, 512, 512) and groups.block_scales == (1, 2, 2)
    pool = allocate_kv_cache(config, 4, 16, torch.float32, "cpu", groups)
    full, sliding = pool[groups.pooled_layers.index(2)], pool[groups.pooled_layers.index(0)]
    assert full.shape == (2, 4, 16, 1, 32) and sliding.shape == (2, 8, 16, 1, 16)
    assert full.data_ptr() == sliding.data_ptr()  # one tensor per place
    sliding[0, 2 * 3].fill_(1.0)  # the sliding layer's block 3
    assert full[0, 3].sum() == 16 * 16 and full[0, :3].sum() == 0 and full[1].sum() == 0
    per_layer = 2 * 16 * 32 * 4  # the largest row's page, K and V
    assert kv_cache_bytes_per_block(config, 16, torch.float32) == groups.layers_per_group * per_layer


def test_metadata_scales_each_groups_blocks_to_its_pages():
    from kvd.model.layers.attention import build_attention_metadata

    groups = kv_groups(_gemma4_like("ssf" * 2))
    attn = build_attention_metadata(
        [[5, 6]], [20], [20], 16, "cpu", kv_groups=groups, group_tables=[[[1, 2]], [[3, 4]]]
    )
    assert attn.block_tables.tolist() == [[5, 6]]
    assert [g.block_tables.tolist() for g in attn.other_groups] == [[[2, 4]], [[6, 8]]]
    assert attn.other_groups[0].slot_mapping[:2].tolist() == [32, 33]  # page 2's first slots


def test_layers_sharing_kv_keep_no_pool_and_read_their_sources_group():
    config = _gemma4_like("ssfssf", shared=(4, 5))
    groups = kv_groups(config)
    assert groups.pooled_layers == (0, 1, 2, 3)
    assert groups.layer_group[4] == groups.layer_group[3] and groups.layer_group[5] == groups.layer_group[2]
    assert groups.layer_slot[4] == groups.layer_slot[5] == -1


def test_an_8_bit_pool_of_unlike_rows_is_refused_by_name():
    from kvd.model.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="--kv-cache-dtype auto"):
        allocate_kv_cache(_gemma4_like("ssf"), 4, 16, torch.int8, "cpu", kv_groups(_gemma4_like("ssf")))

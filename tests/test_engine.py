"""The engine end to end on tiny random models: greedy tokens equal transformers' generate in every batch shape."""

import random

import pytest
import torch
from tiny_models import save_tiny_llama
from transformers import AutoModelForCausalLM

from kvd import LLM, SamplingParams
from kvd.engine.llm_engine import LLMEngine, RequestRejectedError, RequestTooLongError
from kvd.engine.sequence import SequenceStatus
from kvd.request.sampling_params import SamplingParamsError

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    """16 prompts of mixed lengths; half share a 40-token prefix so that the prefix cache has work."""
    rng = random.Random(0)
    vocab = 300
    shared = [rng.randrange(vocab) for _ in range(40)]
    out = []
    for i in range(16):
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        out.append(shared + tail if i % 2 else tail + shared[: rng.randrange(3, 20)])
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KV = 8 * 1024  # bytes per block of the tiny model in float32


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_seqs": 16}, id="all-at-once"),
        pytest.param({"max_num_seqs": 1}, id="one-at-a-time"),
        pytest.param({"max_num_seqs": 5, "enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"max_num_seqs": 4, "max_num_batched_tokens": 16}, id="chunked-prefill"),
        # auto is the native backend on this CPU; the torch one still runs where the kernels cannot be built.
        pytest.param({"max_num_seqs": 16, "attention_backend": "torch"}, id="torch-attention"),
        pytest.param(
            {"max_num_seqs": 4, "max_num_batched_tokens": 16, "attention_backend": "torch"},
            id="torch-chunked",
        ),
    ],
)
def test_greedy_equals_transformers(tiny_llama_dir, prompts, reference, engine_args):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV, **engine_args)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, reference, strict=True):
        assert out.token_ids == ref
        assert out.finish_reason == "length"
    engine = llm.engine
    assert engine.attention_backend == engine_args.get("attention_backend", "native")
    assert engine.block_manager.usage().used_blocks == 0
    engine.block_manager.check_invariants()
    if engine_args.get("enable_prefix_caching", True) and engine_args["max_num_seqs"] < 16:
        assert engine.block_manager.prefix_cache_stats().hit_tokens > 0


def test_greedy_equals_transformers_under_preemption(tiny_llama_dir, prompts, reference):
    # 14 blocks of 16 tokens cannot hold the running set's growth, so the scheduler must preempt.
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=14 * KV, max_num_seqs=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.stats()["num_preemptions"] > 0
    assert llm.engine.block_manager.usage().used_blocks == 0
    llm.engine.block_manager.check_invariants()


def test_prefix_cache_hit_is_reported_and_skips_compute(tiny_llama_dir, prompts):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV)
    first = llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    computed_before = llm.engine.metrics.num_prefill_tokens
    second = llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    assert second.token_ids == first.token_ids
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prompts[1]) - 1) // 16 * 16
    assert (
        llm.engine.metrics.num_prefill_tokens - computed_before == len(prompts[1]) - second.num_cached_tokens
    )


def _engine(tiny_llama_dir, **kw) -> LLMEngine:
    return LLMEngine(model=tiny_llama_dir, dtype="float32", **kw)


def _assert_pool_empty(engine: LLMEngine) -> None:
    engine.block_manager.check_invariants()
    assert engine.block_manager.usage().used_blocks == 0
    assert not engine.has_unfinished()


def test_abort_in_every_state_frees_every_block(tiny_llama_dir, prompts):
    engine = _engine(tiny_llama_dir, kv_cache_memory=12 * KV, max_num_seqs=4, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(prompts[:8]):
        engine.add_request(i, p, params)
    seen: set[str] = set()
    for _ in range(300):
        engine.step()
        for rid, req in list(engine.requests.items()):
            seq = req.seq
            if seq.status == SequenceStatus.WAITING:
                state = "preempted" if seq.num_output_tokens else "waiting"
            else:
                state = "prefilling" if seq.is_prefilling else "decoding"
            if state not in seen:
                seen.add(state)
                assert engine.abort(rid)
                engine.block_manager.check_invariants()
        if seen == {"waiting", "prefilling", "decoding", "preempted"}:
            break
    assert seen == {"waiting", "prefilling", "decoding", "preempted"}
    for rid in list(engine.requests):
        assert engine.abort(rid)
    _assert_pool_empty(engine)
    assert not engine.abort(0), "a second abort of the same request reports that nothing was done"


def test_prompt_too_long_is_rejected_at_admission(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, kv_cache_memory=8 * KV)
    assert engine.max_model_len == 8 * 16
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        engine.add_request("big", list(range(8 * 16)), GREEDY)
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(RequestRejectedError, match="token ids"):
        engine.add_request("vocab", [10**6], GREEDY)
    engine.add_request("ok", [1, 2, 3], GREEDY)
    with pytest.raises(RequestRejectedError, match="already in flight"):
        engine.add_request("ok", [1, 2, 3], GREEDY)
    outs = [o for _ in range(MAX_TOKENS) for o in engine.step().outputs]
    assert outs[-1].finished and len(outs) == MAX_TOKENS


def test_a_sequence_outgrowing_the_pool_finishes_with_length(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, kv_cache_memory=4 * KV, max_model_len=4096)
    engine.add_request("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step().outputs)
    assert outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 4 * 16 - 3
    _assert_pool_empty(engine)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_llama_dir, prompts):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = llm.generate([prompts[0], prompts[3], prompts[5]], [noisy, seeded, GREEDY], use_tqdm=False)
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.generate([prompts[3]], other_seed, use_tqdm=False)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(tiny_llama_dir, prompts, reference):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV)
    for extra in ({"top_k": 1}, {"top_p": 1e-9}):
        params = SamplingParams(temperature=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)
        outs = llm.generate(prompts[:4], params, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference[:4]


def test_logprobs_equal_log_softmax_of_reference_logits(tiny_llama_dir, prompts):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    out = llm.generate([prompts[2]], params, use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    full = torch.tensor([prompts[2] + out.token_ids])
    with torch.no_grad():
        ref = model(full).logits[0].log_softmax(-1)
    for i, entry in enumerate(out.logprobs):
        row = ref[len(prompts[2]) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert [t for t, _ in entry.top_logprobs] == row.topk(3).indices.tolist()


def test_stop_strings_and_stop_token_ids(tiny_llama_dir, prompts):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV)
    free = llm.generate(
        [prompts[4]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    text, ids = free[0].text, free[0].token_ids
    stop_id = ids[5]
    by_id = llm.generate(
        [prompts[4]],
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: ids.index(stop_id) + 1]
    # A stop string taken from the middle of the text, straddling whatever token boundary lies there.
    cut = len(text) // 2
    stop = text[cut : cut + 3]
    assert stop.strip(), "the tiny model's text should not be blank"
    by_text = llm.generate(
        [prompts[4]],
        SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == text[: text.index(stop)]
    # The tokens (and logprobs) handed out are the text's: those whose text begins before the cut.
    starts = [
        len(llm.engine.tokenizer.decode(ids[:j], skip_special_tokens=True)) for j in range(len(ids) + 1)
    ]
    kept = [t for t, start in zip(ids, starts, strict=False) if start < len(by_text.text)]
    generated = next(j for j in range(len(ids)) if starts[j + 1] >= len(by_text.text) + len(stop)) + 1
    assert by_text.token_ids == kept and len(kept) < generated  # the stop string's own tokens are not kept
    stream = list(
        llm.stream(
            [prompts[4]],
            SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True, logprobs=0),
        )
    )
    assert "".join(o.new_text for _, o in stream) == by_text.text
    assert [t for _, o in stream for t in o.new_token_ids] == kept
    assert [lp.token_id for _, o in stream for lp in o.logprobs or []] == kept


def test_max_model_len_past_the_models_positions_is_capped(tiny_llama_dir, caplog):
    # The tiny Llama has 4,096 positions (the pool holds 4,800 tokens); a longer context would index past its
    # rotary table.
    engine = _engine(tiny_llama_dir, kv_cache_memory=300 * KV, max_model_len=100_000)
    assert engine.max_model_len == 4096
    assert "max_position_embeddings" in caplog.text


def test_the_rotary_tables_hold_the_served_context_only(tiny_checkpoint):
    """Gemma 3's two tables (full and sliding layers) cut to max_model_len rows: the same tokens as with the
    model's whole table, up to that length."""
    folder = tiny_checkpoint("gemma3")  # 256 positions
    prompt, greedy = list(range(3, 43)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    whole = LLM(str(folder), dtype="float32", kv_cache_memory="16M").generate(
        [prompt], greedy, use_tqdm=False
    )
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16M", max_model_len=48)
    model = llm.engine.runner.model
    assert [r.cos_sin_cache.shape[0] for r in (model.rotary, model.sliding_rotary)] == [48, 48]
    cut = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert cut.finish_reason == "length" and cut.token_ids == whole[0].token_ids[:8]


def test_generate_checks_params_again_and_takes_token_ids_in_any_sequence(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=64 * KV)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    params.temperature = float("nan")  # changed after construction: checked again when it is used
    with pytest.raises(SamplingParamsError) as info:
        llm.generate("Hello", params, use_tqdm=False)
    assert info.value.field == "temperature" and not llm.engine.has_unfinished()
    with pytest.raises(TypeError, match=r"kvd\.SamplingParams"):
        llm.generate("Hello", {"max_tokens": 2}, use_tqdm=False)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    as_list = llm.generate([5, 6, 7], greedy, use_tqdm=False)[0].token_ids
    assert llm.generate((5, 6, 7), greedy, use_tqdm=False)[0].token_ids == as_list
    assert llm.generate([(5, 6, 7)], greedy, use_tqdm=False)[0].token_ids == as_list


def test_prompt_logprobs_take_a_bounded_slice_of_logits_at_a_time(tiny_llama_dir, prompts):
    # A whole chunk's logits at once (vocab floats per prompt token) lay outside the memory profile, which
    # covers max_num_seqs rows; a long prompt now scores that many rows at a time, with the same values.
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=256 * KV, max_num_seqs=4)
    runner = llm.engine.runner
    sizes: list[int] = []
    real_logits = runner.logits

    def recording_logits(hidden, rows):
        sizes.append(len(rows))
        return real_logits(hidden, rows)

    runner.logits = recording_logits
    prompt = prompts[0] * 3
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert len(prompt) > 8 and sizes and max(sizes) <= 4
    assert out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)

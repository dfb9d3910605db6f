"""The native layer loop of decode steps against the model's own Python loop over the same native kernels."""

from __future__ import annotations

import copy

import pytest

from kvd import LLM
from kvd.engine.sampling_params import SamplingParams
from kvd.model.native_decode import NativeDecoder

PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 90)), [200] * 19]  # crossing 16-token blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def _run(folder, native_loop: bool, quantization: str = "int4", max_num_seqs: int = 4):
    llm = LLM(
        str(folder),
        dtype="float32",
        quantization=quantization,
        kv_cache_memory=2**24,
        max_num_seqs=max_num_seqs,
    )
    model = llm.engine.runner.model
    if not native_loop:
        model._native_decoder = False  # the Python layer loop, kernel by kernel
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return outputs, model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # plain; q/k/v biases; q/k norms
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_native_loop_gives_the_python_loops_tokens(tiny_checkpoint, family, quantization):
    folder = tiny_checkpoint(family)
    fused, model = _run(folder, True, quantization)
    assert isinstance(model._native_decoder, NativeDecoder)  # decode steps ran natively
    loop, other = _run(folder, False, quantization)
    assert other._native_decoder is False
    for a, b in zip(fused, loop, strict=True):
        assert a.token_ids == b.token_ids
        # Same kernels, same order; only SiLU and the q/k norms round differently in the last bit.
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(step_a.logprob - step_b.logprob) < 1e-4
            assert [t for t, _ in step_a.top_logprobs] == [t for t, _ in step_b.top_logprobs]


def test_batches_of_one_and_of_many(tiny_checkpoint):
    """One sequence at a time and all at once: decode batches of 1 and of 3 agree with each other."""
    folder = tiny_checkpoint("llama")
    one, _ = _run(folder, True, max_num_seqs=1)
    many, _ = _run(folder, True, max_num_seqs=4)
    assert [o.token_ids for o in one] == [o.token_ids for o in many]


def test_not_used_where_a_piece_has_no_native_kernel(tiny_checkpoint):
    _, model = _run(tiny_checkpoint("llama"), True, quantization="none")  # float linears run in torch
    assert model._native_decoder is False


def test_a_copied_model_binds_its_own(tiny_checkpoint):
    _, model = _run(tiny_checkpoint("llama"), True)
    assert isinstance(model._native_decoder, NativeDecoder)
    clone = copy.deepcopy(model)
    assert clone._native_decoder is None and isinstance(model._native_decoder, NativeDecoder)

"""The native layer loop of decode steps against the model's own Python loop over the same native kernels."""

from __future__ import annotations

import copy

import pytest
import torch

from kvd import LLM
from kvd.model.layers.linear import NATIVE_MAX_ROWS
from kvd.model.layers.quantized_linear import DEQUANTIZE_MIN_ROWS
from kvd.model.native_decode import NativeDecoder
from kvd.request.sampling_params import SamplingParams

PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 90)), [200] * 19]  # crossing 16-token blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def _run(
    folder, native_loop: bool, quantization="int4", max_num_seqs=4, batch_invariant=True, dtype="float32"
):
    llm = LLM(
        str(folder),
        dtype=dtype,
        quantization=quantization,
        kv_cache_memory=2**24,
        max_num_seqs=max_num_seqs,
        batch_invariant=batch_invariant,
    )
    model = llm.engine.runner.model
    if not native_loop:
        model._native_decoder = False  # the Python layer loop, kernel by kernel
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return outputs, model


# plain; q/k/v biases; a sliding-window layer; q/k norms; Gemma 3 (output norms, GELU, two rotary tables); Phi-3
# with half of each head rotated
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_window", "qwen3", "gemma3", "phi3"])
@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", "int4"), ("float32", "int8"), ("bfloat16", "int4"), ("bfloat16", "none")],
)
def test_native_loop_gives_the_python_loops_logits(tiny_checkpoint, family, dtype, quantization):
    """Same kernels in the same order: the same bits, in float32 and in bfloat16 (its K/V pool in bf16)."""
    folder = tiny_checkpoint(family)
    fused, model = _run(folder, True, quantization, dtype=dtype)
    loop, other = _run(folder, False, quantization, dtype=dtype)
    assert other._native_decoder is False
    if dtype == "bfloat16" and quantization == "none" and family.startswith("qwen2"):
        # torch adds a bf16 bias after the kernel rounds: the Python loop runs it.
        assert model._native_decoder is False
    else:
        assert isinstance(model._native_decoder, NativeDecoder)  # decode steps ran natively
        assert model.model.layers[0].self_attn.kv_cache.dtype == getattr(torch, dtype)
    for a, b in zip(fused, loop, strict=True):
        assert a.token_ids == b.token_ids
        assert [s.logprob for s in a.logprobs] == [s.logprob for s in b.logprobs]
        assert [s.top_logprobs for s in a.logprobs] == [s.top_logprobs for s in b.logprobs]


# Gated DeltaNet layers beside gated full attention (Qwen3.5); with experts and a gated shared expert (Qwen3-Next).
# (tests/test_batch_invariance.py runs every hybrid family's scheduling paths through the loop and the Python loop.)
@pytest.mark.parametrize(
    ("family", "dtype", "quantization"),
    [("qwen3_5", "float32", "int4"), ("qwen3_next", "bfloat16", "int8")],
)
def test_hybrid_models_decode_in_the_native_loop(tiny_checkpoint, family, dtype, quantization):
    fused, model = _run(tiny_checkpoint(family), True, quantization, dtype=dtype)
    loop, _ = _run(tiny_checkpoint(family), False, quantization, dtype=dtype)
    assert isinstance(model._native_decoder, NativeDecoder)
    assert any(layer.recurrent for layer in model._native_decoder.layers)
    for a, b in zip(fused, loop, strict=True):
        assert a.token_ids == b.token_ids
        assert [s.logprob for s in a.logprobs] == [s.logprob for s in b.logprobs]


def test_batches_of_one_and_of_many(tiny_checkpoint):
    """One sequence at a time and all at once: decode batches of 1 and of 3 agree with each other. (The prompts
    total fewer than DEQUANTIZE_MIN_ROWS tokens: without batch invariance, a larger prefill step multiplies float
    activations by the dequantized weights, which rounds differently from the int8 activations of a small one;
    tests/test_batch_invariance.py covers every batch shape with it.)"""
    folder = tiny_checkpoint("llama")
    prompts = [[5, 9, 33, 2, 17], list(range(40, 52)), [200] * 9]
    assert sum(map(len, prompts)) < DEQUANTIZE_MIN_ROWS
    outputs = []
    for max_num_seqs in (1, 4):
        llm = LLM(
            str(folder),
            dtype="float32",
            quantization="int4",
            kv_cache_memory=2**24,
            max_num_seqs=max_num_seqs,
        )
        outputs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_float_weights_up_to_the_native_row_limit(tiny_checkpoint):
    """Without batch invariance, float32 linears run natively for small batches and a batch above
    NATIVE_MAX_ROWS goes through the Python loop (torch's matmul), with the same tokens; with it, every batch
    stays native."""
    folder = tiny_checkpoint("qwen3")
    assert _run(folder, True, quantization="none")[1]._native_decoder.max_rows is None
    fused, model = _run(folder, True, quantization="none", batch_invariant=False)
    assert model._native_decoder.max_rows == NATIVE_MAX_ROWS
    loop, _ = _run(folder, False, quantization="none", batch_invariant=False)
    assert [o.token_ids for o in fused] == [o.token_ids for o in loop]
    prompts = [[7 + i, 11, 13] for i in range(NATIVE_MAX_ROWS + 1)]
    llm = LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory=2**24,
        max_num_seqs=NATIVE_MAX_ROWS + 1,
        batch_invariant=False,
    )
    calls = []
    decoder_forward = NativeDecoder.forward
    NativeDecoder.forward = lambda self, hidden, *args: (
        calls.append(hidden.shape[0]) or decoder_forward(self, hidden, *args)
    )
    try:
        wide = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        NativeDecoder.forward = decoder_forward
    # Bound, but every decode step was 17 wide: all of them took the Python loop.
    assert isinstance(llm.engine.runner.model._native_decoder, NativeDecoder) and calls == []
    alone = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert wide[0].token_ids == alone[0].token_ids


def test_not_used_where_a_piece_has_no_native_kernel(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float32", attention_backend="torch", kv_cache_memory=2**24)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not isinstance(llm.engine.runner.model._native_decoder, NativeDecoder)


def test_a_copied_model_binds_its_own(tiny_checkpoint):
    _, model = _run(tiny_checkpoint("llama"), True)
    assert isinstance(model._native_decoder, NativeDecoder)
    clone = copy.deepcopy(model)
    # The copied binding points at the original's buffers: it is not valid for the copy, which binds anew.
    assert model._native_decoder.valid_for(model) and not clone._native_decoder.valid_for(clone)

"""The batched sampler against its definitions: greedy limits, seeds, min-p, penalties and logprobs."""

import pytest
import torch

from kvd.engine.sampler import SamplingRow, sample
from kvd.request.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 50


def _row(
    seed: int | None = None, prompt: list[int] | None = None, output: list[int] | None = None, **kw
) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    prompt = prompt or [1, 2, 3]
    return SamplingRow(SamplingParams(seed=seed, **kw), generator, prompt + (output or []), len(prompt))


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(4)
    out = sample(logits, [_row(temperature=0.0) for _ in range(4)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_degenerate_filters_equal_greedy(kw):
    logits = _logits(8, seed=1)
    for trial in range(5):
        out = sample(logits, [_row(seed=trial, temperature=1.5, **kw) for _ in range(8)])
        assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_ties_rank_by_token_id_in_greedy_the_filters_and_the_top_logprobs():
    """Equal logits rank by token id everywhere: greedy takes the first, top_k=1 and a tiny top_p keep it,
    top_k=2 keeps the first two, and the top logprobs list them in id order."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, [40, 7, 23]] = 2.0  # three tied maxima, the lowest id 7
    greedy = sample(logits, [_row(temperature=0.0, logprobs=3)])[0]
    assert greedy.token_id == 7 and [t for t, _ in greedy.top_logprobs] == [7, 23, 40]
    for seed in range(20):
        assert sample(logits, [_row(seed=seed, temperature=1.0, top_k=1)])[0].token_id == 7
        assert sample(logits, [_row(seed=seed, temperature=1.0, top_p=1e-6)])[0].token_id == 7
    pairs = {sample(logits, [_row(seed=seed, temperature=1.0, top_k=2)])[0].token_id for seed in range(40)}
    assert pairs == {7, 23}


def test_seeded_rows_do_not_depend_on_batch_composition():
    logits = _logits(1, seed=2).repeat(6, 1)
    alone = []
    gen_rows = [_row(seed=7, temperature=1.0) for _ in range(1)]
    for _ in range(10):
        alone.append(sample(logits[:1], gen_rows)[0].token_id)
    mixed = []
    row = _row(seed=7, temperature=1.0)
    for step in range(10):
        others = [_row(temperature=1.0) for _ in range(step % 4)] + [_row(temperature=0.0)]
        batch = [*others, row]
        mixed.append(sample(logits[: len(batch)], batch)[-1].token_id)
    assert alone == mixed
    assert len(set(alone)) > 1, "a seeded sampler at temperature 1 should not be constant over 10 draws"


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-12] * (VOCAB - 3)]))
    row = _row(seed=0, temperature=1.0)
    counts = torch.zeros(VOCAB)
    for _ in range(2000):
        counts[sample(logits, [row])[0].token_id] += 1
    freq = counts[:3] / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_min_p_drops_tokens_below_threshold():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)])
    logits = torch.log(probs.clamp_min(1e-30))
    row = _row(seed=3, temperature=1.0, min_p=0.5)  # keeps tokens with p >= 0.25
    seen = {sample(logits, [row])[0].token_id for _ in range(300)}
    assert seen == {0, 1}


def test_top_k_keeps_k_most_likely():
    logits = _logits(1, seed=4)
    row = _row(seed=5, temperature=2.0, top_k=3)
    seen = {sample(logits, [row])[0].token_id for _ in range(300)}
    assert seen == set(logits[0].topk(3).indices.tolist())


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(3, seed=6)
    rows = [
        _row(temperature=0.0, logprobs=5),
        _row(temperature=0.0),
        _row(seed=1, temperature=0.8, logprobs=2),
    ]
    out = sample(logits, rows)
    ref = logits.log_softmax(-1)
    for i in (0, 2):
        assert out[i].logprob == pytest.approx(ref[i, out[i].token_id].item(), rel=1e-5)
        n = rows[i].params.logprobs
        assert [t for t, _ in out[i].top_logprobs] == ref[i].topk(n).indices.tolist()
        assert [v for _, v in out[i].top_logprobs] == pytest.approx(ref[i].topk(n).values.tolist(), rel=1e-5)
    assert out[1].logprob is None and out[1].top_logprobs is None


def test_penalties_follow_their_definitions():
    # Repetition penalty (prompt and output): positive logits divide, negative ones multiply.
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 5] = 2.0
    logits[0, 8] = 1.0
    assert sample(logits, [_row(temperature=0.0, repetition_penalty=4.0, prompt=[5])])[0].token_id == 8
    assert sample(logits, [_row(temperature=0.0, repetition_penalty=1.5, prompt=[5])])[0].token_id == 5
    logits = torch.full((1, VOCAB), -3.0)
    logits[0, 9] = -1.0
    logits[0, 10] = -2.0
    assert sample(logits, [_row(temperature=0.0, repetition_penalty=3.0, output=[9])])[0].token_id == 10
    # Presence and frequency penalties only count generated tokens.
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    out = sample(logits, [_row(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, output=[7, 7])])
    assert out[0].token_id != 7  # 1.0 - 0.5 - 0.6 < 0
    out = sample(logits, [_row(temperature=0.0, presence_penalty=0.5, prompt=[7])])
    assert out[0].token_id == 7


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("stop", [""]),
        ("logprobs", 99),
        ("repetition_penalty", 0.0),
        ("temperature", "hot"),
        ("seed", True),
        ("stop", 5),
        ("stop_token_ids", 5),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0


def _kept_by_top_p(logits: torch.Tensor, top_p: float) -> int:
    from kvd.engine.sampler import _top_k_top_p

    filtered = _top_k_top_p(logits, [_row(temperature=1.0, top_p=top_p)])
    return int(torch.isfinite(filtered).sum())


def _exact_top_p_size(logits: torch.Tensor, top_p: float) -> int:
    """The smallest number of most likely tokens whose mass reaches top_p, summed in float64 one by one."""
    probs = sorted(logits.double().softmax(-1)[0].tolist(), reverse=True)
    mass = 0.0
    for n, p in enumerate(probs, start=1):
        mass += p
        if mass >= top_p:
            return n
    return len(probs)


@pytest.mark.parametrize("top_p", [0.9, 0.99, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_top_p_over_a_large_vocabulary(top_p):
    # A long tail over a 49k vocabulary, like a real LM's step: a float32 running sum falls short here.
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(11)) * 2.5
    assert _kept_by_top_p(logits, top_p) == _exact_top_p_size(logits, top_p)


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 1e-6])
@pytest.mark.parametrize("top_k", [0, 5])
def test_tiny_temperature_samples_the_argmax(temperature, top_k):
    logits = _logits(4, seed=8) * 10
    out = sample(logits, [_row(seed=i, temperature=temperature, top_k=top_k) for i in range(4)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_extreme_repetition_penalty_is_rejected():
    with pytest.raises(SamplingParamsError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300, temperature=100.0)


def test_strongest_allowed_penalty_at_high_temperature_samples_likely_tokens():
    logits = _logits(1, seed=9) * 10
    row = _row(seed=1, temperature=100.0, repetition_penalty=0.01, prompt=list(range(VOCAB)))
    seen = {sample(logits, [row])[0].token_id for _ in range(200)}
    # Every token was in the prompt, so each is penalised by definition; the samples follow that distribution.
    penalised = torch.where(logits > 0, logits / 0.01, logits * 0.01) / 100.0
    probs = penalised.softmax(-1)[0]
    assert all(probs[t] > 1e-6 for t in seen)

"""Speculative decoding (kvd.engine.speculative): n-gram drafts, verified in the decode step, never change a
request's tokens or logprobs; the KV accounting after rejections; the scheduler's budget and back-off; the
settings, the protocol field, the usage and the metrics through a real daemon and gateway.

The scheduling paths (batched, preempted) in every dtype and model kind are in test_batch_invariance.py."""

from __future__ import annotations

import random
import urllib.request

import openai
import pytest
from gateway_fixtures import gateway_daemon
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import LLM, SamplingParams
from kvd.engine.draft_odds import DraftOdds
from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.engine.ngram import NgramIndex
from kvd_client import DaemonError

PARAGRAPH = (
    "Our team met on Tuesday to discuss the plans for the new office. Everyone agreed that the current space "
    "is too small and that the move should happen before the end of the year. Sarah presented three options "
    "for the new location, and after a long discussion we chose the building near the train station."
)
REWRITE = [{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"}]


# ---- the n-gram index -------------------------------------------------------------------------------------------


def _naive_propose(tokens: list[int], n_min: int, n_max: int, most: int) -> list[int]:
    """The definition: the longest suffix (n_max down to n_min) with an earlier occurrence, and what followed
    its latest one."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n :]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return tokens[e : e + most]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 3),
    most=st.integers(0, 6),
)
def test_the_index_grown_step_by_step_proposes_what_a_full_search_finds(tokens, steps, n_min, extra, most):
    index = NgramIndex(n_min, n_min + extra)
    end = 0
    for step in [*steps, len(tokens)]:
        end = min(len(tokens), end + step)
        assert index.propose(tokens[:end], most) == _naive_propose(tokens[:end], n_min, n_min + extra, most)


def test_the_longest_suffix_wins_and_its_latest_occurrence():
    index = NgramIndex(1, 3)
    # "1 2 3" occurs once followed by 9; "3" alone last occurred followed by 7.
    assert index.propose([1, 2, 3, 9, 3, 7, 4, 1, 2, 3], 2) == [9, 3]
    assert NgramIndex(1, 1).propose([5, 6, 5, 8, 5], 3) == [8, 5]
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of a 2-gram
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 2)


def test_draft_lengths_follow_the_odds():
    odds = DraftOdds()
    assert 0 < odds.length(32) < 32  # the prior: a short draft pays, a long one not yet
    for _ in range(6):
        odds.record(16, 16)  # copying: every draft accepted whole
    assert odds.length(32) == 32 and odds.length(5) == 5
    odds = DraftOdds()
    for _ in range(4):
        odds.record(4, 0)  # diverging: every draft rejected at once
    assert odds.length(32) == 0
    lengths = []
    while not lengths or lengths[-1] == 0:  # drafting nothing, the odds drift back to the prior
        odds.rest()
        lengths.append(odds.length(32))
    assert 1 < len(lengths) < 20 and lengths[-1] <= DraftOdds().length(32)


# ---- the engine: the same tokens, fewer steps ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llms():
    """The bundled model, speculating (drafts of up to 8 tokens) and not."""
    common = {"kv_cache_memory": 2**26, "max_num_seqs": 8}
    return LLM(speculative="ngram", **common), LLM(**common)


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.text == b.text and a.finish_reason == b.finish_reason
    if a.logprobs is not None:
        assert [(t.logprob, t.top_logprobs) for t in a.logprobs] == [
            (t.logprob, t.top_logprobs) for t in b.logprobs
        ]


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=70, logprobs=3),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=70, logprobs=2),
    "penalties": SamplingParams(temperature=0.0, max_tokens=70, repetition_penalty=1.1, presence_penalty=0.3),
    "json schema": SamplingParams(
        temperature=0.0,
        max_tokens=70,
        json_schema={
            "type": "object",
            "properties": {"paragraph": {"type": "string"}},
            "required": ["paragraph"],
        },
    ),
    # "new office" lands inside an accepted run: the text ends before it, as without drafts.
    "stop string": SamplingParams(temperature=0.0, max_tokens=70, stop=["new office"]),
    "max_tokens": SamplingParams(temperature=0.0, max_tokens=13),
}


@pytest.mark.parametrize("case", CASES)
def test_the_same_tokens_and_logprobs_with_drafts_as_without(llms, case):
    spec, plain = llms
    params = CASES[case]
    before = spec.engine.stats()["speculative"]["num_accepted_tokens"]
    got = spec.chat([REWRITE], params, use_tqdm=False)[0]
    want = plain.chat([REWRITE], params, use_tqdm=False)[0]
    _same(got, want)
    assert spec.engine.stats()["speculative"]["num_accepted_tokens"] > before, "no draft was accepted"
    if case == "stop string":
        assert got.finish_reason == "stop" and "new office" not in got.text
    if case == "max_tokens":
        assert len(got.token_ids) == 13 and got.finish_reason == "length"


def test_a_batch_of_requests_with_and_without_drafts(llms):
    """Ten chats at once (above speculative_max_seqs, 8, the step drafts nothing, then as they finish it
    does), a request that opted out among them: every output as alone without drafts."""
    spec, plain = llms
    rng = random.Random(3)
    words = PARAGRAPH.split()
    chats = [
        [{"role": "user", "content": f"Repeat: {' '.join(words[: rng.randrange(10, len(words))])}"}]
        for _ in range(10)
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 5 * i, speculative=i != 2) for i in range(10)]
    got = spec.chat(chats, params, use_tqdm=False)
    want = [plain.chat([c], [p], use_tqdm=False)[0] for c, p in zip(chats, params, strict=True)]
    for a, b in zip(got, want, strict=True):
        _same(a, b)
    spec.engine.block_manager.check_invariants()
    assert spec.engine.block_manager.usage().used_blocks == 0


def test_rejected_drafts_give_their_blocks_back_every_step(llms):
    """Stepping by hand: after each step every sequence holds blocks for its tokens only (a draft's lookahead
    blocks are freed when it is rejected) and the block manager's invariants hold."""
    engine = llms[0].engine
    prompt = engine.apply_chat_template(REWRITE)
    drafted = engine.stats()["speculative"]["num_draft_tokens"]
    for i in range(3):
        engine.add_request(
            f"r{i}", prompt[: len(prompt) - 7 * i], SamplingParams(temperature=0.0, max_tokens=60)
        )
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.check_invariants()
        for request in engine.requests.values():
            seq = request.seq
            assert all(len(table) <= seq.num_blocks for table in seq.block_tables)
    assert engine.stats()["speculative"]["num_draft_tokens"] > drafted
    assert engine.block_manager.usage().used_blocks == 0


def test_a_request_that_opts_out_gets_no_drafts(llms):
    engine = llms[0].engine
    engine.add_request(
        "off", engine.apply_chat_template(REWRITE), SamplingParams(max_tokens=40, speculative=False)
    )
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs
    assert outputs[-1].finished and outputs[-1].num_draft_tokens == 0
    assert all(len(o.new_token_ids) <= 1 for o in outputs)


def test_accepted_tokens_go_out_together_and_are_counted_per_request(llms):
    engine = llms[0].engine
    engine.add_request(
        "on", engine.apply_chat_template(REWRITE), SamplingParams(temperature=0.0, max_tokens=60)
    )
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs
    assert max(len(o.new_token_ids) for o in outputs) > 2  # a step's verified tokens, in one increment
    last = outputs[-1]
    assert 0 < last.num_accepted_tokens <= last.num_draft_tokens
    assert sum(len(o.new_token_ids) for o in outputs) == last.num_output_tokens == 60


def test_drafts_stop_above_the_decodes_it_pays_for():
    """speculative_max_seqs: a step with more decodes drafts nothing; a step's rows never exceed max_num_seqs;
    a draft fits the token budget and the free blocks and never preempts."""
    from kvd.engine.block_manager import BlockManager
    from kvd.engine.scheduler import Scheduler
    from kvd.engine.sequence import Sequence, SequenceStatus

    def drafter(seq, most):
        return [1] * most

    def running(
        n: int, blocks: int = 64, budget: int = 64, max_seqs: int = 16, grow: bool = False
    ) -> Scheduler:
        manager = BlockManager(blocks, 4, True)
        scheduler = Scheduler(manager, max_seqs, budget, drafter=drafter, max_drafting_seqs=2)
        for i in range(n):  # 4 tokens computed, a fifth sampled: the next step decodes it
            seq = Sequence([i + 1, 2, 3, 4] + [5] * (not grow), 4)
            manager.allocate(seq)
            seq.status, seq.num_computed_tokens, seq.num_admitted_tokens = SequenceStatus.RUNNING, 4, 4
            if grow:  # its block table ends at the fourth token: the decode needs a new block
                seq.append_token(5)
            scheduler.running.append(seq)
        return scheduler

    def drafts(scheduler: Scheduler) -> list[int]:
        out = scheduler.schedule()
        assert not out.preempted
        return [len(c.draft) for c in out.chunks]

    assert drafts(running(3)) == [0, 0, 0]  # above max_drafting_seqs
    # Each decode needs a new block and 2 of 4 are free: the drafts come last, from what the decodes left, so
    # the first one's draft takes no block the second's decode needs.
    assert drafts(running(2, blocks=4, grow=True)) == [3, 3]
    assert drafts(running(2)) == [14, 0]  # max_num_seqs 16 rows: 2 decodes and 14 draft rows
    assert drafts(running(2, budget=6)) == [4, 0]  # the token budget: 1 + 4 + 1
    # 2 blocks each (5 tokens in 8 slots), 1 free: the first draft fills its slots and the free block (3 + 4),
    # the second only its own slots.
    assert drafts(running(2, blocks=5)) == [7, 3]


def test_tensor_parallel_ranks_verify_drafts_as_one(llms):
    """TP=2 (the bundled model, its weights sliced per rank): the verify rows cross to the other rank in the
    step's inputs; the tokens and logprobs with drafts are those without (TP=1's differ in the last bits of the
    all-reduce, test_tensor_parallel.py)."""
    from kvd.engine.llm_engine import LLMEngine

    prompt = llms[1].engine.apply_chat_template(REWRITE)
    params = {"temperature": 0.0, "max_tokens": 40, "logprobs": 1}
    engine = LLMEngine(
        speculative="ngram", tensor_parallel_size=2, num_threads=1, kv_cache_memory="16M", max_num_seqs=4
    )
    try:
        runs = {}
        for speculative in (True, False):
            engine.add_request(speculative, prompt, SamplingParams(**params, speculative=speculative))
            outputs = []
            while engine.has_unfinished():
                outputs += engine.step().outputs
            runs[speculative] = [(t.token_id, t.logprob) for o in outputs for t in o.logprobs]
        accepted = engine.stats()["speculative"]["num_accepted_tokens"]
    finally:
        engine.close()
    assert runs[True] == runs[False] and len(runs[True]) == 40 and accepted > 0


def test_settings_are_checked(tiny_checkpoint):
    with pytest.raises(EngineArgsError, match="torch attention"):
        LLM(
            str(tiny_checkpoint("llama")),
            attention_backend="torch",
            speculative="ngram",
            kv_cache_memory=2**24,
        )
    with pytest.raises(EngineArgsError, match="batch invariance"):
        EngineArgs(speculative="ngram", batch_invariant=False)
    with pytest.raises(EngineArgsError, match="ngram_min"):
        EngineArgs(speculative="ngram", ngram_min=5, ngram_max=3)
    with pytest.raises(EngineArgsError, match="speculative must be"):
        EngineArgs(speculative="eagle")
    with pytest.raises(EngineArgsError, match="speculative_tokens"):
        EngineArgs(speculative="ngram", speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative: must be a boolean"):
        SamplingParams(speculative="yes")


# ---- a real daemon and its gateway -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with gateway_daemon(None, tmp_path_factory.mktemp("speculative"), "--speculative", "ngram") as proc:
        yield proc


def test_the_daemon_reports_drafts_and_takes_the_field(daemon):
    with daemon.client() as client:
        info = client.info()
        assert info["speculative"]["method"] == "ngram"
        on = client.chat(REWRITE, max_tokens=50, temperature=0.0, logprobs=1)
        off = client.chat(REWRITE, max_tokens=50, temperature=0.0, logprobs=1, speculative=False)
        assert on.token_ids == off.token_ids and on.logprobs == off.logprobs
        assert 0 < on.usage.accepted_draft_tokens <= on.usage.draft_tokens
        assert off.usage.draft_tokens == 0
        chunks = list(client.stream_chat(REWRITE, max_tokens=50, temperature=0.0))
        assert [t for c in chunks for t in c.token_ids] == on.token_ids
        assert max(len(c.token_ids) for c in chunks) > 1
        with pytest.raises(DaemonError) as e:
            client.chat(REWRITE, max_tokens=5, speculative="yes")
        assert e.value.field == "speculative"
        stats = client.stats()["speculative"]
        assert stats["num_accepted_tokens"] > 0 and stats["mean_accepted_length"] > 0


def test_the_gateway_reports_predictions_and_metrics(daemon):
    oai = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = oai.models.list().data[0].id
    reply = oai.chat.completions.create(model=model, messages=REWRITE, max_tokens=50, temperature=0.0)
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    off = oai.chat.completions.create(
        model=model, messages=REWRITE, max_tokens=50, temperature=0.0, extra_body={"speculative": False}
    )
    assert off.choices[0].message.content == reply.choices[0].message.content
    assert off.usage.completion_tokens_details is None
    with urllib.request.urlopen(f"{daemon.base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    accepted = [
        line for line in text.splitlines() if line.startswith("kvd_speculative_accepted_tokens_total")
    ]
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert reply.usage.completion_tokens == 50

"""Batch invariance: the same request alone, in a batch, chunked, over a cached prefix or after preemption gives
the same tokens and bitwise the same logits rows, in every dtype and quantization, in-process and through the
daemon (docs/architecture.md, "Determinism")."""

from __future__ import annotations

import threading

import pytest
import torch
from daemon_fixtures import start_daemon
from logits_recorder import LogitsRecorder

from kvd import LLM
from kvd.engine.ngram import NgramIndex
from kvd.kernels import cpu_native, native_build
from kvd.request.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="batch invariance on a CPU needs kvd's native kernels (a C compiler)"
)

SHARED = list(range(3, 43))  # 40 tokens: two full 16-token blocks shared by the prompts that start with it
PROMPTS = [
    [7],
    [*SHARED, 50, 51],
    [*SHARED, *range(60, 73)],
    list(range(100, 171)),
    [9, 8, 7, 6, 5],
    [*SHARED[:20], *range(200, 230)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True, logprobs=3)
# Every (dtype, quantization), each on a family that exercises another part of the model; two over an 8-bit KV
# pool.
MODES = [
    ("float32", "none", "qwen3", "auto"),
    ("float32", "int8", "qwen2", "auto"),
    ("float32", "int4", "llama", "auto"),
    ("bfloat16", "none", "qwen2", "auto"),
    ("bfloat16", "int8", "qwen3", "auto"),
    ("bfloat16", "int4", "llama", "auto"),
    ("float32", "none", "llama", "int8"),
    ("bfloat16", "int4", "qwen3", "int8"),
    ("bfloat16", "none", "granite", "auto"),  # the Python layer loop in decode too (multipliers)
    # Sliding-window layers (8 tokens; the prompts are longer): Gemma 3's in the Python layer loop, one of
    # Qwen2's in the native layer loop over an 8-bit pool.
    ("bfloat16", "int4", "gemma3", "auto"),
    ("float32", "int8", "qwen2_window", "int8"),
    # Gemma 4: full and sliding layers of different head sizes in one pool, layers attending others' K/V,
    # per-layer inputs; and full layers whose keys give the values.
    ("float32", "int4", "gemma4", "auto"),
    ("bfloat16", "int8", "gemma4_k_eq_v", "auto"),
    ("float32", "int4", "gemma4_moe", "auto"),  # experts beside the dense MLP
    ("float32", "int4", "olmo2", "auto"),  # no input norms, q/k norms over all heads (the Python loop)
    # Mixtures of experts: tokens that share experts with others and that have one alone, in every format.
    ("float32", "int4", "qwen3_moe", "auto"),
    ("bfloat16", "int8", "gpt_oss", "auto"),
    ("bfloat16", "none", "mixtral", "int8"),
    ("float32", "int8", "qwen2_moe", "auto"),  # a shared expert beside the routed ones
    # Linear attention (Gated DeltaNet) beside gated full attention: recurrent state slots, prefix hits from
    # state checkpoints.
    ("float32", "int4", "qwen3_5", "auto"),
    ("bfloat16", "int8", "qwen3_5", "int8"),
    ("float32", "int4", "qwen3_next", "auto"),  # and a mixture with a shared expert on every layer
    ("bfloat16", "int8", "qwen3_5_moe", "int8"),
]


POOLS = [14, 12, 10]  # KV pools of these many 16-token blocks: small enough to preempt
SPECULATIVE = {"speculative": "ngram", "speculative_tokens": 4, "speculative_max_seqs": 8, "max_num_seqs": 32}


def _params(i: int) -> SamplingParams:
    return SEEDED if i == 4 else GREEDY  # one seeded random request among greedy ones


def _run(folder, dtype, quantization, recorder, *, one_at_a_time=False, warm=False, **engine) -> dict:
    settings = {"kv_cache_memory": 2**24, "max_num_seqs": 8, "enable_prefix_caching": False} | engine
    llm = LLM(folder and str(folder), dtype=dtype, quantization=quantization, **settings)
    if warm:  # the prompts' blocks go into the prefix cache; the run below computes only what is not cached
        llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    recorder.rows.clear()
    params = [_params(i) for i in range(len(PROMPTS))]
    if one_at_a_time:
        outputs = [llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(PROMPTS, params, strict=True)]
    else:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {
        "tokens": [o.token_ids for o in outputs],
        "logprobs": [[(t.logprob, t.top_logprobs) for t in o.logprobs] for o in outputs],
        "logits": dict(recorder.rows),
        "stats": llm.engine.stats(),
    }


def _assert_same(got: dict, want: dict, path: str) -> None:
    assert got["tokens"] == want["tokens"], path
    assert got["logprobs"] == want["logprobs"], path
    assert got["logits"].keys() == want["logits"].keys(), path
    for key, row in got["logits"].items():
        assert torch.equal(row, want["logits"][key]), f"{path}: a logits row differs after {len(key)} tokens"


@pytest.mark.parametrize(("dtype", "quantization", "family", "kv_cache_dtype"), MODES)
def test_every_scheduling_path_gives_the_same_logits(
    tiny_checkpoint, monkeypatch, dtype, quantization, family, kv_cache_dtype
):
    folder = tiny_checkpoint(family)
    recorder = LogitsRecorder(monkeypatch)
    kv = {"kv_cache_dtype": kv_cache_dtype}
    alone = _run(folder, dtype, quantization, recorder, one_at_a_time=True, **kv)
    assert len(alone["logits"]) == len(PROMPTS) * GREEDY.max_tokens
    paths = {
        "batched": {},
        "chunked (8 tokens a step)": {"max_num_seqs": 4, "max_num_batched_tokens": 8},
        "prefix hits": {"enable_prefix_caching": True, "warm": True},
        "preempted": {"kv_cache_memory": None, "num_blocks": POOLS},
        # Drafts verified as extra decode rows, the rows sampled the bits plain decoding gives; batched, and
        # preempted again. The drafts are the requests' own continuations with their third token wrong
        # (random tiny models seldom repeat an n-gram), so that each run accepts and rejects.
        "speculative": SPECULATIVE,
        "speculative, preempted": SPECULATIVE | {"kv_cache_memory": None, "num_blocks": POOLS},
    }
    for path, engine in paths.items():
        # A preempted path runs with the largest of POOLS whose blocks run out (which one does depends on the
        # model's pool and state slots); every run's bits are checked.
        for num_blocks in engine.get("num_blocks", [None]):
            settings = {k: v for k, v in engine.items() if k != "num_blocks"}
            if num_blocks is not None:
                pool_dtype = "int8" if kv_cache_dtype == "int8" else dtype
                settings["kv_cache_memory"] = _pool_bytes(folder, pool_dtype, num_blocks, dtype)
            with monkeypatch.context() as patch:
                if path.startswith("speculative"):
                    patch.setattr(NgramIndex, "propose", _drafts_from(alone["tokens"]))
                got = _run(folder, dtype, quantization, recorder, **settings, **kv)
            _assert_same(got, alone, path)
            if got["stats"]["num_preemptions"]:
                break
        if path == "prefix hits":
            assert got["stats"]["prefix_cache"]["hit_tokens"] > 0
        if path.endswith("preempted"):
            assert got["stats"]["num_preemptions"] > 0
        if path.startswith("speculative"):
            spec = got["stats"]["speculative"]
            assert spec["num_accepted_tokens"] > 0 and spec["num_rejected_tokens"] > 0, path


def _drafts_from(outputs: list[list[int]]):
    """NgramIndex.propose drafting each request's known continuation, its third token changed."""
    texts = [p + o for p, o in zip(PROMPTS, outputs, strict=True)]

    def propose(self, token_ids: list[int], most: int) -> list[int]:
        n = len(token_ids)
        for text in texts:
            if text[:n] == token_ids:
                draft = text[n : n + most]
                if len(draft) > 2:
                    draft[2] ^= 1
                return draft
        return []

    return propose


def _pool_bytes(folder, dtype: str, num_blocks: int, model_dtype: str) -> int:
    """A KV pool of about num_blocks 16-token blocks for the tiny model (small enough to force preemptions), and
    room for a recurrent state per sequence where the model has one."""
    import json

    from kvd.model.config import ModelConfig
    from kvd.model.layers.kv_cache import kv_cache_bytes_per_block
    from kvd.model.layers.recurrent_state import state_bytes_per_slot

    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    per_state = state_bytes_per_slot(config, getattr(torch, model_dtype))
    pool = num_blocks * kv_cache_bytes_per_block(config, 16, getattr(torch, dtype))
    # The engine gives live states up to half the budget (no checkpoints: prefix caching is off here).
    for live in range(8, 0, -1):
        if not per_state or (pool + live * per_state) // 2 // per_state >= live:
            return pool + live * per_state
    return pool + per_state


def test_switched_off_it_says_so(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory=2**24, batch_invariant=False)
    assert llm.engine.info()["batch_invariant"] is False
    info = LLM(str(tiny_checkpoint("llama")), kv_cache_memory=2**24).engine.info()
    assert info["batch_invariant"] is True
    # The kernels' SIMD paths, as the library reports them (the dispatch is at build time, by the CPU's flags).
    assert info["cpu_kernels"] == native_build.isa(native_build.library())


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # a tied table, an lm_head
def test_a_projection_a_quantized_copy_replaces_stays_in_rows(tiny_checkpoint, family):
    """Float32 (packable on every CPU): quantized, the table only looks embeddings up, so it keeps its rows
    (lookups read a packed table 16 rows interleaved); unquantized, the float projection is packed."""
    for quantization, packed in (("int8", False), ("none", True)):
        llm = LLM(
            str(tiny_checkpoint(family)), dtype="float32", quantization=quantization, kv_cache_memory=2**24
        )
        model = llm.engine.runner.model
        assert (model.output_proj is None) == packed
        assert model.float_output().tiles == packed
        out = llm.generate([[5, 6, 7]], [SamplingParams(temperature=0.0, max_tokens=3)], use_tqdm=False)
        assert len(out[0].token_ids) == 3


def test_the_bundled_model_in_its_default_mode(monkeypatch):
    """SmolLM2 as shipped (int4 from its Q4_1 file, the CPU's auto dtype): alone, batched and chunked."""
    recorder = LogitsRecorder(monkeypatch)
    alone = _run(None, "auto", "auto", recorder, one_at_a_time=True)
    batched = _run(None, "auto", "auto", recorder)
    _assert_same(batched, alone, "batched")
    chunked = _run(None, "auto", "auto", recorder, max_num_seqs=4, max_num_batched_tokens=8)
    _assert_same(chunked, alone, "chunked")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_through_the_daemon_with_concurrent_clients(tiny_daemon_model, tmp_path, dtype):
    """Each prompt sent alone, then all at once from four client connections: the same tokens and logprobs."""
    daemon = start_daemon(tmp_path, "--dtype", dtype, "--quantization", "int4", model=tiny_daemon_model)
    try:
        prompts = [p for p in PROMPTS if len(p) > 1]

        def ask(client, prompt):
            out = client.generate(prompt, max_tokens=10, temperature=0.0, logprobs=2)
            return out.token_ids, [(t.logprob, t.top_logprobs) for t in out.logprobs]

        with daemon.client() as client:
            alone = [ask(client, p) for p in prompts]
        together: dict[int, tuple] = {}

        def worker(indices):
            with daemon.client() as client:
                for i in indices:
                    together[i] = ask(client, prompts[i])

        threads = [threading.Thread(target=worker, args=(range(k, len(prompts), 4),)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [together[i] for i in range(len(prompts))] == alone
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_the_cost_benchmark_reports_both_sides(tiny_checkpoint):
    """benchmarks/batch_invariance.py: every workload measured on and off, with the ratio."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    folder = tiny_checkpoint("llama")
    args = ["--model", str(folder), "--modes", "float32:int4", "--num-requests", "2", "--rounds", "1"]
    args += ["--input-len", "8,16", "--output-len", "4,8", "--prefill-len", "40", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.batch_invariance", *args],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (row["dtype"], row["quantization"]) == ("float32", "int4")
    for name in ("throughput_tok_s", "single_stream_tok_s", "prefill_tok_s"):
        on, off = row[name]["on"], row[name]["off"]
        assert on > 0 and off > 0 and row[name]["ratio"] == pytest.approx(on / off, rel=0.01)
    assert proc.stdout.startswith("CPU flags:")

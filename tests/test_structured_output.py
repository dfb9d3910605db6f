"""Structured output, logit_bias and prompt logprobs in the engine: constrained outputs parse and validate, end only
where the grammar accepts, stay the same alone, batched and preempted, and bad grammars are refused by field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvd import LLM
from kvd.engine.llm_engine import RequestRejectedError
from kvd.request.sampling_params import SamplingParams, SamplingParamsError

# float32: the engine's results are compared with each other and with transformers' in float32.
DTYPE = "float32"
KV_BLOCK_BYTES = 8192  # the tiny daemon model's 16-token block in float32

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "boolean"}},
            "required": ["x"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
]
PROMPTS = ["Give me JSON.", "The weather today", "List three colors", "A"]


@pytest.fixture(scope="module")
def llm(tiny_daemon_model) -> LLM:
    return LLM(str(tiny_daemon_model), dtype=DTYPE, kv_cache_memory="16M")


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum-array", "array-of-objects"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "top_k": 50}])
def test_constrained_outputs_parse_and_validate(llm, schema, sampling):
    params = SamplingParams(max_tokens=200, json_schema=schema, **sampling)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        # The canonical separators: one space after ':' and ',', no newlines.
        assert "\n" not in out.text and '":' not in out.text.replace('": ', "")


def test_schema_as_json_text(llm):
    text = json.dumps(SCHEMAS[0])
    out = llm.generate("x", SamplingParams(max_tokens=200, temperature=0, json_schema=text), use_tqdm=False)[
        0
    ]
    jsonschema.validate(json.loads(out.text), SCHEMAS[0])


def test_json_object_on_the_bundled_model():
    # A random model may wander in an unbounded string forever; a real one closes its object. float32 with the
    # file's int4 weights: the same bits on every CPU kind (the AVX2 default; bf16 would differ by CPU).
    llm = LLM(kv_cache_memory="64M", dtype="float32")
    conversation = [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}]
    params = SamplingParams(max_tokens=120, temperature=0, json_object=True)
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_regex_and_lark_grammar(llm):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, regex=r"[0-9]{3}-[a-z]{2,4}")
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text), out.text
        assert out.finish_reason == "stop"
    lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9][0-9]?/'
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, grammar=lark)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert re.fullmatch(r"yes|no|maybe [1-9][0-9]?", out.text), out.text


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    params = SamplingParams(max_tokens=3, temperature=0, json_schema=SCHEMAS[0])
    out = llm.generate("x", params, use_tqdm=False)[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3 and out.text.startswith("{")


def test_end_of_sequence_only_where_the_grammar_accepts(llm):
    # Bias the end-of-sequence token far above everything: it is still sampled only once the output is complete.
    eos = next(iter(llm.engine.eos_token_ids))
    params = SamplingParams(max_tokens=200, temperature=0, logit_bias={eos: 100.0}, json_schema=SCHEMAS[1])
    out = llm.generate("x", params, use_tqdm=False)[0]
    jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    # A complete object takes no further token: it ends there ("stop"), without needing the EOS token.
    assert out.finish_reason == "stop" and eos not in out.token_ids[:-1]
    unconstrained = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0})
    assert llm.generate("x", unconstrained, use_tqdm=False)[0].token_ids == [eos]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMAS[i % 3])
        if i % 2 == 0
        # An unconstrained seeded request between constrained ones, long enough to need preemptions below.
        else SamplingParams(max_tokens=60, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]


def test_constrained_requests_alone_batched_chunked_and_preempted_agree(tiny_daemon_model, llm):
    params = _mixed_params()
    alone = [llm.generate(p, s, use_tqdm=False)[0].token_ids for p, s in zip(PROMPTS, params, strict=True)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == alone
    chunked = LLM(
        str(tiny_daemon_model), dtype=DTYPE, kv_cache_memory="16M", max_num_batched_tokens=8, max_num_seqs=4
    )
    assert [o.token_ids for o in chunked.generate(PROMPTS, params, use_tqdm=False)] == alone
    # A pool of 6 blocks holds any one request but not all of them: requests are preempted and recomputed, and
    # each keeps its grammar's state across the recompute.
    small = LLM(str(tiny_daemon_model), dtype=DTYPE, kv_cache_memory=6 * KV_BLOCK_BYTES)
    assert [o.token_ids for o in small.generate(PROMPTS, params, use_tqdm=False)] == alone
    assert small.engine.stats()["num_preemptions"] > 0


def test_grammars_are_compiled_once(llm):
    before = llm.engine.grammars.num_compiled
    llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0, regex="[ab]{1,9}"), use_tqdm=False)
    llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0, regex="[ab]{1,9}"), use_tqdm=False)
    assert llm.engine.grammars.num_compiled == before + 1


def test_each_tenant_has_its_own_grammar_cache(llm):
    # A cache hit answers faster than a compile: shared, it would tell a tenant what another one asked for.
    params = SamplingParams(max_tokens=5, temperature=0, regex="[cd]{1,7}")
    before = llm.engine.grammars.num_compiled
    for tenant in ("uid:1", "uid:2", "uid:1"):
        assert llm.engine.compile_grammar(params, tenant) is not None
    assert llm.engine.grammars.num_compiled == before + 2


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"json_schema": {"type": 5}}, "json_schema", "type"),
        ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
        (
            {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
            "json_schema",
            "",
        ),
        ({"regex": "[a-"}, "regex", "unclosed character class"),
        # Unsatisfiable: a required property the closed object cannot have.
        (
            {"json_schema": {"type": "object", "properties": {"a": {}}, "required": ["b"]}},
            "json_schema",
            "unsatisfiable",
        ),
        ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "json_schema", ""),
        ({"grammar": "start: missing_rule"}, "grammar", "missing_rule"),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(llm, fields, field, reason):
    with pytest.raises(RequestRejectedError) as e:
        llm.generate("x", SamplingParams(**fields), use_tqdm=False)
    assert e.value.field == field
    assert reason in str(e.value)
    assert not llm.engine.has_unfinished()


def test_structured_fields_are_exclusive_and_typed():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(regex="a", json_object=True)
    assert e.value.field == "regex"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(json_schema=["not", "a", "schema"])
    assert e.value.field == "json_schema"


def test_logit_bias(llm):
    greedy = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids
    banned = SamplingParams(max_tokens=4, temperature=0, logit_bias={greedy[0]: -100.0})
    assert llm.generate("Hello", banned, use_tqdm=False)[0].token_ids[0] != greedy[0]
    forced = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logit_bias={1234: 100.0})
    assert llm.generate("Hello", forced, use_tqdm=False)[0].token_ids == [1234] * 4
    with pytest.raises(RequestRejectedError) as e:
        llm.generate("Hello", SamplingParams(logit_bias={llm.engine.config.vocab_size: 1.0}), use_tqdm=False)
    assert e.value.field == "logit_bias"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias={5: 101.0})
    assert e.value.field == "logit_bias"


def test_prompt_logprobs_match_transformers(tiny_daemon_model, llm):
    import transformers

    prompt = llm.engine.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[
        0
    ]  # would hit the prefix cache, but must not read it
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_daemon_model, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry = entries[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4)
        assert [t for t, _ in entry.top_logprobs] == want[i - 1].topk(3).indices.tolist()


def test_properties_come_in_the_schema_order_and_objects_are_closed(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}}}
    out = llm.generate("x", SamplingParams(max_tokens=60, temperature=0, json_schema=schema), use_tqdm=False)[
        0
    ]
    value = json.loads(out.text)
    # Listed properties only (as OpenAI's strict mode), and in the order the schema gives them.
    assert set(value) <= {"zeta", "alpha"} and out.finish_reason == "stop"
    assert list(value) == [k for k in ("zeta", "alpha") if k in value]
    open_schema = dict(schema, additionalProperties=True)
    compiler = llm.engine.grammars
    strict = compiler.matcher(SamplingParams(json_schema=schema))
    loose = compiler.matcher(SamplingParams(json_schema=open_schema))
    extra = llm.engine.encode('{"other": 1}')
    assert not strict.consume_tokens(extra) and loose.consume_tokens(extra)


def test_an_all_of_of_plain_objects_is_one_closed_object(llm):
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"enum": [1, 2]}}, "required": ["b"]},
        ]
    }
    out = llm.generate("x", SamplingParams(max_tokens=40, temperature=0, json_schema=schema), use_tqdm=False)[
        0
    ]
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert list(value) == ["a", "b"] and out.finish_reason == "stop"


def test_a_huge_schema_is_refused_or_compiled_without_harm(llm):
    # 20,000 properties: llguidance's grammar-size limit refuses it with its reason, and the engine goes on.
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    with pytest.raises(RequestRejectedError) as e:
        llm.generate("x", SamplingParams(max_tokens=4, json_schema=huge), use_tqdm=False)
    assert e.value.field == "json_schema" and str(e.value).count(":") >= 1
    out = llm.generate("x", SamplingParams(max_tokens=4, temperature=0, regex="[ab]+"), use_tqdm=False)[0]
    assert re.fullmatch("[ab]+", out.text)

"""Structured output: grammar compile time, validity of constrained outputs, throughput and mask cost per
token, and llguidance (kvd's) against xgrammar on the same schemas where xgrammar is importable.

    python -m benchmarks.structured_output [--model PATH] [--schemas 20] [--prompts 5] [--rounds 3] [--json]

1. Compile: each schema of benchmarks/schemas.py through a fresh GrammarCompiler (nothing cached; the one-time
   tokenizer build is timed apart), then its first mask (llguidance builds its lexer lazily).
2. Validity: schemas x prompts through `LLM.chat`, greedy and seeded temperature 0.7: the share that parses
   and validates with jsonschema (formats checked); outputs cut by --max-tokens are counted apart.
3. Throughput: --num-requests greedy requests in one `generate`, half with a schema, against all unconstrained
   and against unconstrained ones forced to the constrained run's lengths (the same batch shape), in rotating
   order.
4. Mask cost: real matchers replay the greedy outputs of 2. (valid documents, or the prefixes max_tokens cut)
   over a [rows, vocab] logits tensor: the sampler's time with and without them, and the mask fill alone, per
   constrained row per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

import jsonschema
import llguidance
import torch

from benchmarks.host import cpu_name
from benchmarks.schemas import PROMPTS, SCHEMAS
from kvd import LLM, SamplingParams
from kvd.engine.grammar import JSON_OPTIONS, GrammarCompiler, apply_masks
from kvd.engine.sampler import SamplingRow, sample
from kvd.model.cpu_dtype import cpu_flags

COMPILE_GOAL_P50_MS = 10.0
COMPILE_GOAL_P99_MS = 100.0
THROUGHPUT_GOAL = 0.9
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--schemas", type=int, default=len(SCHEMAS), help="use the first N schemas")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="prompts per schema for validity")
    p.add_argument(
        "--max-tokens", type=int, default=512, help="per validity request (the 60-property object needs ~360)"
    )
    p.add_argument("--num-requests", type=int, default=16, help="concurrent requests of the throughput runs")
    p.add_argument("--throughput-max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="ABAB rounds of the throughput runs")
    p.add_argument("--mask-rows", type=int, default=16)
    p.add_argument("--mask-steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    return p.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values_ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values_ms, 50), 3),
        "p99_ms": round(percentile(values_ms, 99), 3),
        "max_ms": round(max(values_ms), 3),
    }


def first_mask_ms(matcher: llguidance.LLMatcher, vocab: int) -> float:
    words = (vocab + 31) // 32
    bitmask = torch.empty(words, dtype=torch.int32)
    started = time.perf_counter()
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
    return (time.perf_counter() - started) * 1e3


def compile_llguidance(llm: LLM, schemas: list[dict]) -> dict:
    """Cold compile of each schema: a fresh GrammarCompiler each, sharing one tokenizer built beforehand."""
    engine = llm.engine
    vocab = engine.config.vocab_size

    def fresh() -> GrammarCompiler:
        return GrammarCompiler(engine.tokenizer, vocab, engine.eos_token_ids)

    started = time.perf_counter()
    tokenizer = fresh()._llg_tokenizer()
    tokenizer_s = time.perf_counter() - started
    compile_ms, mask_ms = [], []
    for schema in schemas:
        compiler = fresh()
        compiler._tokenizer = tokenizer  # the ~1 s tokenizer build happens once per engine, not per grammar
        started = time.perf_counter()
        matcher = compiler.matcher(SamplingParams(json_schema=schema))
        compile_ms.append((time.perf_counter() - started) * 1e3)
        mask_ms.append(first_mask_ms(matcher, vocab))
    return {
        "library": f"llguidance {llguidance.__version__}",
        "tokenizer_build_s": round(tokenizer_s, 3),
        "compile": spread(compile_ms),
        "first_mask": spread(mask_ms),
        "per_schema_ms": [round(t, 2) for t in compile_ms],
        "goal_met": percentile(compile_ms, 50) < COMPILE_GOAL_P50_MS
        and percentile(compile_ms, 99) < COMPILE_GOAL_P99_MS,
    }


def chat_prompt(name_task_schema: tuple[str, str, dict], template: str) -> list[dict[str, str]]:
    _, task, schema = name_task_schema
    text = template.format(task=task, schema=json.dumps(schema, separators=(",", ":")))
    return [{"role": "user", "content": text}]


def check(text: str, schema: dict) -> str | None:
    """None when `text` is one JSON document valid against `schema` (formats checked), else why not."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(doc, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message}"
    return None


def validity(llm: LLM, cases: list[tuple[str, str, dict]], args: argparse.Namespace) -> tuple[dict, list]:
    """Every (schema, prompt) greedy and at temperature 0.7; returns the figures and the greedy outputs."""
    jobs = [(case, template) for case in cases for template in PROMPTS[: args.prompts]]
    conversations = [chat_prompt(case, template) for case, template in jobs]
    settings = {
        "greedy": [
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, json_schema=c[2]) for c, _ in jobs
        ],
        "t0.7": [
            SamplingParams(temperature=0.7, seed=1000 + i, max_tokens=args.max_tokens, json_schema=c[2])
            for i, (c, _) in enumerate(jobs)
        ],
    }
    result: dict = {"max_tokens": args.max_tokens, "runs": {}}
    documents = []
    for setting, params in settings.items():
        outs = llm.chat(conversations, params, use_tqdm=False)
        valid, invalid, cut = 0, [], []
        for (case, template), out in zip(jobs, outs, strict=True):
            where = f"{case[0]} / prompt {PROMPTS.index(template)}"
            if setting == "greedy":  # the matcher took every token of it: a valid document or its prefix
                documents.append((case[2], out.token_ids))
            if out.finish_reason == "length":
                cut.append(f"{where}: {out.text[-60:]!r}")
                continue
            reason = check(out.text, case[2])
            if reason is None:
                valid += 1
            else:
                invalid.append(f"{where}: {reason}; {out.text[:80]!r}")
        finished = len(outs) - len(cut)
        result["runs"][setting] = {
            "outputs": len(outs),
            "valid": valid,
            "valid_pct_of_finished": round(100 * valid / finished, 1) if finished else None,
            "valid_pct_of_all": round(100 * valid / len(outs), 1),
            "cut_by_length": cut,
            "invalid": invalid,
        }
    return result, documents


def timed_generate(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, list[int]]:
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [len(o.token_ids) for o in outs]


def throughput(llm: LLM, cases: list[tuple[str, str, dict]], args: argparse.Namespace) -> dict:
    """Decode tok/s of n requests, half constrained, against unconstrained ones; the prefill taken off."""
    n, max_tokens = args.num_requests, args.throughput_max_tokens
    picks = [cases[i % len(cases)] for i in range(n)]
    prompts = [
        llm.engine.apply_chat_template(chat_prompt(c, PROMPTS[i % len(PROMPTS)])) for i, c in enumerate(picks)
    ]

    def params(constrained: bool, lengths: list[int] | None = None) -> list[SamplingParams]:
        out = []
        for i, case in enumerate(picks):
            schema = case[2] if constrained and i % 2 == 0 else None
            if lengths is None:
                out.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=schema))
            else:  # the constrained run's length, exactly: the same batch shape step by step
                out.append(SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True))
        return out

    one = [SamplingParams(temperature=0.0, max_tokens=1) for _ in picks]
    timed_generate(llm, prompts, params(True))  # warm-up: the schemas compile here, outside the timings
    _, lengths = timed_generate(llm, prompts, params(True))
    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": [], "same_shape": []}
    tokens: dict[str, int] = {}
    variants = [
        ("constrained", params(True)),
        ("unconstrained", params(False)),
        ("same_shape", params(False, lengths)),
    ]
    for r in range(args.rounds):
        prefill_s, _ = timed_generate(llm, prompts, one)  # no prefix cache: each run recomputes its prompts
        # The order rotates each round, so that a machine speeding up or slowing down favours no run.
        for name, p in variants[r % 3 :] + variants[: r % 3]:
            elapsed, counts = timed_generate(llm, prompts, p)
            tokens[name] = sum(counts)
            # Decode alone: the first tokens come with the prefill, timed apart. On runs too short to tell the
            # two apart (smoke tests) the whole call counts.
            decode_s = elapsed - prefill_s if elapsed > 2 * prefill_s else elapsed
            runs[name].append((sum(counts) - n) / decode_s)
    best = {name: statistics.median(values) for name, values in runs.items()}
    ratio = best["constrained"] / best["unconstrained"]
    same_shape_ratio = best["constrained"] / best["same_shape"]
    return {
        "num_requests": n,
        "constrained_requests": (n + 1) // 2,
        "max_tokens": max_tokens,
        "rounds": args.rounds,
        "tokens": tokens,
        "tok_s": {name: round(v, 1) for name, v in best.items()},
        "runs_tok_s": {name: [round(v, 1) for v in values] for name, values in runs.items()},
        "ratio": round(ratio, 3),
        "same_shape_ratio": round(same_shape_ratio, 3),
        "goal_met": ratio >= THROUGHPUT_GOAL,
    }


class Replay:
    """Rows of matchers walking through valid documents token by token, starting the next one at each end."""

    def __init__(self, documents: list, rows: int, new_matcher) -> None:
        self.documents = documents
        self.new_matcher = new_matcher
        self.next_doc = 0
        self.rejected = 0
        self.rows = [self._start() for _ in range(rows)]

    def _start(self) -> list:
        schema, tokens = self.documents[self.next_doc % len(self.documents)]
        self.next_doc += 1
        return [self.new_matcher(schema), list(tokens), 0]

    def matchers(self) -> list:
        return [row[0] for row in self.rows]

    def advance(self, consume) -> None:
        for i, (matcher, tokens, pos) in enumerate(self.rows):
            # A document ends with its last token, where the matcher stops (end of sequence) or refuses one.
            if pos + 1 >= len(tokens) or not consume(matcher, tokens[pos]):
                if pos + 1 < len(tokens):
                    self.rejected += 1
                self.rows[i] = self._start()
            else:
                self.rows[i][2] = pos + 1


def llguidance_mask_cost(llm: LLM, documents: list, args: argparse.Namespace) -> dict:
    """us per constrained row per step: the sampler with and without matchers, apply_masks, the fill alone."""
    vocab = llm.engine.config.vocab_size
    words = (vocab + 31) // 32
    grammars = llm.engine.grammars
    replay = Replay(documents, args.mask_rows, lambda s: grammars.matcher(SamplingParams(json_schema=s)))
    logits = torch.randn(args.mask_rows, vocab, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0)
    plain_rows = [SamplingRow(params, None, [1], 1) for _ in range(args.mask_rows)]
    rows = list(range(args.mask_rows))
    bitmask = torch.empty((args.mask_rows, words), dtype=torch.int32)
    times = {"sampler_plain": 0.0, "sampler_masked": 0.0, "apply_masks": 0.0, "fill": 0.0}

    def consume(matcher: llguidance.LLMatcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_stopped()

    for _ in range(args.mask_steps):
        matchers = replay.matchers()
        masked_rows = [SamplingRow(params, None, [1], 1, m) for m in matchers]
        started = time.perf_counter()
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
        t1 = time.perf_counter()
        apply_masks(logits.clone(), rows, matchers)
        t2 = time.perf_counter()
        sample(logits, masked_rows)
        t3 = time.perf_counter()
        sample(logits, plain_rows)
        t4 = time.perf_counter()
        times["fill"] += t1 - started
        times["apply_masks"] += t2 - t1
        times["sampler_masked"] += t3 - t2
        times["sampler_plain"] += t4 - t3
        replay.advance(consume)
    per = args.mask_steps * args.mask_rows
    us = {name: round(t / per * 1e6, 1) for name, t in times.items()}
    us["sampler_added"] = round((times["sampler_masked"] - times["sampler_plain"]) / per * 1e6, 1)
    return {
        "rows": args.mask_rows,
        "steps": args.mask_steps,
        "documents": replay.next_doc,
        "us_per_token": us,
    }


def xgrammar_side(llm: LLM, schemas: list[dict], documents: list, args: argparse.Namespace) -> dict:
    """The same compile and mask figures with xgrammar, set to kvd's JSON shape (one line, ', ' and ': ')."""
    try:
        import xgrammar
    except ImportError as e:
        return {"skipped": f"xgrammar is not importable ({e}); install it to compare"}

    engine = llm.engine
    vocab = engine.config.vocab_size
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        engine.tokenizer, vocab_size=vocab, stop_token_ids=sorted(engine.eos_token_ids)
    )
    tokenizer_s = time.perf_counter() - started
    separators = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])

    def compile_schema(compiler, schema: dict, strict: bool = False):
        # kvd compiles the schema's text with sorted keys (its cache key), so properties come in sorted order;
        # xgrammar gets that same text. strict_mode off: JSON Schema's default (and llguidance's) lets objects
        # have other properties too.
        text = json.dumps(schema, sort_keys=True)
        return compiler.compile_json_schema(
            text, any_whitespace=False, separators=separators, strict_mode=strict
        )

    compile_ms, strict_ms, mask_ms = [], [], []
    bitmask = xgrammar.allocate_token_bitmask(args.mask_rows, vocab)
    for schema in schemas:
        started = time.perf_counter()
        compile_schema(xgrammar.GrammarCompiler(info, cache_enabled=False), schema, strict=True)
        strict_ms.append((time.perf_counter() - started) * 1e3)
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        started = time.perf_counter()
        compiled = compile_schema(compiler, schema)
        compile_ms.append((time.perf_counter() - started) * 1e3)
        matcher = xgrammar.GrammarMatcher(compiled)
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        mask_ms.append((time.perf_counter() - started) * 1e3)

    cache: dict[str, object] = {}
    shared = xgrammar.GrammarCompiler(info)

    def new_matcher(schema: dict):
        key = json.dumps(schema, sort_keys=True)
        if key not in cache:
            cache[key] = compile_schema(shared, schema)
        return xgrammar.GrammarMatcher(cache[key])

    def consume(matcher, token: int) -> bool:
        return matcher.accept_token(token) and not matcher.is_terminated()

    replay = Replay(documents, args.mask_rows, new_matcher)
    logits = torch.randn(args.mask_rows, vocab, generator=torch.Generator().manual_seed(0))
    fill_s = apply_s = 0.0
    for _ in range(args.mask_steps):
        matchers = replay.matchers()
        started = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        t1 = time.perf_counter()
        xgrammar.apply_token_bitmask_inplace(logits.clone(), bitmask, backend="cpu")
        t2 = time.perf_counter()
        fill_s += t1 - started
        apply_s += t2 - t1
        replay.advance(consume)
    per = args.mask_steps * args.mask_rows
    return {
        "library": f"xgrammar {version('xgrammar')}",
        "tokenizer_build_s": round(tokenizer_s, 3),
        "compile": spread(compile_ms),
        "compile_strict": spread(strict_ms),
        "first_mask": spread(mask_ms),
        "per_schema_ms": [round(t, 2) for t in compile_ms],
        "us_per_token": {
            "fill": round(fill_s / per * 1e6, 1),
            "fill_and_apply": round((fill_s + apply_s) / per * 1e6, 1),
        },
        "rejected_tokens": replay.rejected,
    }


def report(result: dict) -> None:
    c = result["compile"]
    print(
        f"CPU: {result['cpu']['model']}; flags {' '.join(result['cpu']['isa'])}; threads {result['threads']}"
    )
    print(
        f"1. compile ({c['library']}, {len(c['per_schema_ms'])} schemas, cold): tokenizer build "
        f"{c['tokenizer_build_s']:.3f} s once; p50 {c['compile']['p50_ms']} ms, "
        f"p99 {c['compile']['p99_ms']} ms, "
        f"max {c['compile']['max_ms']} ms; first mask p50 {c['first_mask']['p50_ms']} ms, "
        f"max {c['first_mask']['max_ms']} ms; goal p50 < {COMPILE_GOAL_P50_MS:g} ms, "
        f"p99 < {COMPILE_GOAL_P99_MS:g} ms: {'met' if c['goal_met'] else 'MISSED'}"
    )
    v = result["validity"]
    for setting, run in v["runs"].items():
        print(
            f"2. validity {setting}: {run['valid']}/{run['outputs']} valid "
            f"({run['valid_pct_of_all']} % of all, "
            f"{run['valid_pct_of_finished']} % of finished); {len(run['cut_by_length'])} cut by max_tokens "
            f"{v['max_tokens']}; {len(run['invalid'])} invalid; goal 100 %"
        )
        for line in run["cut_by_length"]:
            print(f"   cut: {line}")
        for line in run["invalid"]:
            print(f"   invalid: {line}")
    t = result["throughput"]
    print(
        f"3. throughput, {t['num_requests']} requests ({t['constrained_requests']} with a schema), "
        f"decode tok/s, median of {t['rounds']}: constrained {t['tok_s']['constrained']}, unconstrained "
        f"{t['tok_s']['unconstrained']} (ratio {t['ratio']}, goal >= {THROUGHPUT_GOAL}: "
        f"{'met' if t['goal_met'] else 'MISSED'}); unconstrained at the constrained lengths "
        f"{t['tok_s']['same_shape']} (ratio {t['same_shape_ratio']}); tokens {t['tokens']}"
    )
    m = result["mask"]["us_per_token"]
    print(
        f"4. mask cost, {result['mask']['rows']} rows x {result['mask']['steps']} steps, us per constrained "
        f"token: fill {m['fill']}, apply_masks (fill + apply) {m['apply_masks']}, sampler added "
        f"{m['sampler_added']} (plain sampler {m['sampler_plain']} per row)"
    )
    x = result["xgrammar"]
    if "skipped" in x:
        print(f"5. xgrammar: skipped: {x['skipped']}")
        return
    print(f"5. {'':24s} {c['library']:>18s} {x['library']:>18s}")
    for label, a, b in (
        ("tokenizer build s", c["tokenizer_build_s"], x["tokenizer_build_s"]),
        ("compile p50 ms", c["compile"]["p50_ms"], x["compile"]["p50_ms"]),
        ("compile p99 ms", c["compile"]["p99_ms"], x["compile"]["p99_ms"]),
        ("compile max ms", c["compile"]["max_ms"], x["compile"]["max_ms"]),
        ("compile p50 ms, strict", "-", x["compile_strict"]["p50_ms"]),
        ("compile p99 ms, strict", "-", x["compile_strict"]["p99_ms"]),
        ("first mask p50 ms", c["first_mask"]["p50_ms"], x["first_mask"]["p50_ms"]),
        ("first mask max ms", c["first_mask"]["max_ms"], x["first_mask"]["max_ms"]),
        ("mask fill us/token", m["fill"], x["us_per_token"]["fill"]),
        ("fill + apply us/token", m["apply_masks"], x["us_per_token"]["fill_and_apply"]),
    ):
        print(f"   {label:24s} {a:>18} {b:>18}")
    print(f"   xgrammar refused {x['rejected_tokens']} replayed tokens that llguidance took")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = SCHEMAS[: args.schemas]
    schemas = [case[2] for case in cases]
    # No prefix cache: the throughput rounds repeat the same prompts, and each must compute them.
    llm = LLM(args.model, enable_prefix_caching=False, kv_cache_memory="512M", max_num_seqs=128)
    flags = cpu_flags()
    result: dict = {
        "cpu": {"model": cpu_name(), "isa": [f for f in ISA if f in flags]},
        "threads": torch.get_num_threads(),
        "compile": compile_llguidance(llm, schemas),
    }
    result["validity"], documents = validity(llm, cases, args)
    result["throughput"] = throughput(llm, cases, args)
    result["mask"] = llguidance_mask_cost(llm, documents, args)
    result["xgrammar"] = xgrammar_side(llm, schemas, documents, args)
    report(result)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

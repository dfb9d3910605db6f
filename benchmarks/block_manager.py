"""Block manager benchmark: the seed's fragmentation table, operation speed, and shared-prefix reuse.

python -m benchmarks.block_manager                      # paged blocks vs contiguous fixed slots (a table)
python -m benchmarks.block_manager --json               # the same as one JSON object (the seed's fields)
python -m benchmarks.block_manager --speed              # median microseconds of the hot paths
python -m benchmarks.block_manager --shared-prefix 32   # prefix-cache hit rate for a shared system prompt
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from kvd.engine.block_manager import BlockManager
from kvd.engine.sequence import Sequence

SEED_REQUEST_TOKENS = (9, 17, 33, 5, 41, 12)
PROMPT_TARGET_US = 1000.0  # allocate + deallocate of a 4,096-token prompt
DECODE_TARGET_US = 300.0  # one decode step (can_append, may_append, cache_filled_block) over 256 sequences


def _allocate_requests(
    block_size: int, total_blocks: int, request_tokens: list[int]
) -> tuple[BlockManager, list[Sequence]]:
    """Allocate one sequence per request; token ids are distinct, so no prefix is shared."""
    manager = BlockManager(total_blocks, block_size)
    seqs = []
    next_token = 0
    for num_tokens in request_tokens:
        seq = Sequence(list(range(next_token, next_token + num_tokens)), block_size)
        next_token += num_tokens
        if not manager.can_allocate(seq):
            raise SystemExit(
                f"{sum(request_tokens)} tokens do not fit in {total_blocks} blocks of {block_size}"
            )
        manager.allocate(seq)
        seqs.append(seq)
    return manager, seqs


def fragmentation_report(block_size: int, total_blocks: int, request_tokens: list[int]) -> dict[str, Any]:
    """The seed's figures: paged-block usage vs one contiguous slot per request sized for the longest."""
    manager, _ = _allocate_requests(block_size, total_blocks, request_tokens)
    usage = manager.usage()
    slot = max(request_tokens)
    baseline_reserved = slot * len(request_tokens)
    baseline_fragmentation = baseline_reserved - sum(request_tokens)
    return {
        "block_size": block_size,
        "request_tokens": list(request_tokens),
        "block_usage": {
            "allocated_tokens": usage.allocated_tokens,
            "reserved_tokens": usage.reserved_tokens,
            "internal_fragmentation_tokens": usage.internal_fragmentation_tokens,
            "block_utilization": usage.block_utilization,
            "used_blocks": usage.used_blocks,
            "free_blocks": usage.free_blocks,
        },
        "contiguous_fixed_slot_baseline": {
            "reserved_tokens": baseline_reserved,
            "internal_fragmentation_tokens": baseline_fragmentation,
            "utilization": sum(request_tokens) / baseline_reserved,
        },
        "fragmentation_tokens_saved_vs_contiguous": baseline_fragmentation
        - usage.internal_fragmentation_tokens,
    }


def _request_name(i: int, n: int) -> str:
    return string.ascii_uppercase[i] if n <= len(string.ascii_uppercase) else str(i + 1)


def render_fragmentation(block_size: int, total_blocks: int, request_tokens: list[int]) -> str:
    report = fragmentation_report(block_size, total_blocks, request_tokens)
    _, seqs = _allocate_requests(block_size, total_blocks, request_tokens)
    paged, fixed = report["block_usage"], report["contiguous_fixed_slot_baseline"]
    saved = report["fragmentation_tokens_saved_vs_contiguous"]
    slot = max(request_tokens)
    row = "{:>8} {:>7} | {:>7} {:>9} {:>7} {:>8} | {:>9} {:>7} {:>8}"
    header = row.format(
        "request", "tokens", "blocks", "reserved", "wasted", "util", "reserved", "wasted", "util"
    )
    rule = "-" * len(header)
    lines = [
        f"Paged KV blocks vs contiguous fixed slots: block size {block_size}, pool of {total_blocks} blocks,",
        f"{len(request_tokens)} requests; a fixed slot holds the longest request ({slot} tokens).",
        "",
        f"{'':17}| {'paged blocks':^35} | {'contiguous fixed slot':^26}".rstrip(),
        header,
        rule,
    ]
    for i, seq in enumerate(seqs):
        reserved = len(seq.block_table) * block_size
        lines.append(
            row.format(
                _request_name(i, len(seqs)),
                len(seq),
                len(seq.block_table),
                reserved,
                reserved - len(seq),
                _percent(len(seq) / reserved),
                slot,
                slot - len(seq),
                _percent(len(seq) / slot),
            )
        )
    lines += [
        rule,
        row.format(
            "total",
            paged["allocated_tokens"],
            paged["used_blocks"],
            paged["reserved_tokens"],
            paged["internal_fragmentation_tokens"],
            _percent(paged["block_utilization"]),
            fixed["reserved_tokens"],
            fixed["internal_fragmentation_tokens"],
            _percent(fixed["utilization"]),
        ),
        "",
        f"pool: {paged['used_blocks']} blocks used, {paged['free_blocks']} free",
        f"internal fragmentation: {paged['internal_fragmentation_tokens']} tokens paged vs "
        f"{fixed['internal_fragmentation_tokens']} contiguous, "
        f"{saved} tokens saved ({saved / fixed['internal_fragmentation_tokens']:.1%} less)",
    ]
    return "\n".join(lines)


def _percent(fraction: float) -> str:
    """One decimal, halves rounded up as the seed article's tables do (9/16 is 56.3%, not 56.2%)."""
    value = Decimal(repr(round(fraction * 100, 9))).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    return f"{value}%"


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32_000) for _ in range(n)]


def _prefill(manager: BlockManager, seq: Sequence) -> None:
    """What the engine does for a prompt: admit it, compute it, offer its full blocks to later requests."""
    if not manager.can_allocate(seq):
        raise RuntimeError("benchmark pool too small")
    manager.allocate(seq)
    seq.num_computed_tokens = len(seq)
    manager.cache_computed_blocks(seq)


def _time_prompt(manager: BlockManager, seq: Sequence) -> tuple[float, float]:
    """Microseconds to (prefill-allocate, deallocate) one sequence."""
    t0 = time.perf_counter_ns()
    _prefill(manager, seq)
    t1 = time.perf_counter_ns()
    manager.deallocate(seq)
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1e3, (t2 - t1) / 1e3


def _medians(samples: list[tuple[float, float]]) -> dict[str, float]:
    alloc = statistics.median(s[0] for s in samples)
    free = statistics.median(s[1] for s in samples)
    total = statistics.median(s[0] + s[1] for s in samples)
    return {"allocate": alloc, "deallocate": free, "total": total}


def _prompt_speed(block_size: int, prompt_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    rng = random.Random(0)
    prompt_blocks = -(-prompt_tokens // block_size)
    cached_prompt = _random_tokens(rng, prompt_tokens)
    cached = BlockManager(2 * prompt_blocks, block_size)
    _time_prompt(cached, Sequence(cached_prompt, block_size))
    # Every block of a new prompt evicts a cached one: the pool holds nothing but two earlier prompts.
    evicting = BlockManager(2 * prompt_blocks, block_size)
    for _ in range(2):
        _time_prompt(evicting, Sequence(_random_tokens(rng, prompt_tokens), block_size))
    samples: dict[str, list[tuple[float, float]]] = {
        "cold": [],
        "cold_evicting": [],
        "cached": [],
        "cold_no_prefix_caching": [],
    }
    # The scenarios alternate inside each repeat, so machine noise hits them alike.
    for _ in range(repeats):
        prompt = _random_tokens(rng, prompt_tokens)
        for name, manager in (
            ("cold", BlockManager(prompt_blocks, block_size)),
            ("cold_no_prefix_caching", BlockManager(prompt_blocks, block_size, enable_prefix_caching=False)),
            ("cold_evicting", evicting),
            ("cached", cached),
        ):
            tokens = cached_prompt if name == "cached" else prompt
            samples[name].append(_time_prompt(manager, Sequence(tokens, block_size)))
    medians = {name: _medians(s) for name, s in samples.items()}
    # What each scenario did, per timed prompt: the labels promise all-but-one hits and one eviction a block.
    medians["cached"]["hit_tokens"] = cached.prefix_cache_stats().hit_tokens / repeats  # warm-up: no hits
    medians["cold_evicting"]["evictions"] = evicting.prefix_cache_stats().evictions / repeats
    return medians


def _decode_speed(block_size: int, num_seqs: int, steps: int) -> dict[str, float]:
    """Median microseconds per decode step over `num_seqs` running sequences of staggered lengths."""
    rng = random.Random(1)
    prompts = [_random_tokens(rng, rng.randrange(64, 1024)) for _ in range(num_seqs)]
    capacity = sum(-(-(len(p) + steps) // block_size) for p in prompts)
    runs: dict[str, tuple[BlockManager, list[Sequence]]] = {}
    for name, caching in (("append", True), ("append_no_prefix_caching", False)):
        manager = BlockManager(capacity, block_size, enable_prefix_caching=caching)
        seqs = [Sequence(p, block_size) for p in prompts]
        for seq in seqs:
            _prefill(manager, seq)
        runs[name] = manager, seqs
    step_us: dict[str, list[float]] = {
        "append": [],
        "append_no_prefix_caching": [],
        "cache_computed_blocks": [],
    }
    for step in range(steps):
        for name, (manager, seqs) in runs.items():
            for seq in seqs:
                seq.append_token(step)
            can_append, may_append = manager.can_append, manager.may_append
            cache_filled_block = manager.cache_filled_block
            t0 = time.perf_counter_ns()
            for seq in seqs:
                if not can_append(seq):
                    raise RuntimeError("benchmark pool too small")
                may_append(seq)
                cache_filled_block(seq)
            t1 = time.perf_counter_ns()
            for seq in seqs:  # the forward pass computed each sequence's last token
                seq.num_computed_tokens = len(seq)
            cache_computed_blocks = manager.cache_computed_blocks
            t2 = time.perf_counter_ns()
            for seq in seqs:
                cache_computed_blocks(seq)
            t3 = time.perf_counter_ns()
            step_us[name].append((t1 - t0) / 1e3)
            if name == "append":
                step_us["cache_computed_blocks"].append((t3 - t2) / 1e3)
    return {name: statistics.median(s) for name, s in step_us.items()}


def speed_report(block_size: int = 16, prompt_tokens: int = 4096, num_seqs: int = 256, repeats: int = 50):
    return {
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "prompt_us": _prompt_speed(block_size, prompt_tokens, repeats),
        "decode_num_seqs": num_seqs,
        "decode_step_us": _decode_speed(block_size, num_seqs, steps=repeats * 4),
        "targets_us": {"prompt": PROMPT_TARGET_US, "decode_step": DECODE_TARGET_US},
    }


def render_speed(report: dict[str, Any]) -> str:
    prompt, decode = report["prompt_us"], report["decode_step_us"]
    peer = prompt["cold_no_prefix_caching"]["total"]
    row = "{:<44} {:>9} {:>10} {:>9} {:>8} {:>10}"
    lines = [
        f"Block manager speed, block size {report['block_size']}: median microseconds over "
        f"{report['repeats']} runs (lower is better)",
        "",
        row.format(
            f"{report['prompt_tokens']}-token prompt", "allocate", "deallocate", "total", "target", "vs peer"
        ),
    ]
    labels = {
        "cold": "cold (free pool)",
        "cold_evicting": "cold (every block evicts an LRU cached one)",
        "cached": "fully cached (all but the last block hit)",
        "cold_no_prefix_caching": "peer: cold, prefix caching off",
    }
    for name, label in labels.items():
        t = prompt[name]
        lines.append(
            row.format(
                label,
                f"{t['allocate']:.0f}",
                f"{t['deallocate']:.0f}",
                f"{t['total']:.0f}",
                f"<{PROMPT_TARGET_US:.0f}",
                f"x{t['total'] / peer:.2f}",
            )
        )
    row = "{:<44} {:>9} {:>8} {:>10}"
    lines += [
        "",
        row.format(f"decode step, {report['decode_num_seqs']} sequences", "per step", "target", "vs peer"),
        row.format(
            "can_append + may_append + cache_filled_block",
            f"{decode['append']:.0f}",
            f"<{DECODE_TARGET_US:.0f}",
            f"x{decode['append'] / decode['append_no_prefix_caching']:.2f}",
        ),
        row.format("peer: the same, prefix caching off", f"{decode['append_no_prefix_caching']:.0f}", "", ""),
        row.format(
            "then cache_computed_blocks (postprocess)",
            f"{decode['cache_computed_blocks']:.0f}",
            "",
            "",
        ),
        "",
        "allocate = can_allocate + allocate + cache_computed_blocks (which hashes and registers the blocks)",
    ]
    return "\n".join(line.rstrip() for line in lines)


def shared_prefix_report(
    num_requests: int, prefix_tokens: int = 1024, suffix_tokens: int = 128, block_size: int = 16
) -> dict[str, Any]:
    """`num_requests` concurrent requests: one shared system prompt, then a distinct user part each."""
    rng = random.Random(2)
    system = _random_tokens(rng, prefix_tokens)
    seqs = [Sequence(system + _random_tokens(rng, suffix_tokens), block_size) for _ in range(num_requests)]
    blocks_without_cache = sum(seq.num_blocks for seq in seqs)
    manager = BlockManager(blocks_without_cache, block_size)
    for seq in seqs:
        _prefill(manager, seq)
    stats, usage = manager.prefix_cache_stats(), manager.usage()
    return {
        "requests": num_requests,
        "prefix_tokens": prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "block_size": block_size,
        "queried_tokens": stats.queried_tokens,
        "hit_tokens": stats.hit_tokens,
        "hit_rate": stats.hit_rate,
        "used_blocks": usage.used_blocks,
        "blocks_without_prefix_cache": blocks_without_cache,
        "blocks_saved": blocks_without_cache - usage.used_blocks,
    }


def render_shared_prefix(report: dict[str, Any]) -> str:
    saved, without = report["blocks_saved"], report["blocks_without_prefix_cache"]
    return "\n".join(
        [
            f"{report['requests']} concurrent requests: a shared {report['prefix_tokens']}-token system "
            f"prompt + {report['suffix_tokens']} distinct tokens each, block size {report['block_size']}",
            f"  prefix cache hit rate: {report['hit_rate']:.1%} "
            f"({report['hit_tokens']} of {report['queried_tokens']} prompt tokens)",
            f"  blocks used: {report['used_blocks']} instead of {without}: "
            f"{saved} saved ({saved / without:.1%})",
        ]
    )


def _token_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("expected positive token counts separated by commas, e.g. 9,17,33")
    return counts


def main(argv: list[str] | None = None, out: Callable[[str], Any] = print) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.block_manager", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--total-blocks", type=int, default=64)
    parser.add_argument("--request-tokens", type=_token_counts, default=list(SEED_REQUEST_TOKENS))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--speed", action="store_true", help="time allocate/deallocate and decode steps")
    parser.add_argument("--repeats", type=int, default=50, help="--speed: runs per figure")
    parser.add_argument("--shared-prefix", type=int, metavar="N", help="N requests sharing a system prompt")
    parser.add_argument(
        "--prefix-tokens", type=int, default=1024, help="--shared-prefix: system prompt tokens"
    )
    parser.add_argument(
        "--suffix-tokens", type=int, default=128, help="--shared-prefix: distinct tokens each"
    )
    args = parser.parse_args(argv)
    if args.block_size < 1 or args.total_blocks < 1:
        parser.error("--block-size and --total-blocks must be >= 1")
    if args.shared_prefix is not None and args.shared_prefix < 1:
        parser.error("--shared-prefix needs at least 1 request")

    results: dict[str, tuple[dict[str, Any], Callable[[], str]]] = {}
    if args.speed:
        speed = speed_report(args.block_size, repeats=args.repeats)
        results["speed"] = speed, lambda: render_speed(speed)
    if args.shared_prefix is not None:
        shared = shared_prefix_report(
            args.shared_prefix, args.prefix_tokens, args.suffix_tokens, args.block_size
        )
        results["shared_prefix"] = shared, lambda: render_shared_prefix(shared)
    if not results:
        fragmentation = fragmentation_report(args.block_size, args.total_blocks, args.request_tokens)
        results["fragmentation"] = (
            fragmentation,
            lambda: render_fragmentation(args.block_size, args.total_blocks, args.request_tokens),
        )
    if args.json:
        reports = {name: report for name, (report, _) in results.items()}
        out(json.dumps(reports.popitem()[1] if len(reports) == 1 else reports, indent=2, sort_keys=True))
    else:
        out("\n\n".join(render() for _, render in results.values()))


if __name__ == "__main__":
    main()

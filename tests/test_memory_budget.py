"""One memory budget (--memory) for every loaded model's weights and KV pool: an engine sizes its pool from what the
budget leaves after its weights (or refuses an explicit pool that does not fit, naming the bytes), and a daemon
unloads the least recently used idle models to load another within it, or answers `overloaded` naming the bytes
a model needs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from daemon_fixtures import start_daemon
from tiny_models import save_tiny_llama

from kvd import LLM
from kvd.engine.engine_args import parse_size
from kvd.engine.errors import MemoryBudgetError
from kvd_client import Client, OverloadedError

HI = [{"role": "user", "content": "Hi"}]
POOL = "32M"  # each model's explicit pool; with its ~0.5 MB of weights two models fit the daemon's budget, not three
BUDGET = "80M"


def test_an_engine_takes_its_pool_from_what_the_budget_leaves(tmp_path: Path):
    folder = save_tiny_llama(tmp_path / "m")
    llm = LLM(str(folder), dtype="float32", memory="8M", kv_cache_memory_fraction=0.5)
    engine = llm.engine
    left = parse_size("8M") - engine.weight_bytes
    assert engine.weight_bytes + engine.kv_cache_bytes <= parse_size("8M")
    assert (
        left // 2 - engine.kv_cache_bytes < 2 * engine.kv_cache_bytes // engine.num_blocks
    )  # within a block
    assert engine.info()["kv_cache_bytes"] == engine.kv_cache_bytes
    with pytest.raises(MemoryBudgetError, match="raise --memory or lower --kv-cache-memory") as e:
        LLM(str(folder), dtype="float32", memory="1M", kv_cache_memory="1M")
    assert e.value.field == "memory" and e.value.needed > parse_size("1M")


def test_a_tight_budget_still_gives_a_pool_of_two_blocks(tmp_path: Path):
    """The fraction of a budget the weights nearly fill is less than two blocks: the pool takes two where they
    fit."""
    folder = save_tiny_llama(tmp_path / "m")
    probe = LLM(str(folder), dtype="float32", kv_cache_memory="1M").engine
    per_block = probe.kv_cache_bytes // (probe.num_blocks + 1)
    tight = probe.weight_bytes + 4 * per_block
    engine = LLM(str(folder), dtype="float32", memory=tight).engine
    assert engine.num_blocks == 2 and engine.weight_bytes + engine.kv_cache_bytes <= tight


def test_loads_at_once_each_get_what_the_others_leave(tmp_path: Path):
    """Two first requests for two models at once: the loads run one after the other, each sized from what the
    budget has left when it starts (pools from the fraction), and both serve within the budget."""
    folder = tmp_path / "models"
    flags = []
    for i, name in enumerate(("a", "b", "c")):
        save_tiny_llama(folder / name, seed=i)
        flags += ["--model", f"{name}={folder / name}"]
    cmd = ["--memory", "4M", "--kv-cache-memory-fraction", "0.5"]
    daemon = start_daemon(tmp_path, *flags, *cmd, kv_cache_memory=None)
    try:
        replies: dict[str, list[int]] = {}
        threads = [threading.Thread(target=_chat, args=(daemon, name, replies)) for name in ("b", "c")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert set(replies) == {"b", "c"} and all(replies.values())
        with daemon.client() as kvd:
            sizes = {m["name"]: m["bytes"] for m in kvd.list_models() if m["loaded"]}
        assert set(sizes) == {"a", "b", "c"} and sum(sizes.values()) <= parse_size("4M")
    finally:
        assert daemon.stop() == 0, daemon.log()


def _chat(daemon, model: str, replies: dict[str, list[int]]) -> None:
    with daemon.client(timeout=120) as client:
        replies[model] = client.chat(HI, model=model, max_tokens=2).token_ids


def test_models_share_the_budget_and_idle_ones_make_room(tmp_path: Path):
    folder = tmp_path / "models"
    flags = []
    for i, name in enumerate(("a", "b", "c")):
        save_tiny_llama(folder / name, seed=i)
        flags += ["--model", f"{name}={folder / name}"]
    daemon = start_daemon(tmp_path, *flags, "--memory", BUDGET, kv_cache_memory=POOL)
    try:
        with daemon.client(timeout=60) as kvd:
            assert _loaded(kvd) == {"a"}  # the first, pinned
            kvd.chat(HI, model="b", max_tokens=2)
            assert _loaded(kvd) == {"a", "b"}
            sizes = {m["name"]: m["bytes"] for m in kvd.list_models() if m["loaded"]}
            assert all(parse_size(POOL) < size < 2 * parse_size(POOL) for size in sizes.values())
            assert sum(sizes.values()) <= parse_size(BUDGET)
            # Unloading gives back what the budget counted for it, as the process's resident memory shows. (The
            # first pool freed: glibc maps a block this large on its own and unmaps it when freed; after that it
            # may keep such blocks in its heap for reuse. The budget counts weights and pools, not the step
            # buffers a model that ran long contexts holds beside them.)
            before = _resident_bytes(daemon)
            assert kvd.unload("b") and _loaded(kvd) == {"a"}
            returned = before - _resident_bytes(daemon)
            assert abs(returned - sizes["b"]) < 0.1 * sizes["b"], (returned, sizes["b"])
            kvd.chat(HI, model="b", max_tokens=2)  # loaded again
            kvd.chat(HI, model="c", max_tokens=2)  # no room for a third: b, idle and not pinned, unloads
            assert _loaded(kvd) == {"a", "c"}
            sizes_now = {m["name"]: m["bytes"] for m in kvd.list_models() if m["loaded"]}
            assert sum(sizes_now.values()) <= parse_size(BUDGET)
            # c busy and a pinned: b, whose size its first load told, cannot be placed.
            streaming, done = threading.Event(), threading.Event()
            thread = threading.Thread(target=_stream, args=(daemon, streaming, done))
            thread.start()
            try:
                assert streaming.wait(60)
                with pytest.raises(OverloadedError) as e:
                    kvd.chat(HI, model="b", max_tokens=2)
                assert e.value.field == "model" and f"needs {sizes['b']} bytes" in e.value.message
                assert _loaded(kvd) == {"a", "c"}
            finally:
                done.set()
                thread.join(60)
        assert "unloaded" in daemon.log()
    finally:
        assert daemon.stop() == 0, daemon.log()


def _stream(daemon, streaming: threading.Event, done: threading.Event) -> None:
    with daemon.client(timeout=60) as client:
        for _ in client.stream_chat(HI, model="c", max_tokens=3000, ignore_eos=True):
            streaming.set()
            if done.is_set():
                break


def _loaded(kvd: Client) -> set[str]:
    return {m["name"] for m in kvd.list_models() if m["loaded"]}


def _resident_bytes(daemon) -> int:
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))

"""Tensor parallel over gloo with 2 real ranks: TP=2 gives TP=1's greedy tokens (logits within 1e-5, the
all-reduce sums in another order) on every family and the bundled SmolLM2, through batched, chunked, prefix-hit
and preempted steps and through the daemon; each rank holds half the weights; a killed worker fails every
request and ends the daemon; startup mistakes are one line; the rendezvous binds only its address, and a rank
that cannot prove the group's secret neither joins nor poses as rank 0 (docs/architecture.md, "Tensor
parallel")."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import pytest
import torch
from daemon_fixtures import REPO, daemon_env, start_daemon, wait_ready
from logits_recorder import LogitsRecorder

from kvd.distributed.shard import Shard, ShardPlan
from kvd.distributed.step import StepInputs
from kvd.engine.llm_engine import LLMEngine
from kvd.kernels import cpu_native
from kvd.model.config import ModelConfig
from kvd.parallel import group, handshake
from kvd.parallel.address import INTERFACE_VARIABLES, free_loopback_port, interface_of, pin_interfaces
from kvd.parallel.cpu_binding import format_cpulist, parse_cpulist
from kvd.parallel.errors import DistributedStartupError
from kvd.parallel.secret import read_secret_file
from kvd.parallel.wire import recv_frame, send_frame
from kvd.request.sampling_params import SamplingParams
from kvd_client import KvdError

SHARED = list(range(3, 43))  # two full 16-token blocks that later prompts hit in the prefix cache
PROMPTS = [[7], [*SHARED, 50, 51], [*SHARED, *range(60, 73)], list(range(100, 171)), [9, 8, 7, 6, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Small budgets: the 71-token prompt is chunked, and 12 blocks of 16 tokens cannot hold every sequence, so some
# are preempted and recomputed.
ENGINE = dict(dtype="float32", num_threads=1, max_num_seqs=4, max_num_batched_tokens=32)


def _engine(model: Path | None, tp: int, blocks: int | None = 12, **kw: object) -> LLMEngine:
    """An engine whose pool has `blocks` blocks at any TP size (each rank's block holds its KV heads only)."""
    engine_kw = ENGINE | kw
    if blocks is not None:
        from kvd.model.layers.kv_cache import kv_cache_bytes_per_block
        from kvd.model.loader import _open_folder, _open_gguf

        opened = _open_gguf(model) if model.suffix == ".gguf" else _open_folder(model)
        config = ModelConfig.from_hf_dict(opened.hf_config)
        local = ShardPlan(config, Shard(0, tp)).local_config()
        pool = torch.int8 if engine_kw.get("kv_cache_dtype") == "int8" else torch.float32
        engine_kw["kv_cache_memory"] = blocks * kv_cache_bytes_per_block(local, 16, pool)
    return LLMEngine(model=None if model is None else str(model), tensor_parallel_size=tp, **engine_kw)


def _generate(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in range(len(prompts))]


def _close_rows(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, row in got.items():
        torch.testing.assert_close(row, want[key], rtol=1e-5, atol=1e-5 * want[key].abs().max().item())


@pytest.mark.skipif(not cpu_native.available(), reason="batch invariance needs kvd's native kernels")
@pytest.mark.parametrize(
    ("family", "quantization", "kv_cache_dtype"),
    [
        *((f, "none", "auto") for f in ("llama", "llama3_rope", "linear_rope", "mistral", "qwen2", "qwen3")),
        ("gemma3", "none", "auto"),  # sliding-window layers, their own RoPE base, output norms on shards
        ("phi3_long", "none", "auto"),  # fused checkpoint tensors cut into Llama's, then sliced per rank
        ("llama", "int4", "auto"),  # the native quantized kernels on shards
        ("qwen2", "int8", "auto"),
        ("qwen3", "none", "int8"),  # every rank's pool in 8 bits: the plan carries the pool's dtype
        ("gguf", "gguf", "auto"),  # a GGUF file of mixed types, each rank's slice in its file types
        # Mixtures of experts: each rank a slice of every expert; float, then quantized with gpt-oss's biases.
        ("qwen3_moe", "none", "auto"),
        ("gpt_oss", "int8", "auto"),
        ("qwen2_moe", "none", "auto"),  # its shared expert sliced as a dense MLP
        ("gguf_moe", "gguf", "auto"),  # a Qwen3-MoE file's stacked K-quant experts, each rank a slice of each
    ],
)
def test_tp2_gives_tp1_tokens_through_every_scheduling_path_and_stays_batch_invariant(
    tiny_checkpoint, tmp_path, monkeypatch, family, quantization, kv_cache_dtype
):
    """Float weights and pool: logits within 1e-5 of TP=1's. Quantized weights or pool: the kernels quantize
    activations (or queries) to int8, where a last-bit difference of the all-reduce can cross a step, so only the
    tokens are compared. The GGUF file's q/k/v, gate/up and vocabulary rows are cut in any type, o's columns (two
    heads of 64 a rank) on 32-value blocks, down's (256 a rank) on Q4_K super-blocks and Q4_0 blocks."""
    if family == "gguf":
        from test_gguf_native import SHAPE, TYPES
        from test_loader import tiny_hf_model, write_tiny_gguf

        folder = tmp_path / "tiny-mixed.gguf"
        # o's columns whole blocks (test_gguf_native checks the columns that are not, which round otherwise).
        types = TYPES | {"blk.0.attn_output.weight": gguf.GGMLQuantizationType.Q5_1}
        write_tiny_gguf(tiny_hf_model("qwen2", **SHAPE), folder, tensor_types=types)
    elif family == "gguf_moe":
        from test_moe import EXPERT_TYPES, _moe_gguf

        # Experts 512 wide: each rank's 256 columns of down are whole super-blocks.
        _, folder = _moe_gguf("qwen3moe", tmp_path, EXPERT_TYPES, moe_intermediate_size=512)
    else:
        folder = tiny_checkpoint(family)
    recorder = LogitsRecorder(monkeypatch)
    # Gemma 3's and gpt-oss's sliding layer frees the blocks behind its window: a smaller pool still preempts.
    kw = {
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "blocks": 7 if family in ("gemma3", "gpt_oss") else 12,
    }
    single = _engine(folder, 1, **kw)
    want = _generate(single, PROMPTS)
    want_rows = dict(recorder.rows)
    recorder.rows.clear()
    engine = _engine(folder, 2, **kw)
    try:
        got = _generate(engine, PROMPTS)
        got_rows = dict(recorder.rows)
        stats = engine.stats()
        # Within TP=2, a request alone gives bitwise the logits it had in the batch (chunked, preempted).
        recorder.rows.clear()
        for prompt in PROMPTS:
            _generate(engine, [prompt])
        alone = dict(recorder.rows)
    finally:
        engine.close()
    assert got == want
    assert stats["num_preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0, stats
    if quantization == "none" and kv_cache_dtype == "auto":
        _close_rows(got_rows, want_rows)
    assert alone.keys() == got_rows.keys()
    for key, row in alone.items():
        assert torch.equal(row, got_rows[key]), key


def test_bundled_smollm2_tp2_matches_tp1_and_each_rank_holds_half_the_weights(monkeypatch):
    """SmolLM2's 9 heads over 3 KV heads split 6 + 3 (whole GQA groups); its MLP and vocabulary in halves.

    Float weights: with int4/int8 the kernels quantize activations to int8, so the all-reduce's last-bit
    difference can move a value across a quantization step and logits differ by far more than 1e-5."""
    prompts = [[1, 504, 3458, 314, 260, 2489, 28], list(range(600, 640))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    recorder = LogitsRecorder(monkeypatch)
    single = LLMEngine(model=None, kv_cache_memory="16M", quantization="none", **ENGINE)
    want = _generate(single, prompts, params)
    want_rows, whole = dict(recorder.rows), single.info()["weight_bytes"]
    del single
    recorder.rows.clear()
    engine = LLMEngine(
        model=None, kv_cache_memory="16M", quantization="none", tensor_parallel_size=2, **ENGINE
    )
    try:
        got = _generate(engine, prompts, params)
        info = engine.info()["tensor_parallel"]
    finally:
        engine.close()
    assert got == want
    _close_rows(recorder.rows, want_rows)
    per_rank = [r["weight_bytes"] for r in info["ranks"]]
    assert len(per_rank) == 2 and all(0.4 * whole < b < 0.6 * whole for b in per_rank), (per_rank, whole)
    assert [r["threads"] for r in info["ranks"]] == [1, 1]
    assert info["collectives"] == "shared memory"  # both ranks on this host


def test_step_inputs_round_trip_and_trim_block_tables():
    inputs = StepInputs(
        [5, 6, 7, 8], query_lens=[3, 1], context_lens=[3, 20], block_tables=[[4, 9], [1, 2, 3]]
    )
    back = StepInputs.decode(inputs.encode(block_size=16))
    assert back == StepInputs([5, 6, 7, 8], [3, 1], [3, 20], [[4], [1, 2]])
    assert back.positions == [0, 1, 2, 19]


def test_uneven_kv_heads_split_in_whole_groups_and_cpulists_parse():
    config = ModelConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, head_dim=8, rotary_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
    )  # fmt: skip
    parts = [ShardPlan(config, Shard(r, 2)).local_config() for r in range(2)]
    assert [(c.num_attention_heads, c.num_key_value_heads, c.vocab_size) for c in parts] == [
        (6, 2, 51),
        (3, 1, 51),
    ]
    q = torch.arange(72 * 2).view(72, 2)
    slices = [
        ShardPlan(config, Shard(r, 2)).tensor("model.layers.0.self_attn.q_proj.weight", q) for r in range(2)
    ]
    assert torch.equal(torch.cat(slices), q)
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([5, 0, 1, 2]) == "0-2,5"


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_daemon_tp2_serves_tp1_tokens_and_a_killed_worker_fails_every_request(tiny_daemon_model, tmp_path):
    prompt = "The quick brown fox"
    single = LLMEngine(model=str(tiny_daemon_model), kv_cache_memory="64M", dtype="float32", num_threads=1)
    want = _generate(single, [single.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=12))[0]
    del single
    daemon = start_daemon(tmp_path, "--tensor-parallel-size", "2", model=tiny_daemon_model)
    try:
        with daemon.client() as client:
            reply = client.generate(prompt, max_tokens=12, temperature=0.0)
            assert reply.token_ids == want
            info = client.info()["tensor_parallel"]
            assert info["size"] == 2 and info["backend"] == "gloo"
            assert [r["threads"] for r in info["ranks"]] == [1, 1]
        (worker,) = _children(daemon.proc.pid)
        errors: list[BaseException] = []

        def long_generation() -> None:
            with daemon.client() as client:
                try:
                    for _ in client.stream(prompt, max_tokens=3000, temperature=0.0, ignore_eos=True):
                        pass
                except KvdError as e:
                    errors.append(e)

        threads = [threading.Thread(target=long_generation) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # both are generating
        os.kill(worker, signal.SIGKILL)
        for t in threads:
            t.join(60)
        code = daemon.proc.wait(60)
    finally:
        if daemon.proc.poll() is None:
            daemon.stop(signal.SIGKILL)
    assert len(errors) == 2, daemon.log()
    assert all(getattr(e, "code", None) == "internal" for e in errors), errors
    assert all("tensor-parallel group failed" in str(e) for e in errors), errors  # the client is told why
    assert code == 3, daemon.log()
    assert "tensor-parallel group failed" in daemon.log()


def test_a_hung_worker_fails_the_daemon_within_the_timeout(tiny_daemon_model, tmp_path):
    daemon = start_daemon(
        tmp_path, "--tensor-parallel-size", "2", "--distributed-timeout", "3", model=tiny_daemon_model
    )
    (worker,) = _children(daemon.proc.pid)
    try:
        with daemon.client(timeout=60) as client:
            stream = client.stream("Hello", max_tokens=3000, temperature=0.0, ignore_eos=True)
            next(iter(stream))
            os.kill(worker, signal.SIGSTOP)  # alive, its sockets open, never answering
            stopped = time.monotonic()
            with pytest.raises(KvdError) as failure:
                for _ in stream:
                    pass
        assert daemon.proc.wait(30) == 3, daemon.log()
        assert time.monotonic() - stopped < 30
        assert getattr(failure.value, "code", None) == "internal"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        if daemon.proc.poll() is None:
            daemon.stop(signal.SIGKILL)


def test_sigterm_stops_every_rank(tiny_daemon_model, tmp_path):
    daemon = start_daemon(tmp_path, "--tensor-parallel-size", "2", model=tiny_daemon_model)
    (worker,) = _children(daemon.proc.pid)
    assert daemon.stop() == 0, daemon.log()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]


def _secret_file(folder: Path, name: str = "tp.secret", mode: int = 0o600) -> Path:
    path = folder / name
    path.write_text(secrets.token_urlsafe(32) + "\n")
    path.chmod(mode)
    return path


def _listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (/proc/net/tcp{,6} by socket inode)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)  # 32-bit words in host (little-endian) order
            address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            found.append((str(address), int(port, 16)))
    return found


def _serve(*args: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--dtype", "float32", "--threads", "1", *args]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=daemon_env())


def test_ranks_started_by_hand_meet_over_loopback_tcp(tiny_daemon_model, tmp_path):
    """The multi-host path on one host: rank 0 and rank 1 as two `kvd serve` commands, tcp rendezvous, and
    every collective through torch.distributed (gloo), as between hosts. The rendezvous listens on the given
    address alone; a rank with another secret is refused (one line on each side) and the group still forms with
    the right one; once it has, nothing listens at the rendezvous, and the group's sockets stay on loopback."""
    single = LLMEngine(model=str(tiny_daemon_model), kv_cache_memory="64M", dtype="float32", num_threads=1)
    want = _generate(single, [single.encode("Hello")], SamplingParams(temperature=0.0, max_tokens=6))[0]
    del single
    port = free_loopback_port()
    init = f"tcp://127.0.0.1:{port}"
    common = ["--model", str(tiny_daemon_model), "--kv-cache-memory", "64M", "--distributed-init", init]
    common += ["--world-size", "2", "--distributed-secret-file", str(_secret_file(tmp_path))]
    endpoint = f"ipc://{tmp_path}/kvd.sock"
    rank0 = _serve(*common, "--listen", endpoint, log=tmp_path / "daemon.log")
    procs = [rank0]
    from daemon_fixtures import DaemonProcess

    daemon = DaemonProcess(endpoint, rank0, tmp_path / "daemon.log")
    try:
        deadline = time.monotonic() + 120
        while not (bound := [a for a, p in _listeners(rank0.pid) if p == port]):
            assert rank0.poll() is None and time.monotonic() < deadline, daemon.log()
            time.sleep(0.1)
        assert bound == ["127.0.0.1"]  # not 0.0.0.0 nor [::]: the address given, alone
        stranger = _serve(*common, "--rank", "1", "--distributed-secret-file",
                          str(_secret_file(tmp_path, "other.secret")), log=tmp_path / "stranger.log")  # fmt: skip
        procs.append(stranger)
        assert stranger.wait(120) == 2, (tmp_path / "stranger.log").read_text()
        assert "the secrets differ" in (tmp_path / "stranger.log").read_text()
        assert "Traceback" not in (tmp_path / "stranger.log").read_text()
        rank1 = _serve(*common, "--rank", "1", log=tmp_path / "rank1.log")
        procs.append(rank1)
        wait_ready(daemon, 180)
        assert "refused 127.0.0.1" in daemon.log() and "did not prove the group's secret" in daemon.log()
        with daemon.client() as client:
            assert client.generate("Hello", max_tokens=6, temperature=0.0).token_ids == want
            assert client.info()["tensor_parallel"]["collectives"] == "torch.distributed"
        for proc in (rank0, rank1):
            listening = _listeners(proc.pid)
            assert all(ipaddress.ip_address(a).is_loopback for a, _ in listening), listening
            assert port not in [p for _, p in listening]  # the rendezvous closed once every rank joined
        assert daemon.stop() == 0, daemon.log()
        assert rank1.wait(30) == 0, (tmp_path / "rank1.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_startup_mistakes_are_one_line(tiny_daemon_model, tiny_checkpoint, tmp_path):
    """Another model on a rank, a port taken, a wrong world size: each side says so in one line, exits 2."""
    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    base = ["--kv-cache-memory", "64M", "--distributed-init", init]
    base += ["--distributed-secret-file", str(_secret_file(tmp_path))]
    rank1 = _serve(*base, "--model", str(tiny_checkpoint("llama")), "--rank", "1", "--world-size", "2",
                   log=tmp_path / "rank1.log")  # fmt: skip
    rank0 = _serve(*base, "--model", str(tiny_daemon_model), "--world-size", "2", "--listen",
                   f"ipc://{tmp_path}/kvd.sock", log=tmp_path / "daemon.log")  # fmt: skip
    assert rank0.wait(180) == 2 and rank1.wait(60) == 2
    for log in ("daemon.log", "rank1.log"):
        assert "start every rank with the same --model" in (tmp_path / log).read_text(), log
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rank0 = _serve("--model", str(tiny_daemon_model), "--world-size", "2", "--distributed-init",
                       f"tcp://127.0.0.1:{port}", "--listen", f"ipc://{tmp_path}/kvd3.sock",
                       "--distributed-secret-file", str(_secret_file(tmp_path)),
                       log=tmp_path / "taken.log")  # fmt: skip
        assert rank0.wait(120) == 2
    assert "the port is taken" in (tmp_path / "taken.log").read_text()
    rank1 = _serve(*base, "--model", str(tiny_daemon_model), "--rank", "1", "--world-size", "3",
                   log=tmp_path / "rank1b.log")  # fmt: skip
    rank0 = _serve(*base, "--model", str(tiny_daemon_model), "--world-size", "2", "--listen",
                   f"ipc://{tmp_path}/kvd2.sock", log=tmp_path / "daemon2.log")  # fmt: skip
    assert rank0.wait(180) == 2 and rank1.wait(60) == 2
    assert "--world-size 3" in (tmp_path / "daemon2.log").read_text()


def test_the_rendezvous_listens_on_the_given_address_only():
    """torch's TCPStore listened on every interface whatever address it was given; kvd's binds that one."""
    port = free_loopback_port()
    server = group.host_store(f"tcp://127.0.0.1:{port}", secrets.token_bytes(32))
    try:
        assert [a for a, p in _listeners(os.getpid()) if p == port] == ["127.0.0.1"]
    finally:
        server.close()
    assert port not in [p for _, p in _listeners(os.getpid())]
    with pytest.raises(DistributedStartupError, match="not a wildcard"):
        group.host_store(f"tcp://0.0.0.0:{port}", secrets.token_bytes(32))


def test_a_rank_without_the_secret_neither_joins_nor_poses_as_rank_0(caplog):
    secret = secrets.token_bytes(32)
    server = group.host_store(f"tcp://127.0.0.1:{free_loopback_port()}", secret)
    port = server.sock.getsockname()[1]
    rank0 = server.local_store(5)
    try:
        with caplog.at_level(logging.WARNING, "kvd.parallel"):
            with pytest.raises(DistributedStartupError, match="refused this rank: the secrets differ"):
                group.join_store(f"tcp://127.0.0.1:{port}", secrets.token_bytes(32), 1)
            with socket.create_connection(("127.0.0.1", port)) as raw:  # no answer to the challenge at all
                recv_frame(raw, 64)
                send_frame(raw, b"set claim/1 1")
                assert recv_frame(raw, 64) == handshake.REFUSED
            deadline = time.monotonic() + 10  # rank 0 logs just after it answered "refused"
            while caplog.text.count("did not prove the group's secret") < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert caplog.text.count("did not prove the group's secret") == 2, caplog.text
        assert rank0.num_keys() == 0  # the refused peers touched nothing
        rank1 = group.join_store(f"tcp://127.0.0.1:{port}", secret, 1)  # the group goes on
        group.claim_rank(rank1, 1)
        group.put(rank1, "hello/1", {"world_size": 2})
        assert group.get(rank0, "hello/1") == {"world_size": 2}
        rank1.close()
    finally:
        server.close()

    # A listener that does not know the secret, posing as rank 0: it cannot answer the rank's challenge.
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        port = impostor.getsockname()[1]

        def pose() -> None:
            conn, _ = impostor.accept()
            with conn:
                send_frame(conn, secrets.token_bytes(handshake.CHALLENGE_BYTES))
                recv_frame(conn, 128)
                send_frame(conn, secrets.token_bytes(32))

        thread = threading.Thread(target=pose)
        thread.start()
        with pytest.raises(DistributedStartupError, match="not this group's rank 0"):
            group.join_store(f"tcp://127.0.0.1:{port}", secret, 1)
        thread.join(10)


def test_a_secret_file_others_can_read_or_own_is_refused(tmp_path):
    good = _secret_file(tmp_path)
    assert read_secret_file(str(good)) == good.read_text().strip().encode()
    for mode in (0o644, 0o640, 0o604):
        with pytest.raises(DistributedStartupError, match="chmod 600"):
            read_secret_file(str(_secret_file(tmp_path, f"open{mode:o}", mode)))
    short = tmp_path / "short"
    short.write_text("password")
    short.chmod(0o600)
    with pytest.raises(DistributedStartupError, match="bytes of secret"):
        read_secret_file(str(short))
    with pytest.raises(DistributedStartupError, match="needs --distributed-secret-file"):
        read_secret_file(None)
    if os.geteuid() == 0:  # only root can give a file away
        theirs = _secret_file(tmp_path, "theirs")
        os.chown(theirs, 4321, -1)
        with pytest.raises(DistributedStartupError, match="not to this user"):
            read_secret_file(str(theirs))


def test_a_remote_rendezvous_needs_its_flag_and_a_private_secret_file_before_any_load(tmp_path):
    """Both refusals come before the model loads (its folder does not exist: loading it would fail otherwise),
    in one line with status 2."""
    cases = [
        (["--world-size", "2", "--distributed-init", "tcp://10.1.2.3:29500"], "--distributed-allow-remote"),
        (
            ["--rank", "1", "--world-size", "2", "--distributed-init", f"tcp://127.0.0.1:{free_loopback_port()}",
             "--distributed-secret-file", str(_secret_file(tmp_path, mode=0o644))],
            "chmod 600",
        ),
    ]  # fmt: skip
    for args, named in cases:
        result = subprocess.run(
            [sys.executable, "-m", "kvd.cli", "serve", *args, "--model", str(tmp_path / "absent"), "--listen",
             f"ipc://{tmp_path}/kvd.sock"],
            capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=120,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "--distributed-init" in result.stderr or "--distributed-secret-file" in result.stderr
        assert named in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_group_sockets_are_pinned_to_the_rendezvous_interface(monkeypatch):
    for variable in INTERFACE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert interface_of("127.0.0.1") == interface_of("127.0.0.2") == "lo"
    assert pin_interfaces("127.0.0.1") == "lo"
    assert all(os.environ[v] == "lo" for v in INTERFACE_VARIABLES)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the operator's choice wins
    pin_interfaces("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"

"""What a new user trips on: clear errors before any model loads, the CLI agreeing with the Python API, stdin,
chat commands, `kvd top` quitting on q, generations cut by a stopping daemon, truncated GGUF files."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from daemon_fixtures import REPO, DaemonProcess, daemon_env, start_daemon

import kvd
from kvd.cli import _sampling, _subcommand, build_parser
from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.model.gguf_loader import GGUFError, GGUFFile
from kvd.model.hub import default_model_path
from kvd.top import CLEAR

GREEDY = ["--temperature", "0", "--max-tokens", "10"]


def kvd_cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvd.cli", *args]
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=timeout
    )


def test_version():
    result = kvd_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvd {kvd.__version__}"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "gpu"], "device must be cpu, cuda or cuda:N, got 'gpu'"),
        (["--threads", "0"], "must be >= 1"),
        (["--num-threads", "-2"], "must be >= 1"),
        (["--block-size", "0"], "must be >= 1"),
        (["--socket-group", "nosuchgroup"], "--socket-group 'nosuchgroup': no such group"),
        (["--http", "0.0.0.0:8000"], "--allow-remote"),
        (["--client-timeout", "inf"], "at most 86400 seconds"),  # ZeroMQ takes int milliseconds
        (["--drain-timeout", "nan"], "--drain-timeout must be > 0"),
        # Settings of tensor-parallel ranks that one rank would ignore.
        (["--distributed-init", "tcp://127.0.0.1:29500"], "needs --tensor-parallel-size 2 or more"),
        (["--cpu-binding", "0-1"], "--cpu-binding 0-1 places tensor-parallel ranks"),
        # kvd's CPU kernels take float32 and bfloat16: refused before the weights load, naming this CPU's auto.
        (["--dtype", "float16"], "dtype float16 does not run on a CPU"),
        # The gateway's settings are kvd serve's too, for the gateway of --http.
        (["--served-model-name", "m"], "--served-model-name: a setting of the HTTP gateway"),
    ],
)
def test_serve_reports_bad_settings_in_one_line_before_loading_anything(tmp_path: Path, flags, message):
    started = time.monotonic()
    result = kvd_cli("serve", "--listen", f"ipc://{tmp_path}/kvd.sock", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "KV pool" not in result.stderr
    assert time.monotonic() - started < 20  # no model load (the bundled one takes longer with torch's import)


def test_events_on_a_taken_socket_names_the_events_flag(tmp_path: Path):
    taken = f"ipc://{tmp_path}/events.sock"
    other = zmq.Context.instance().socket(zmq.PUB)
    other.bind(taken)
    try:
        result = kvd_cli("serve", "--listen", f"ipc://{tmp_path}/kvd.sock", "--events", taken)
    finally:
        other.close(linger=0)
    assert result.returncode == 2 and "choose another --events" in result.stderr, result.stderr


def test_block_size_help_names_the_real_default():
    help_text = kvd_cli("serve", "--help").stdout
    assert "(None)" not in help_text and "256 for flash-attn" in help_text


def test_the_python_api_takes_what_the_cli_takes():
    assert EngineArgs(kv_cache_memory="256M").kv_cache_memory == 256 << 20
    assert EngineArgs(kv_cache_memory="1.5GiB").kv_cache_memory == 3 << 29
    with pytest.raises(EngineArgsError, match="not a size"):
        EngineArgs(kv_cache_memory="lots")
    with pytest.raises(EngineArgsError, match="device"):
        EngineArgs(device="gpu")
    with pytest.raises(EngineArgsError, match="num_threads"):
        EngineArgs(num_threads=0)
    serve = build_parser().parse_args(["serve", "--threads", "3"])
    assert serve.num_threads == 3  # the API's name; --threads stays an alias
    generate = build_parser().parse_args(["generate", "x", "--ignore-eos"])
    # No CLI default of its own: the daemon's (16, as kvd.SamplingParams and the protocol) applies.
    assert _sampling(generate)["ignore_eos"] is True and generate.max_tokens is None


def test_serve_flags_are_the_settings_classes_fields():
    from kvd.server.config import ServerConfig
    from kvd.settings import from_flags

    defaults = build_parser().parse_args(["serve"])
    assert from_flags(EngineArgs, defaults) == EngineArgs()
    assert from_flags(ServerConfig, defaults) == ServerConfig()
    flags = ["serve", "--no-prefix-caching", "--kv-cache-memory", "1G", "--max-message-bytes", "2M"]
    args = build_parser().parse_args(flags)
    engine, config = from_flags(EngineArgs, args), from_flags(ServerConfig, args)
    assert (engine.enable_prefix_caching, engine.kv_cache_memory) == (False, 1 << 30)
    assert config.max_message_bytes == 2 << 20


def test_every_boolean_flag_has_its_opposite_and_the_command_line_beats_the_config_file(tmp_path: Path):
    """Each boolean setting that a config file turns away from its default is turned back by the opposite flag
    (and the file's opposite key works too)."""
    import dataclasses

    from kvd.server.config import ServerConfig
    from kvd.server.config_file import apply_config_file
    from kvd.settings import _flag_name, from_flags, opposite_flag

    booleans = [
        (cls, f) for cls in (EngineArgs, ServerConfig) for f in dataclasses.fields(cls) if f.type == "bool"
    ]
    assert len(booleans) >= 4
    for cls, field in booleans:
        flag = _flag_name(field)
        for key, value in ((flag[2:], True), (opposite_flag(flag)[2:], False)):
            parser = build_parser()
            config = tmp_path / "kvd.toml"
            config.write_text(f"{key} = {str(value).lower()}\n")
            apply_config_file(_subcommand(parser, "serve"), config)
            from_file = getattr(from_flags(cls, parser.parse_args(["serve"])), field.name)
            assert from_file is not field.default, (key, value)
            undone = parser.parse_args(["serve", opposite_flag(flag)])  # the primary flag leaves the default
            assert getattr(from_flags(cls, undone), field.name) is field.default, (key, value)


def test_listen_problems_are_found_before_the_model_load(tmp_path: Path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        for flags, message in [
            (["--listen", taken], "--listen 127.0.0.1"),
            (["--listen", f"ipc://{tmp_path}/k.sock", "--events", taken], "--events 127.0.0.1"),
            (
                ["--listen", f"ipc://{tmp_path}/k.sock", "--events", f"ipc://{tmp_path}/k.sock"],
                "one of its own",
            ),
        ]:
            started = time.monotonic()
            result = kvd_cli("serve", *flags)
            assert result.returncode == 2 and message in result.stderr, (flags, result.stderr)
            assert "KV pool" not in result.stderr and time.monotonic() - started < 20, result.stderr


def test_a_truncated_or_empty_gguf_names_the_file(tmp_path: Path):
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(2000))
    with pytest.raises(GGUFError, match=f"{truncated} is truncated: it ends after 2000 bytes"):
        GGUFFile(truncated)
    empty = tmp_path / "empty.gguf"
    empty.touch()
    with pytest.raises(GGUFError, match=f"{empty} is empty"):
        GGUFFile(empty)


def test_a_folder_without_tokenizer_files_says_so(tiny_checkpoint, tmp_path: Path):
    from kvd.model.config import UnsupportedModelError
    from kvd.model.loader import load_model

    source = tiny_checkpoint("llama")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(source / name, tmp_path / name)
    with pytest.raises(UnsupportedModelError, match="has no tokenizer files"):
        load_model(tmp_path)


def test_a_broken_folder_model_is_one_line_and_status_2(tiny_checkpoint, tmp_path: Path):
    source = tiny_checkpoint("llama")
    cases = {
        "truncated weights": (
            lambda d: (d / "model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{"),
            "safetensors",
        ),
        "config not JSON": (
            lambda d: (d / "config.json").write_text("{not json"),
            "config.json is not valid JSON",
        ),
        "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "holds no JSON object"),
        "config without sizes": (
            lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama"})),
            "config.json lacks num_attention_heads, hidden_size",
        ),
    }
    for name, (spoil, message) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(source, folder)
        spoil(folder)
        result = kvd_cli("serve", "--model", str(folder), "--listen", f"ipc://{tmp_path}/{name[:4]}.sock")
        assert result.returncode == 2 and message in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr, (name, result.stderr)
    bad_toml = tmp_path / "kvd.toml"
    bad_toml.write_bytes(b"\xff\xfe")
    result = kvd_cli("serve", "--config", str(bad_toml))
    assert (
        result.returncode == 2 and "is not UTF-8 text" in result.stderr and "Traceback" not in result.stderr
    )


@pytest.fixture(scope="module")
def daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A daemon with a short drain, so that the last test can cut a generation by stopping it."""
    proc = start_daemon(
        tmp_path_factory.mktemp("friction"), "--drain-timeout", "0.3", model=tiny_daemon_model
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_prompt_limit_past_the_context_is_said_once_and_info_shows_the_effective_one(
    tiny_checkpoint, tmp_path
):
    daemon = start_daemon(
        tmp_path, "--max-prompt-tokens", "1000000", "--max-model-len", "64", model=tiny_checkpoint("qwen2")
    )
    try:
        with daemon.client() as client:
            assert client.info()["limits"]["max_prompt_tokens"] == 63  # one token left to generate
        warned = [line for line in daemon.log().splitlines() if "--max-prompt-tokens 1000000" in line]
        assert len(warned) == 1 and "limited to 63 tokens" in warned[0], daemon.log()
    finally:
        daemon.stop()


def test_kvd_serve_http_hands_the_gateway_its_settings(tiny_checkpoint, tmp_path):
    """`kvd serve --http` takes kvd gateway's settings and starts its gateway with them: the model's name, and
    a Host it serves besides loopback ones."""
    import http.client

    from gateway_fixtures import gateway_daemon

    flags = ("--served-model-name", "house-model", "--allowed-host", "kvd.example")
    with gateway_daemon(tiny_checkpoint("qwen2"), tmp_path, *flags) as daemon:

        def models(host: str) -> tuple[int, dict]:
            conn = http.client.HTTPConnection(daemon.base_url.removeprefix("http://"), timeout=30)
            try:
                conn.request("GET", "/v1/models", headers={"Host": host})
                response = conn.getresponse()
                return response.status, json.loads(response.read())
            finally:
                conn.close()

        status, body = models("kvd.example")
        assert status == 200 and [m["id"] for m in body["data"]] == ["house-model"], body
        assert models("other.example")[0] == 403


def test_generate_reads_the_prompt_from_stdin(daemon: DaemonProcess):
    prompt = "The capital of France is"
    with daemon.client() as client:
        expected = client.generate(prompt, temperature=0.0, max_tokens=10).text
    result = kvd_cli("generate", "-", *GREEDY, "--endpoint", daemon.endpoint, stdin=prompt)
    assert result.returncode == 0 and result.stdout == expected + "\n"


def test_chat_commands_never_reach_the_model(daemon: DaemonProcess):
    with daemon.client() as client:
        expected = client.chat([{"role": "user", "content": "Hi"}], temperature=0.0, max_tokens=10).text
    stdin = "Hello\n/reset\n/help\n/bogus\nHi\n/exit\n"
    result = kvd_cli("chat", *GREEDY, "--endpoint", daemon.endpoint, stdin=stdin)
    # The reply to Hi saw neither "Hello" (reset) nor the commands.
    assert result.returncode == 0 and result.stdout.endswith(f"> > > > {expected}\n> ")
    assert "(history cleared)" in result.stderr and "unknown command /bogus" in result.stderr
    assert result.stderr.count("/reset clears the history") == 3  # the banner, /help, /bogus


def test_top_shows_the_model_and_quits_on_q(daemon: DaemonProcess):
    with daemon.client() as client:
        model = client.info()["model"]
    leader, follower = pty.openpty()
    cmd = [sys.executable, "-m", "kvd.cli", "top", "--endpoint", daemon.endpoint, "--interval", "0.2"]
    proc = subprocess.Popen(cmd, stdin=follower, stdout=follower, cwd=REPO, env=daemon_env())
    os.close(follower)
    shown = b""
    try:
        deadline = time.monotonic() + 2.0  # a few redraws (and the cbreak mode) first
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.1)[0]:
                shown += os.read(leader, 65536)
        os.write(leader, b"q")
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        os.close(leader)
    assert model in shown.decode() and shown.count(CLEAR.encode()) >= 2  # redrawn in place
    # Into a pipe: one screen without terminal codes, as --once.
    piped = kvd_cli("top", "--endpoint", daemon.endpoint, timeout=30)
    assert piped.returncode == 0 and model in piped.stdout and CLEAR not in piped.stdout


def test_info_names_the_kernel_paths_and_timeouts_must_be_positive(daemon: DaemonProcess):
    with daemon.client() as client:
        info = client.info()
    result = kvd_cli("info", "--endpoint", daemon.endpoint)
    assert result.returncode == 0 and info["model"] in result.stdout
    assert f"CPU kernels: {info['cpu_kernels'] or 'none'}" in result.stdout
    assert f"weights       {info['weight_bytes'] / 2**20:.1f} MiB held" in result.stdout
    assert json.loads(kvd_cli("info", "--json", "--endpoint", daemon.endpoint).stdout) == info
    for bad in ("0", "-5", "nan"):
        result = kvd_cli("stats", "--timeout", bad, "--endpoint", daemon.endpoint)
        assert result.returncode == 2 and "--timeout" in result.stderr and "> 0" in result.stderr, (
            result.stderr
        )
        result = kvd_cli("top", "--interval", bad, "--endpoint", daemon.endpoint)
        assert result.returncode == 2 and "--interval" in result.stderr, result.stderr


def test_info_lists_a_gguf_files_tensor_types_by_their_bytes():
    from kvd.cli import weights_line

    info = {
        "weight_bytes": 110 * 2**20,
        "file_types": {
            "Q8_0": {"tensors": 15, "bytes": 31 * 2**20},
            "Q5_0": {"tensors": 166, "bytes": 55 * 2**20},
        },
    }
    assert weights_line(info) == (
        "weights       110.0 MiB held; in the file: Q5_0 166 tensors 55.0 MiB, Q8_0 15 tensors 31.0 MiB"
    )
    assert weights_line(info | {"file_types": {}}) == "weights       110.0 MiB held"


def test_generate_with_a_schema_a_regex_and_a_bad_schema(daemon: DaemonProcess, tmp_path: Path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = kvd_cli("generate", "Hi", *GREEDY, "--json-schema", str(path), "--endpoint", daemon.endpoint)
    assert result.returncode == 0 and isinstance(json.loads(result.stdout)["ok"], bool)
    result = kvd_cli("generate", "Hi", *GREEDY, "--regex", "[0-9]{4}", "--endpoint", daemon.endpoint)
    assert result.returncode == 0 and re.fullmatch(r"[0-9]{4}\n", result.stdout)
    path.write_text('{"type": 5}')
    result = kvd_cli("generate", "Hi", "--json-schema", str(path), "--endpoint", daemon.endpoint)
    assert result.returncode == 1 and "json_schema" in result.stderr and "type must be" in result.stderr
    result = kvd_cli(
        "generate", "Hi", "--json-schema", str(tmp_path / "missing.json"), "--endpoint", daemon.endpoint
    )
    assert result.returncode == 1 and "--json-schema" in result.stderr and "No such file" in result.stderr


def test_a_generation_cut_by_the_daemon_stopping_exits_1(daemon: DaemonProcess):
    cmd = [sys.executable, "-m", "kvd.cli", "generate", "Once", "--max-tokens", "4000", "--ignore-eos"]
    proc = subprocess.Popen(
        [*cmd, "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=daemon_env(),
    )
    with daemon.client() as client:
        deadline = time.monotonic() + 30
        while client.stats()["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert daemon.stop(signal.SIGTERM) == 0
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "cut short: the daemon stopped" in stderr


def test_the_start_timeout_is_extended_while_the_model_loads(tmp_path: Path):
    import socket

    from kvd.server.serve import EXTEND_BY_S, extending_start_timeout
    from kvd.server.systemd import Notifier

    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(tmp_path / "notify"))
    manager.settimeout(5)
    with extending_start_timeout(Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})):
        assert manager.recv(256) == f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY_S * 1e6)}".encode()
    manager.settimeout(0.2)
    with pytest.raises(TimeoutError):  # nothing more once loaded
        manager.recv(256)
    manager.close()

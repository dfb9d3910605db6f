"""The C client (clients/c) against a real daemon: the Python client's greedy output, errors, no daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from client_parity import (
    ERROR_CASES,
    GREEDY_REQUESTS,
    NO_DAEMON_TIMEOUT_MS,
    assert_error,
    assert_same_completion,
    assert_timed_out,
    error_case,
    python_completion,
    stale_socket,
)
from daemon_fixtures import REPO, DaemonProcess

from kvd_client import resolve_endpoint

C_DIR = REPO / "clients" / "c"
MALFORMED_ENDPOINTS = [
    "kvd.sock",
    "ipc://relative/kvd.sock",
    "ipc://@abstract",
    f"ipc:///{'x' * 120}",
    "tcp://127.0.0.1",
    "tcp://:80",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:65536",
    "tcp://127.0.0.1:http",
    "udp://h:9",
]


@pytest.fixture(scope="session")
def c_build() -> Path:
    """build/ with libkvd.a, libkvd.so, generate and test_client; make rebuilds only what changed."""
    proc = subprocess.run(["make", "-C", str(C_DIR)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"make failed (run clients/install-deps.sh?):\n{proc.stdout}\n{proc.stderr}"
    return C_DIR / "build"


def run_test_client(build: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = subprocess.run(
        [str(build / "test_client"), *args], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def request_args(request: dict) -> list[str]:
    """test_client's flags for a protocol request."""
    args = []
    for key, value in request.items():
        if key == "prompt":
            args += ["-p", value]
        elif key == "prompt_token_ids":
            args += ["-i", ",".join(map(str, value))]
        elif key == "messages":
            for m in value:
                args += ["-m", f"{m['role']}={m['content']}"]
        elif key == "max_tokens":
            args += ["-n", str(value)]
        elif key == "temperature":
            args += ["-t", repr(value)]
        elif key == "ignore_eos":
            args += ["-E"] if value else []
        else:
            raise ValueError(f"test_client has no flag for {key!r}")
    return args


def generate(build: Path, endpoint: str, request: dict, stream: bool = False) -> tuple[int, dict]:
    flags = ["-s"] if stream else []
    return run_test_client(build, "generate", "-e", endpoint, *flags, *request_args(request))


def test_the_shared_library_exports_exactly_the_api_of_kvd_h(c_build: Path):
    declared = set(re.findall(r"^KVD_API [^(]*?\b(kvd_\w+)\(", (C_DIR / "kvd.h").read_text(), re.M))
    assert {"kvd_connect", "kvd_generate", "kvd_abort", "kvd_close", "kvd_set_timeout"} <= declared
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(c_build / "libkvd.so")], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[2] for line in symbols.splitlines() if line.split()[1] == "T"}
    assert exported == declared


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", GREEDY_REQUESTS)
def test_greedy_output_equals_the_python_clients(
    c_build: Path, tiny_daemon: DaemonProcess, name: str, stream: bool
):
    request = GREEDY_REQUESTS[name]
    code, result = generate(c_build, tiny_daemon.endpoint, request, stream)
    assert code == 0
    assert_same_completion(result, python_completion(tiny_daemon, request), stream)
    if stream:
        assert [c["is_final"] for c in result["chunks"]] == [False] * (len(result["chunks"]) - 1) + [True]
        assert {c["request_id"] for c in result["chunks"]} == {result["request_id"]}


def test_the_example_streams_the_completion_to_stdout(c_build: Path, tiny_daemon: DaemonProcess):
    reference = python_completion(
        tiny_daemon, {"prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 16}
    )
    cmd = [
        str(c_build / "generate"),
        "-e",
        tiny_daemon.endpoint,
        "-n",
        "16",
        "-t",
        "0",
        "Once",
        "upon",
        "a",
        "time",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference["text"] + "\n"


@pytest.mark.parametrize("name", ERROR_CASES)
def test_error_replies_surface_as_their_code(c_build: Path, tiny_daemon: DaemonProcess, name: str):
    request, error, field = error_case(tiny_daemon, name)
    for stream in (False, True):
        code, result = generate(c_build, tiny_daemon.endpoint, request, stream)
        assert code == 1
        assert_error(result, error, field)


def test_abort_from_the_callback_ends_the_generation(c_build: Path, tiny_daemon: DaemonProcess):
    request = {"prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 4000, "ignore_eos": True}
    code, result = run_test_client(
        c_build, "generate", "-e", tiny_daemon.endpoint, "-s", "-a", "2", *request_args(request)
    )
    assert code == 0, result
    assert result["finish_reason"] == "abort"
    assert 2 <= result["usage"]["completion_tokens"] < 4000
    assert len(result["token_ids"]) == result["usage"]["completion_tokens"]
    with tiny_daemon.client() as client:
        stats = client.stats()
    assert stats["num_running"] + stats["num_waiting"] == 0


def test_health(c_build: Path, tiny_daemon: DaemonProcess):
    code, result = run_test_client(c_build, "health", "-e", tiny_daemon.endpoint)
    assert (code, result["status"], result["health"]) == (0, "ok", "ready")


def test_a_missing_daemon_is_a_clean_error_within_the_timeout(c_build: Path, tmp_path: Path):
    timeout = str(NO_DAEMON_TIMEOUT_MS)
    missing = f"ipc://{tmp_path}/missing.sock"
    code, result = run_test_client(c_build, "generate", "-e", missing, "-T", timeout, "-s", "-p", "Hi")
    assert code == 1
    assert_timed_out(result, "no_daemon", missing)
    stale = stale_socket(tmp_path / "stale.sock")
    code, result = run_test_client(c_build, "health", "-e", stale, "-T", timeout)
    assert code == 1
    assert_timed_out(result, "timeout", stale)


def test_the_default_endpoint_is_resolved_as_the_python_clients(
    c_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    settings = [
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": str(tmp_path)},
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": f"{tmp_path}/"},
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": ""},
        {"KVD_ENDPOINT": None, "XDG_RUNTIME_DIR": None},
        {"KVD_ENDPOINT": "tcp://127.0.0.1:7000", "XDG_RUNTIME_DIR": str(tmp_path)},
    ]
    for setting in settings:
        for name, value in setting.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        code, result = run_test_client(c_build, "resolve", env=dict(os.environ))
        assert (code, result["url"]) == (0, resolve_endpoint().url), setting
    code, result = run_test_client(c_build, "resolve", "-e", "ipc:///run/kvd/kvd.sock", env=dict(os.environ))
    assert result["url"] == "ipc:///run/kvd/kvd.sock"


@pytest.mark.parametrize("url", MALFORMED_ENDPOINTS)
def test_malformed_endpoints_are_refused(c_build: Path, url: str):
    code, result = run_test_client(c_build, "generate", "-e", url, "-p", "Hi")
    assert code == 1
    assert result["status"] == "endpoint"
    assert url in result["message"]

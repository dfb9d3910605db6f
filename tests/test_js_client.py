"""The Node.js client (clients/js) against a real daemon: the Python client's greedy output, errors, no daemon.

The node:test suites in clients/js/test run here too: endpoint resolution and a missing daemon without a
daemon, and streaming, concurrency, abort and errors against the module's daemon.
"""

from __future__ import annotations

import json
import os
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
    run_with_localhost_on_ipv6,
    run_with_planted_tmp,
    stale_socket,
)
from daemon_fixtures import REPO, DaemonProcess, ipv6_loopback_or_refusal, tcp_daemon

JS_DIR = REPO / "clients" / "js"


@pytest.fixture(scope="session")
def js_client() -> Path:
    """clients/js with its node_modules (clients/install-deps.sh installs them; npm ci here otherwise)."""
    if not (JS_DIR / "node_modules" / ".package-lock.json").exists():
        proc = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=JS_DIR, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"npm ci failed (run clients/install-deps.sh):\n{proc.stderr}"
    return JS_DIR


def node(js_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["node", *args], cwd=js_dir, capture_output=True, text=True, timeout=120, env=env)


def run_request(js_dir: Path, endpoint: str, mode: str, request: dict, timeout_ms: int = 30_000) -> dict:
    """clients/js/tools/request.mjs: one call of the client, its outcome as JSON."""
    proc = node(js_dir, "tools/request.mjs", endpoint, str(timeout_ms), mode, json.dumps(request))
    result = json.loads(proc.stdout)
    assert proc.returncode == (0 if result["status"] == "ok" else 1), proc.stderr
    return result


def test_node_suites_without_a_daemon(js_client: Path):
    proc = node(js_client, "--test", "test/endpoint.test.mjs", "test/no_daemon.test.mjs")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The client built on the default endpoint: its error as JSON, or {} when it was made.
NEW_DEFAULT_CLIENT = """
import { Client } from "./src/index.js";
try {
  new Client().close();
  console.log("{}");
} catch (e) {
  console.log(JSON.stringify({ name: e.name, code: e.code, message: e.message }));
}
"""


def test_the_default_endpoint_refuses_a_tmp_folder_planted_by_another_user(js_client: Path):
    proc = run_with_planted_tmp(["node", "--input-type=module", "-e", NEW_DEFAULT_CLIENT], js_client)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result.get("name"), result.get("code")) == ("EndpointError", "endpoint"), result
    assert f"/tmp/kvd-{os.getuid()} belongs to another user (uid 65534)" in result["message"]


def test_node_suite_against_the_daemon(js_client: Path, tiny_daemon: DaemonProcess):
    env = {**os.environ, "KVD_ENDPOINT": tiny_daemon.endpoint}
    proc = node(js_client, "--test", "test/daemon.test.mjs", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# fail 0" in proc.stdout


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", GREEDY_REQUESTS)
def test_greedy_output_equals_the_python_clients(
    js_client: Path, tiny_daemon: DaemonProcess, name: str, stream: bool
):
    request = GREEDY_REQUESTS[name]
    mode = (
        ("stream_chat" if stream else "chat")
        if "messages" in request
        else ("stream" if stream else "generate")
    )
    result = run_request(js_client, tiny_daemon.endpoint, mode, request)
    assert_same_completion(result, python_completion(tiny_daemon, request), stream)
    if stream:
        finished = [c["finish_reason"] is not None for c in result["chunks"]]
        assert finished == [False] * (len(finished) - 1) + [True]


def test_a_daemon_on_ipv6_loopback_serves_the_js_client(
    js_client: Path, tiny_daemon: DaemonProcess, tiny_daemon_model: Path, tmp_path: Path
):
    ipv6_loopback_or_refusal()
    request = GREEDY_REQUESTS["prompt"]
    with tcp_daemon(tmp_path, tiny_daemon_model, "[::1]") as daemon:
        results = [run_request(js_client, daemon.endpoint, mode, request) for mode in ("generate", "stream")]
    reference = python_completion(tiny_daemon, request)
    for result, stream in zip(results, (False, True), strict=True):
        assert_same_completion(result, reference, stream)


def test_a_daemon_on_localhost_is_reached_where_localhost_names_ipv6_too(
    js_client: Path, tiny_daemon: DaemonProcess, tiny_daemon_model: Path, tmp_path: Path
):
    # The daemon binds localhost in IPv4; a client in IPv6 mode would try ::1 alone and time out.
    request = GREEDY_REQUESTS["prompt"]
    with tcp_daemon(tmp_path, tiny_daemon_model, "localhost") as daemon:
        call = ["node", "tools/request.mjs", daemon.endpoint, "5000", "generate", json.dumps(request)]
        proc = run_with_localhost_on_ipv6(call, tmp_path / "hosts", js_client)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_same_completion(json.loads(proc.stdout), python_completion(tiny_daemon, request), False)


def test_the_example_streams_the_completion_to_stdout(js_client: Path, tiny_daemon: DaemonProcess):
    reference = python_completion(
        tiny_daemon, {"prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 16}
    )
    args = ["--endpoint", tiny_daemon.endpoint, "--max-tokens", "16", "--temperature", "0"]
    proc = node(js_client, "examples/generate.mjs", *args, "Once", "upon", "a", "time")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference["text"] + "\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "abc", "Hi"], "--max-tokens takes a whole number"),
        (["--temperature", "", "Hi"], "--temperature takes a number"),
        (["--bogus", "Hi"], "Unknown option '--bogus'"),
        ([], "a prompt is required"),
    ],
)
def test_the_example_refuses_bad_flags_with_its_usage(js_client: Path, args: list[str], message: str):
    proc = node(js_client, "examples/generate.mjs", *args)
    assert proc.returncode == 2 and message in proc.stderr and "usage:" in proc.stderr, proc.stderr
    assert "    at " not in proc.stderr  # no stack trace
    shown = node(js_client, "examples/generate.mjs", "--help")
    assert shown.returncode == 0 and shown.stderr.startswith("usage:")


@pytest.mark.parametrize("name", ERROR_CASES)
def test_error_replies_surface_as_their_code(js_client: Path, tiny_daemon: DaemonProcess, name: str):
    request, error, field = error_case(tiny_daemon, name)
    for mode in ("generate", "stream"):
        assert_error(run_request(js_client, tiny_daemon.endpoint, mode, request), error, field)


def test_a_missing_daemon_is_a_clean_error_within_the_timeout(js_client: Path, tmp_path: Path):
    missing = f"ipc://{tmp_path}/missing.sock"
    result = run_request(js_client, missing, "stream", {"prompt": "Hi"}, NO_DAEMON_TIMEOUT_MS)
    assert_timed_out(result, "no_daemon", missing)
    stale = stale_socket(tmp_path / "stale.sock")
    result = run_request(js_client, stale, "generate", {"prompt": "Hi"}, NO_DAEMON_TIMEOUT_MS)
    assert_timed_out(result, "timeout", stale)

"""What the C and JS client tests share: the requests, the Python client's answers to compare with, checks.

The clients' test programs (clients/c/tests/test_client.c, clients/js/tools/request.mjs) run one request and
print one JSON object: `status` ("ok" or an error code) with `code`, `field`, `message` on failure, `text`,
`token_ids`, `finish_reason`, `usage` and the streamed `chunks`, and `elapsed_ms`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from daemon_fixtures import DaemonProcess

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}

GREEDY_REQUESTS = {
    "prompt": {"prompt": "The capital of France is", **GREEDY},
    "token_ids": {"prompt_token_ids": [504, 3458, 282, 4649, 314], **GREEDY},
    "chat": {"messages": [{"role": "user", "content": "Hi there"}], **GREEDY},
}

# name -> (request, error code, field at fault)
ERROR_REQUESTS = {
    "negative_temperature": ({"prompt": "Hi", "temperature": -1.0}, "bad_request", "temperature"),
    "huge_temperature": ({"prompt": "Hi", "temperature": 1000.0}, "bad_request", "temperature"),
    "empty_prompt": ({"prompt": ""}, "bad_request", "prompt"),
}

NO_DAEMON_TIMEOUT_MS = 500


def too_long_prompt(daemon: DaemonProcess) -> dict:
    """A request whose prompt is one token over the daemon's max_prompt_tokens."""
    with daemon.client() as client:
        limit = client.info()["limits"]["max_prompt_tokens"]
    return {"prompt_token_ids": [1] * (limit + 1), "max_tokens": 1}


ERROR_CASES = [*ERROR_REQUESTS, "too_long_prompt"]


def error_case(daemon: DaemonProcess, name: str) -> tuple[dict, str, str]:
    """(request, expected error code, field at fault) for one of ERROR_CASES."""
    if name == "too_long_prompt":
        return too_long_prompt(daemon), "too_large", "prompt_token_ids"
    return ERROR_REQUESTS[name]


def python_completion(daemon: DaemonProcess, request: dict) -> dict:
    """The Python client's answer to `request` (the reference the other clients must match)."""
    params = {k: v for k, v in request.items() if k not in ("prompt", "prompt_token_ids", "messages")}
    with daemon.client() as client:
        if "messages" in request:
            completion = client.chat(request["messages"], **params)
        else:
            completion = client.generate(request.get("prompt", request.get("prompt_token_ids")), **params)
    return {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "usage": vars(completion.usage),
    }


def assert_same_completion(result: dict, reference: dict, streamed: bool) -> None:
    """A client's result equals the Python client's; when streamed, its chunks add up to it."""
    assert result["status"] == "ok", result
    assert result["token_ids"] == reference["token_ids"]
    assert result["text"] == reference["text"]
    assert result["finish_reason"] == reference["finish_reason"]
    # cached_tokens depends on what ran before (the prefix cache); the counts do not.
    for key in ("prompt_tokens", "completion_tokens"):
        assert result["usage"][key] == reference["usage"][key]
    chunks = result["chunks"]
    if not streamed:
        assert chunks == []
        return
    assert len(chunks) > 1, "a 12-token stream comes in several chunks"
    assert "".join(c["text"] for c in chunks) == reference["text"]
    assert [t for c in chunks for t in c["token_ids"]] == reference["token_ids"]


def assert_error(result: dict, code: str, field: str | None) -> None:
    assert result["status"] == code, result
    assert result["code"] == code
    assert result["message"]
    if field is not None:
        assert result["field"] == field


def assert_timed_out(result: dict, code: str, endpoint: str) -> None:
    """A clean timeout: the right code, a message naming the endpoint, after the timeout and not much later."""
    assert result["status"] == code, result
    assert endpoint in result["message"]
    assert NO_DAEMON_TIMEOUT_MS - 50 <= result["elapsed_ms"] < NO_DAEMON_TIMEOUT_MS + 2000, result


def stale_socket(path: Path) -> str:
    """An ipc endpoint whose socket file exists but refuses connections, as a crashed daemon leaves it."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    return f"ipc://{path}"


def run_with_planted_tmp(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `args` without XDG_RUNTIME_DIR or KVD_ENDPOINT, /tmp/kvd-$UID looking made by another user (uid
    65534, mode 0700): a tmpfs mounted over that folder in a mount namespace of the run's own, so that the rest
    of /tmp (where a checkout or a venv may lie) stays visible and the real folder is left alone."""
    shared = Path(f"/tmp/kvd-{os.getuid()}")
    created = not shared.exists()
    if created:
        shared.mkdir(mode=0o700)  # the mount point; what a daemon would make there, removed after
    try:
        plant = f"mount -t tmpfs -o mode=700,uid=65534 kvd-test {shared}"
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "KVD_ENDPOINT")}
        return _run_in_mount_namespace(
            plant, args, cwd, env, "planting /tmp/kvd-$UID away from the real /tmp"
        )
    finally:
        if created:
            shared.rmdir()


def run_with_localhost_on_ipv6(
    args: list[str], hosts: Path, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `args` where /etc/hosts names ::1 localhost, as on many systems: `hosts`, written so, mounted over it
    in a mount namespace of the run's own. A client in IPv6 mode resolves localhost to ::1 alone there."""
    hosts.write_text("::1 localhost\n127.0.0.1 localhost\n")
    return _run_in_mount_namespace(
        f"mount --bind {hosts} /etc/hosts", args, cwd, None, "an /etc/hosts of the test's own"
    )


def _run_in_mount_namespace(
    setup: str, args: list[str], cwd: Path | None, env: dict[str, str] | None, what: str
) -> subprocess.CompletedProcess:
    """Run `args` after the shell command `setup` (mounts) in a mount namespace of the run's own, so nothing
    outside it changes; skip the test where there is none (not root), saying it is needed for `what`."""
    probe = ["unshare", "--mount", "sh", "-c", setup]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip(f"{what} needs a mount namespace (root)")
    cmd = ["unshare", "--mount", "sh", "-c", f'{setup} && exec "$@"', "sh", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=cwd)

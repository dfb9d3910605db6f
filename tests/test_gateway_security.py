"""Who may use the gateway, against a real daemon and real `kvd gateway` processes: API keys, the Host check
(DNS rebinding), each caller's own prefix-cache namespace, and the unix socket listener."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from client_parity import stale_socket
from daemon_fixtures import REPO, DaemonProcess, daemon_env
from gateway_fixtures import daemon_fixture, free_port, kvd_fixture, model_fixture  # noqa: F401

from kvd.gateway.auth import Access, host_of
from kvd.gateway.keys import ENV_KEY

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef01"
FROM_ENV = "env-key-0123456789abcdef01"
ALLOWED = "gateway.example"
# Longer than two 16-token blocks, so that a repeat hits the prefix cache; used by no other test.
SECRET_PROMPT = "Alice's draft: the merger with the northern mill closes on the first of May, quietly. " * 3


def _log(path: Path) -> str:
    return path.read_text(errors="replace")


@contextmanager
def running_gateway(
    daemon: DaemonProcess, workdir: Path, *flags: str, env: dict[str, str] | None = None, http: bool = True
) -> Iterator[str]:
    """`kvd gateway` on the daemon with `flags` (and --http on a free port); yields its base URL (None with
    http=False) once /health answers, over TCP or the unix socket of --uds."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvd.cli", "gateway", "--endpoint", daemon.endpoint, *flags]
    cmd += ["--http", f"127.0.0.1:{port}"] if http else []
    log_path = workdir / f"gateway-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**daemon_env(), **(env or {})}
        )
    base_url = f"http://127.0.0.1:{port}" if http else None
    uds = flags[flags.index("--uds") + 1] if "--uds" in flags else None
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, _log(log_path)
        try:
            with _client(base_url, uds) as client:
                if client.get("/health").status_code == 200:
                    break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the gateway did not answer; log:\n{_log(log_path)}"
        time.sleep(0.2)
    try:
        yield base_url
    finally:
        proc.terminate()  # uvicorn stops gracefully, then dies of the signal (as the daemon's gateway child does)
        assert proc.wait(30) == -signal.SIGTERM, _log(log_path)
        assert "Shutting down" in _log(log_path)


def _client(base_url: str | None, uds: str | None = None, **kwargs) -> httpx.Client:
    if base_url is None:  # over the unix socket; the URL's host is only the Host header sent
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=uds), base_url="http://anything.example", **kwargs
        )
    return httpx.Client(base_url=base_url, timeout=60, **kwargs)


def _private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture(scope="module", name="secured")
def secured_fixture(
    daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A gateway with keys (alice and bob in a file, one in $KVD_API_KEY), an allowed Host name and a unix
    socket beside its TCP address: (base URL, socket path)."""
    workdir = tmp_path_factory.mktemp("secured")
    keys = _private_file(workdir / "keys", f"# callers\nalice:{ALICE}\n\nbob:{BOB}\n")
    uds = str(workdir / "gateway.sock")
    flags = ("--api-key-file", str(keys), "--allowed-host", ALLOWED, "--uds", uds)
    with running_gateway(daemon, workdir, *flags, env={ENV_KEY: FROM_ENV}) as base_url:
        yield base_url, uds


def _oai(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_every_route_but_health_needs_a_key(secured: tuple[str, str], model: str):
    base_url, _ = secured
    with _client(base_url) as http:
        missing = http.get("/v1/models")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        error = missing.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert "Authorization: Bearer" in error["message"]
        ollama = http.get("/api/tags")  # Ollama's routes answer in Ollama's shape
        assert ollama.status_code == 401 and isinstance(ollama.json()["error"], str)
        assert http.get("/metrics").status_code == 401  # its counters show the callers' activity
        assert http.get("/metrics", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
        assert http.get("/health").status_code == 200  # a probe learns only whether the daemon is ready
        # Anthropic's clients send x-api-key.
        assert http.get("/v1/models", headers={"x-api-key": BOB}).json()["data"][0]["id"] == model
        assert http.get("/api/tags", headers={"x-api-key": "wrong-" + BOB}).status_code == 401
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        _oai(base_url, ALICE[:-1] + "X").models.list()
    for key in (ALICE, FROM_ENV):  # OpenAI's clients send Authorization: Bearer
        reply = _oai(base_url, key).completions.create(model=model, prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens == 2


def test_only_loopback_and_allowed_host_names_are_served(secured: tuple[str, str]):
    base_url, _ = secured
    port = base_url.rpartition(":")[2]
    with _client(base_url, headers={"x-api-key": ALICE}) as http:
        # A web page's script reaching the port through a name of its own (DNS rebinding) sends that name.
        rebound = http.get("/v1/models", headers={"Host": f"evil.example:{port}"})
        assert rebound.status_code == 403 and "--allowed-host" in rebound.json()["error"]["message"]
        ollama = http.get("/api/version", headers={"Host": "evil.example"})
        assert ollama.status_code == 403 and "--allowed-host" in ollama.json()["error"]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", ALLOWED):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize(
    ("header", "served"),
    [
        ("localhost:8000", True),
        ("127.3.2.1", True),
        ("[::1]:8000", True),
        ("gateway.example:443", True),
        ("evil.example", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.nip.io", False),
        ("", False),
        ("[::1", False),
        ("localhost:x", False),
    ],
)
def test_host_header_parsing(header: str, served: bool):
    assert Access.of(None, [ALLOWED], "127.0.0.1").allows_host(host_of(header)) is served


def _cached(client: openai.OpenAI, model: str, **extra) -> int:
    reply = client.completions.create(model=model, prompt=SECRET_PROMPT, max_tokens=1, temperature=0, **extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_caller_cannot_probe_another_callers_cached_prefixes(secured: tuple[str, str], model: str):
    # The probe: send someone's suspected prompt and look at cached_tokens (or at how quick the first token is).
    base_url, _ = secured
    alice, bob = _oai(base_url, ALICE), _oai(base_url, BOB)
    _cached(alice, model)
    assert _cached(alice, model) >= 32  # a caller's repeat hits its own cache
    assert _cached(bob, model) == 0  # another caller's first sight of it does not
    assert _cached(bob, model) >= 32
    # Neither a client's own cache_salt nor the `user` it claims reaches another caller's namespace.
    salted = {"extra_body": {"cache_salt": "team"}}
    _cached(alice, model, **salted)
    assert _cached(alice, model, **salted) >= 32
    assert _cached(bob, model, user="alice", **salted) == 0


def test_a_forwarded_for_header_does_not_change_who_the_caller_is(daemon: DaemonProcess, model: str):
    # Without keys, the caller is its address: a local peer must not choose another with X-Forwarded-For.
    body = {"model": model, "prompt": SECRET_PROMPT + "(no keys)", "max_tokens": 1}
    with _client(daemon.base_url) as http:

        def cached(forwarded_for: str) -> int:
            reply = http.post("/v1/completions", json=body, headers={"X-Forwarded-For": forwarded_for})
            return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached("10.0.0.1")
        assert cached("10.0.0.2") >= 32


def test_the_unix_socket_is_0660_and_serves_any_host_with_a_key(secured: tuple[str, str], model: str):
    _, uds = secured
    assert stat.S_IMODE(os.stat(uds).st_mode) == 0o660
    with _client(None, uds) as http:  # Host: anything.example; no browser reaches a unix socket
        assert http.get("/v1/models").status_code == 401  # the keys still apply
        reply = http.get("/v1/models", headers={"Authorization": f"Bearer {BOB}"})
        assert reply.status_code == 200 and reply.json()["data"][0]["id"] == model


def test_a_unix_socket_alone_replaces_a_stale_one_and_is_removed_at_the_end(
    daemon: DaemonProcess, model: str, tmp_path: Path
):
    uds = tmp_path / "alone.sock"
    stale_socket(uds)  # as a killed gateway leaves it
    with running_gateway(daemon, tmp_path, "--uds", str(uds), http=False), _client(None, str(uds)) as http:
        assert stat.S_IMODE(os.stat(uds).st_mode) == 0o660
        assert http.get("/v1/models").json()["data"][0]["id"] == model  # no keys: any peer that may connect
    assert not uds.exists()


def _refused(*flags: str, env: dict[str, str] | None = None) -> str:
    """`kvd gateway` with `flags` must exit 2 before serving, with one line; its stderr."""
    cmd = [sys.executable, "-m", "kvd.cli", "gateway", "--endpoint", "ipc:///nonexistent/kvd.sock", *flags]
    result = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env={**daemon_env(), **(env or {})}, timeout=60
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_a_key_file_others_may_read_is_refused(tmp_path: Path):
    keys = _private_file(tmp_path / "keys", f"{ALICE}\n", 0o644)
    message = _refused("--api-key-file", str(keys), "--http", f"127.0.0.1:{free_port()}")
    assert str(keys) in message and f"chmod 600 {keys}" in message and ALICE not in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("alice:short\n", "at least 16 characters"),
        (f"alice:{ALICE}\nbob:{ALICE}\n", "given twice"),
        ("# only a comment\n", "holds no key"),
        (f"al!ice:{ALICE}\n", "a name is"),
        (f"al ice:{ALICE}\n", "a line is NAME:KEY or KEY"),
        (f"alice:{ALICE} models=\n", "optionally models=NAME,NAME"),
        (f"alice:{ALICE} smol\n", "optionally models=NAME,NAME"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_line(tmp_path: Path, text: str, expected: str):
    keys = _private_file(tmp_path / "keys", text)
    message = _refused("--api-key-file", str(keys), "--http", f"127.0.0.1:{free_port()}")
    assert expected in message and ALICE not in message, message


def test_a_unix_socket_in_a_folder_others_may_write_is_refused(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # another user could replace the socket with one of their own
    assert "other users may write" in _refused("--uds", str(shared / "gateway.sock"))
    shared.chmod(0o1777)  # sticky, as /tmp: only a file's owner may remove it
    (shared / "gateway.sock").write_text("")
    assert "is not a socket" in _refused("--uds", str(shared / "gateway.sock"))


def test_allowed_host_takes_a_name_without_a_port():
    assert "without a port" in _refused(
        "--allowed-host", "example.com:8000", "--http", f"127.0.0.1:{free_port()}"
    )


def test_the_specific_address_of_http_is_a_served_host_and_a_wildcard_is_not():
    # Only that address reaches such a gateway, and an address is no name: no rebinding through it.
    assert Access.of(None, [], "192.0.2.7").allows_host(host_of("192.0.2.7:8000"))
    assert not Access.of(None, [], "0.0.0.0").allows_host(host_of("0.0.0.0:8000"))
    assert not Access.of(None, [], "0.0.0.0").allows_host(host_of("192.0.2.7:8000"))
    assert Access.of(None, ["*"], "0.0.0.0").allows_host(host_of("anything.example"))

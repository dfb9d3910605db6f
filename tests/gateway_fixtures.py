"""A real daemon with its HTTP gateway (`kvd serve --http`) for end-to-end tests, one per test module that
imports these fixtures: the daemon, a kvd_client on it, its model's name and an openai client on the gateway.
Each fixture's function is named `<fixture>_fixture`, so that the tests' arguments shadow no import."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from daemon_fixtures import DaemonProcess, start_daemon

from kvd_client import Client

# Schemas the API tests share, bounded so that a constrained output ends well within max_tokens: a structured
# output, and the weather tool's parameters.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(base_url: str, path: str) -> tuple[int, str]:
    """The status and body of a plain GET, with no HTTP client library in between."""
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _health_ok(base_url: str) -> bool:
    try:
        return http_get(base_url, "/health")[0] == 200
    except OSError:
        return False


@contextmanager
def gateway_daemon(model: Path, workdir: Path, *args: str) -> Iterator[DaemonProcess]:
    """`kvd serve --http` on a free port (and `args`), with `base_url` set once the gateway answers; it must
    exit 0 at the end and take the gateway with it."""
    port = free_port()
    proc = start_daemon(workdir, "--http", f"127.0.0.1:{port}", *args, model=model)
    proc.base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _health_ok(proc.base_url):
        assert time.monotonic() < deadline, f"the gateway did not answer; log:\n{proc.log()}"
        time.sleep(0.2)
    yield proc
    assert proc.stop() == 0, proc.log()
    with pytest.raises(OSError):  # the gateway went with the daemon
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.fixture(scope="module", name="daemon")
def daemon_fixture(
    tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    with gateway_daemon(tiny_daemon_model, tmp_path_factory.mktemp("gateway")) as proc:
        yield proc


@pytest.fixture(scope="module", name="kvd")
def kvd_fixture(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as client:
        yield client


@pytest.fixture(scope="module", name="model")
def model_fixture(kvd: Client) -> str:
    return kvd.info()["model"]


@pytest.fixture(scope="module", name="oai")
def oai_fixture(daemon: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

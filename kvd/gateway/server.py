"""`kvd gateway`: check the HTTP address, then serve the app with uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

DEFAULT_HTTP = "127.0.0.1:8000"


class GatewayConfigError(ValueError):
    """A gateway setting is invalid; the message names the flag."""


@dataclass
class GatewayConfig:
    host: str
    port: int
    endpoint: str | None = None  # the daemon's; None: $KVD_ENDPOINT or the per-user default
    allow_remote: bool = False
    served_model_name: str | None = None  # None: the daemon's model name
    timeout: float = 30.0
    log_level: str = "info"


def parse_http_address(text: str, allow_remote: bool, flag: str = "--http") -> tuple[str, int]:
    """HOST:PORT (or [::1]:PORT) -> (host, port); a non-loopback host needs `allow_remote`."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise GatewayConfigError(f"{flag} {text!r}: expected HOST:PORT, such as {DEFAULT_HTTP}")
    host = host.removeprefix("[").removesuffix("]")
    if not allow_remote and not _is_loopback(host):
        raise GatewayConfigError(
            f"{flag} {text!r} is reachable from other hosts and the gateway has no authentication; "
            f"use a loopback address such as {DEFAULT_HTTP}, or pass --allow-remote if the network is trusted"
        )
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or "0.0.0.0"-like wildcard: may face the network


def run_gateway(config: GatewayConfig) -> None:
    import uvicorn

    exit_with_parent()

    from kvd.gateway.app import create_app

    app = create_app(config.endpoint, config.served_model_name, config.timeout)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False)


def check_port_free(host: str, port: int, flag: str = "--http") -> None:
    """Fail before the model load when another program holds the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as e:
            raise GatewayConfigError(f"{flag} {host}:{port}: cannot listen there: {e.strerror}") from None


PARENT_ENV = "KVD_GATEWAY_PARENT"  # set by spawn_gateway: the daemon's pid, which the child must not outlive
_PR_SET_PDEATHSIG = 1


def spawn_gateway(http: str, endpoint: str, allow_remote: bool) -> subprocess.Popen:
    """`kvd gateway` as a child process: its own interpreter, so HTTP work never holds the engine's GIL."""
    cmd = [sys.executable, "-m", "kvd.cli", "gateway", "--http", http, "--endpoint", endpoint]
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    return subprocess.Popen([*cmd, "--allow-remote"] if allow_remote else cmd, env=env)


def exit_with_parent() -> None:
    """In a gateway that a daemon spawned: get SIGTERM when the daemon dies (Linux), so that no orphan keeps
    the port; and stop now if it died already."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        return
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):
        raise SystemExit(f"kvd gateway: the daemon that started it (pid {parent}) is gone")


def stop_gateway(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

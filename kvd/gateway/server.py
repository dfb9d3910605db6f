"""`kvd gateway`: check the HTTP address, bind the listeners, then serve the app with uvicorn until SIGINT or
SIGTERM."""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvd.gateway.settings import GatewaySettings
from kvd.settings import to_flags

if TYPE_CHECKING:
    from kvd.gateway.keys import ApiKeys

DEFAULT_HTTP = "127.0.0.1:8000"


class GatewayConfigError(ValueError):
    """A gateway setting is invalid; the message names the flag."""


@dataclass
class GatewayConfig:
    host: str | None  # None: no TCP listener (`--uds` alone)
    port: int
    endpoint: str | None = None  # the daemon's; None: $KVD_ENDPOINT or the per-user default
    allow_remote: bool = False
    served_model_name: str | None = None  # None: the daemon's model name
    timeout: float = 30.0
    log_level: str = "info"
    uds: str | None = None  # a unix socket to serve on, beside the TCP address or alone
    api_keys: ApiKeys | None = None  # from --api-key-file and $KVD_API_KEY; None: no authentication
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides loopback ones (--allowed-host); "*": any


def parse_http_address(text: str, allow_remote: bool, flag: str = "--http") -> tuple[str, int]:
    """HOST:PORT (or [::1]:PORT) -> (host, port); a non-loopback host needs `allow_remote`."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise GatewayConfigError(f"{flag} {text!r}: expected HOST:PORT, such as {DEFAULT_HTTP}")
    host = host.removeprefix("[").removesuffix("]")
    if not allow_remote and not _is_loopback(host):
        raise GatewayConfigError(
            f"{flag} {text!r} is reachable from other hosts, and the gateway has no authentication unless it has "
            f"API keys (--api-key-file or $KVD_API_KEY); use a loopback address such as {DEFAULT_HTTP}, or pass "
            "--allow-remote (with keys, or on a trusted network)"
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
    """Serve until SIGINT or SIGTERM; a listener that cannot be bound is a GatewayConfigError."""
    import uvicorn

    exit_with_parent()

    from kvd.gateway.app import create_app
    from kvd.gateway.auth import Access
    from kvd.gateway.listeners import bind_tcp, bind_unix

    access = Access.of(config.api_keys, config.allowed_hosts, config.host)
    tcp = bind_tcp(config.host, config.port) if config.host is not None else []
    try:
        unix = bind_unix(Path(config.uds)) if config.uds is not None else None
    except GatewayConfigError:
        for sock in tcp:
            sock.close()
        raise
    app = create_app(config.endpoint, config.served_model_name, config.timeout, access)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().shutdown(sockets)
            finally:
                # Here, not after run(): after a graceful stop uvicorn raises the signal that stopped it again.
                if unix is not None:
                    unix.remove()

    # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from any local peer as the client's
    # address, which (without keys) is the caller's identity.
    server = Server(uvicorn.Config(app, log_level=config.log_level, access_log=False, proxy_headers=False))
    log = logging.getLogger("uvicorn.error")  # uvicorn.Config set up its logging
    for warning in _warnings(config):
        log.warning("%s", warning)
    places = [f"http://{_url_host(config.host)}:{config.port}"] if config.host is not None else []
    log.info(
        "kvd gateway serving on %s", " and ".join([*places, *([f"unix socket {config.uds}"] if unix else [])])
    )
    try:
        server.run(sockets=[*tcp, *([unix.sock] if unix else [])])
    finally:  # a failed start too
        if unix is not None:
            unix.remove()


def _warnings(config: GatewayConfig) -> list[str]:
    warnings = []
    if config.host is not None and not _is_loopback(config.host) and config.api_keys is None:
        warnings.append(
            f"{config.host}:{config.port} is reachable from other hosts and the gateway has no authentication: "
            "anyone who can reach it may use the model; give it keys (--api-key-file or $KVD_API_KEY)"
        )
    if "*" in config.allowed_hosts:
        warnings.append(
            "--allowed-host '*': any Host is served, so a web page may reach the gateway through DNS rebinding"
        )
    return warnings


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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


def spawn_gateway(
    http: str, endpoint: str, allow_remote: bool, settings: GatewaySettings
) -> subprocess.Popen:
    """`kvd gateway` as a child process: its own interpreter, so HTTP work never holds the engine's GIL."""
    cmd = [
        sys.executable,
        "-m",
        "kvd.cli",
        "gateway",
        "--http",
        http,
        "--endpoint",
        endpoint,
        *to_flags(settings),
    ]
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

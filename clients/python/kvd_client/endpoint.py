"""Where the daemon listens by default and how an endpoint string is checked.

The daemon imports this module too, so a client and the daemon resolve the default endpoint the same way: an
explicit endpoint, else $KVD_ENDPOINT, else ipc://$XDG_RUNTIME_DIR/kvd.sock, else ipc:///tmp/kvd-$UID/kvd.sock.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from kvd_client.errors import EndpointError, NoDaemonError

ENV_VAR = "KVD_ENDPOINT"
SOCKET_NAME = "kvd.sock"
# sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH_BYTES = 107


@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint: `ipc://ABSOLUTE_PATH` or `tcp://HOST:PORT`."""

    url: str
    transport: str  # "ipc" or "tcp"
    path: Path | None = None  # ipc only
    host: str | None = None  # tcp only
    port: int | None = None  # tcp only

    @property
    def is_loopback(self) -> bool:
        """True for ipc (same host by construction) and for tcp bound to a loopback address."""
        if self.transport == "ipc":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # "*", an interface name or a host name: may face the network

    def __str__(self) -> str:
        return self.url

    def check_listening(self, how_to_choose: str) -> None:
        """Raise NoDaemonError at once when the ipc socket file is missing, instead of waiting for a timeout
        (ZeroMQ would keep retrying the connection silently); `how_to_choose` says how to pick another."""
        if self.transport == "ipc" and not os.path.exists(self.path):
            raise NoDaemonError(
                f"no kvd daemon at {self.url}: the socket file does not exist. Start one with `kvd serve`, "
                f"or point at a running one with {how_to_choose} or ${ENV_VAR}"
            )


def default_socket_dir() -> Path:
    """$XDG_RUNTIME_DIR, else a per-user directory under /tmp (the daemon creates it with mode 0700)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime)
    # Literally /tmp, not $TMPDIR: a client and the daemon must agree even when their environments differ.
    return Path("/tmp") / f"kvd-{os.getuid()}"


def default_endpoint() -> str:
    return f"ipc://{default_socket_dir() / SOCKET_NAME}"


def resolve_endpoint(endpoint: str | None = None) -> Endpoint:
    """The endpoint to use: the argument, else $KVD_ENDPOINT, else the per-user default."""
    return parse_endpoint(endpoint or os.environ.get(ENV_VAR) or default_endpoint())


def parse_endpoint(url: str) -> Endpoint:
    if not isinstance(url, str):
        raise EndpointError(
            f"an endpoint is a string such as ipc:///run/kvd/kvd.sock, got {type(url).__name__}"
        )
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise EndpointError(f"endpoint {url!r} has no scheme: use ipc://ABSOLUTE_PATH or tcp://HOST:PORT")
    if scheme == "ipc":
        return _parse_ipc(url, rest)
    if scheme == "tcp":
        return _parse_tcp(url, rest)
    raise EndpointError(f"endpoint {url!r}: unsupported transport {scheme!r}; use ipc:// or tcp://")


def _parse_ipc(url: str, path: str) -> Endpoint:
    if path.startswith("@"):
        raise EndpointError(
            f"endpoint {url!r}: abstract sockets have no file permissions; use a filesystem path"
        )
    if not path.startswith("/"):
        raise EndpointError(f"endpoint {url!r}: the ipc path must be absolute (client and daemon cwd differ)")
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise EndpointError(
            f"endpoint {url!r}: the socket path is longer than {MAX_IPC_PATH_BYTES} bytes, the limit of a "
            "unix socket address; choose a shorter path"
        )
    return Endpoint(url=url, transport="ipc", path=Path(path))


def _parse_tcp(url: str, rest: str) -> Endpoint:
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host:
        raise EndpointError(f"endpoint {url!r}: expected tcp://HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # [::1]
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise EndpointError(f"endpoint {url!r}: the port must be a number in [1, 65535]")
    return Endpoint(url=url, transport="tcp", host=host, port=int(port_text))

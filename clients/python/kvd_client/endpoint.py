"""Where the daemon listens by default and how an endpoint string is checked.

The daemon imports this module too, so a client and the daemon resolve the default endpoint the same way: an
explicit endpoint, else $KVD_ENDPOINT, else ipc://$XDG_RUNTIME_DIR/kvd.sock, else ipc:///tmp/kvd-$UID/kvd.sock.
The last one lies in a folder anyone could create first, so it is used only when that folder is private.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvd_client.errors import EndpointError, NoDaemonError

ENV_VAR = "KVD_ENDPOINT"
SOCKET_NAME = "kvd.sock"
# sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH_BYTES = 107
# How a user whose /tmp folder is unsafe still reaches a daemon.
_ELSEWHERE = f"or set XDG_RUNTIME_DIR or {ENV_VAR} to choose another endpoint"


@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint: `ipc://ABSOLUTE_PATH` or `tcp://HOST:PORT`."""

    url: str
    transport: str  # "ipc" or "tcp"
    path: Path | None = None  # ipc only
    host: str | None = None  # tcp only
    port: int | None = None  # tcp only
    # The /tmp folder the default endpoint fell back to: checked again before each request, since another
    # user may create it after the endpoint was resolved (the daemon not started yet).
    private_dir: Path | None = field(default=None, compare=False, repr=False)

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

    @property
    def is_ipv6(self) -> bool:
        """True for tcp to an IPv6 address (tcp://[::1]:PORT): its socket needs ZeroMQ's IPv6 mode. Only such a
        host holds a colon. Host names keep to IPv4 on both sides: in IPv6 mode libzmq would resolve localhost
        to ::1 while a daemon bound it to 127.0.0.1."""
        return self.transport == "tcp" and ":" in self.host

    def __str__(self) -> str:
        return self.url

    def check_listening(self, how_to_choose: str) -> None:
        """Raise NoDaemonError at once when the ipc socket file is missing, instead of waiting for a timeout
        (ZeroMQ would keep retrying the connection silently); `how_to_choose` says how to pick another."""
        if self.private_dir is not None:
            check_private_dir(self.private_dir)
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
    """The endpoint to use: the argument, else $KVD_ENDPOINT, else the per-user default; EndpointError when the
    default falls back to a /tmp folder that is not this user's private one."""
    chosen = endpoint or os.environ.get(ENV_VAR)
    if chosen:
        return parse_endpoint(chosen)
    resolved = parse_endpoint(default_endpoint())
    if os.environ.get("XDG_RUNTIME_DIR"):
        return resolved  # made by the login manager for this user alone
    shared = default_socket_dir()
    check_private_dir(shared)
    return replace(resolved, private_dir=shared)


def check_private_dir(directory: Path) -> None:
    """Raise EndpointError unless `directory` is a real directory of this user closed to others, as the daemon
    demands of it: anyone may create /tmp/kvd-$UID first and listen there, reading every prompt sent. A
    missing directory passes: the daemon creates it."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    except OSError as e:
        raise EndpointError(f"cannot check {directory}: {e.strerror}; {_ELSEWHERE}") from None
    if stat.S_ISLNK(st.st_mode):
        raise EndpointError(
            f"{directory} is a symbolic link, not a directory of yours; remove it, {_ELSEWHERE}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"{directory} is not a directory; remove it, {_ELSEWHERE}")
    if st.st_uid != os.getuid():
        raise EndpointError(f"{directory} belongs to another user (uid {st.st_uid}); remove it, {_ELSEWHERE}")
    if st.st_mode & 0o077:
        raise EndpointError(
            f"{directory} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run `chmod 700 {directory}`, {_ELSEWHERE}"
        )


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

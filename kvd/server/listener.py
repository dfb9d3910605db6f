"""The daemon's sockets (requests and events): endpoint policy, the socket directory, permissions, stale
sockets, and closing them."""

from __future__ import annotations

import contextlib
import grp
import ipaddress
import logging
import os
import stat
from pathlib import Path

import zmq

from kvd.gateway.listeners import probe_socket_file
from kvd.gateway.server import check_port_free
from kvd.server.config import HEARTBEAT_INTERVAL_S, ServerConfig
from kvd_client.endpoint import Endpoint, default_socket_dir

logger = logging.getLogger("kvd.server")


RECEIVE_HWM = 64


class ListenError(RuntimeError):
    """The daemon cannot listen where it was asked to; the message says what to change."""


def check_endpoint(endpoint: Endpoint, config: ServerConfig, flag: str = "--listen") -> None:
    """Refuse what the flags do not allow, before the (slow) model load; `flag` is the one that chose it."""
    if not endpoint.is_loopback and not config.allow_remote:
        raise ListenError(
            f"{endpoint} is reachable from other hosts and kvd has no authentication; listen on "
            "tcp://127.0.0.1:PORT, tcp://[::1]:PORT or ipc://PATH, or pass --allow-remote if the network is trusted"
        )
    if config.socket_group is not None:
        if endpoint.transport != "ipc":
            raise ListenError("--socket-group applies to ipc:// endpoints only")
        _group_id(config.socket_group)
    if endpoint.transport == "ipc":
        _check_socket_dir(endpoint.path.parent)
        _remove_stale_socket(endpoint, flag)
    elif endpoint.host == "localhost" or _is_address(
        endpoint.host
    ):  # "*" or an interface: found at bind time
        check_port_free("127.0.0.1" if endpoint.host == "localhost" else endpoint.host, endpoint.port, flag)


def _is_address(host: str | None) -> bool:
    try:
        ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return True


def open_router(context: zmq.Context, endpoint: Endpoint, config: ServerConfig) -> zmq.Socket:
    """Bind the ROUTER socket; an ipc socket file gets mode 0600, or 0660 with --socket-group."""
    sock = context.socket(zmq.ROUTER)
    # Sends to a vanished peer fail with EHOSTUNREACH instead of vanishing silently (see outbox.py).
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, config.socket_max_message_bytes)
    # Messages queued per connection before libzmq stops reading it (backpressure on that peer alone): the
    # default 1000 let one connection buffer about 2 GiB of maximal messages.
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    sock.setsockopt(zmq.IPV6, endpoint.is_ipv6)
    if endpoint.transport == "tcp":
        # A peer whose host died never closes its connection; ZMTP pings find it.
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_INTERVAL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.client_timeout * 1000))
    try:
        if endpoint.transport == "ipc":
            _bind_ipc(sock, endpoint, config.socket_group)
        else:
            sock.bind(endpoint.url)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ListenError(f"cannot listen on {endpoint}: {e}") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def open_publisher(context: zmq.Context, endpoint: Endpoint, config: ServerConfig) -> zmq.Socket:
    """Bind the event stream's PUB socket, with the same file mode as the request socket."""
    sock = context.socket(zmq.PUB)
    sock.setsockopt(zmq.IPV6, endpoint.is_ipv6)
    try:
        if endpoint.transport == "ipc":
            _bind_ipc(sock, endpoint, config.socket_group, "--events")
        else:
            sock.bind(endpoint.url)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ListenError(f"cannot publish events on {endpoint}: {e}") from None
    return sock


def close_socket(sock: zmq.Socket, endpoint: Endpoint, linger_ms: int) -> None:
    """Close a bound socket (ROUTER or PUB) and remove the ipc file libzmq leaves, unless it is no longer ours."""
    bound = None
    if endpoint.transport == "ipc":
        with contextlib.suppress(FileNotFoundError):
            bound = os.stat(endpoint.path)
    sock.close(linger=linger_ms)
    if bound is not None:
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(endpoint.path)
            if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                os.unlink(endpoint.path)


def _bind_ipc(sock: zmq.Socket, endpoint: Endpoint, group: str | None, flag: str = "--listen") -> None:
    _remove_stale_socket(endpoint, flag)  # again: another daemon may have started during our model load
    mode = 0o660 if group else 0o600
    gid = _group_id(group) if group else -1
    # The file is created with the right mode (umask), so no client can connect in a window before chmod.
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(endpoint.url)
    finally:
        os.umask(old_umask)
    path = endpoint.path
    if group:
        try:
            os.chown(path, -1, gid)
        except PermissionError:
            raise ListenError(
                f"cannot give {path} to group {group!r}: the daemon's user must belong to it"
            ) from None
        if not path.parent.stat().st_mode & stat.S_IXGRP:
            logger.warning(
                "%s is not searchable by group %s: its members cannot reach the socket", path.parent, group
            )
    os.chmod(path, mode)


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ListenError(f"--socket-group {group!r}: no such group") from None


def _check_socket_dir(directory: Path) -> None:
    if directory == default_socket_dir() and not os.environ.get("XDG_RUNTIME_DIR"):
        _ensure_private_dir(directory)
    elif not directory.is_dir():
        raise ListenError(
            f"the socket directory {directory} does not exist; create it or choose another path"
        )


def _ensure_private_dir(directory: Path) -> None:
    """/tmp is shared: the per-user directory must be ours, not a symlink, and closed to others."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ListenError(f"{directory} exists and is not a directory; remove it or use --listen")
    if st.st_uid != os.getuid():
        raise ListenError(f"{directory} belongs to another user; remove it or use --listen")
    if st.st_mode & 0o077:
        raise ListenError(f"{directory} is open to other users; run `chmod 700 {directory}`")


def _remove_stale_socket(endpoint: Endpoint, flag: str) -> None:
    """libzmq replaces an existing socket file on bind, which would silently steal a running daemon's
    clients: refuse if one answers there, remove the file if it is a leftover of a dead daemon."""
    path = endpoint.path
    try:
        found = probe_socket_file(path)
    except ValueError:
        raise ListenError(f"{path} exists and is not a socket; remove it or choose another path") from None
    except OSError as e:
        raise ListenError(f"cannot check whether a daemon listens on {endpoint}: {e}") from None
    if found is None:
        return
    if found[1]:
        raise ListenError(f"another daemon already listens on {endpoint}; stop it or choose another {flag}")
    path.unlink()
    logger.info("removed the stale socket %s left by a daemon that is gone", path)

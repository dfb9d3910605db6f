"""The gateway's listening sockets, bound here rather than by uvicorn: a TCP address (--http) and a unix socket
(--uds), one or both. uvicorn would make a unix socket 0666 (any local user could connect); this one is 0660
from the moment it exists."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from kvd.gateway.server import GatewayConfigError

UDS_MODE = 0o660  # the gateway's user and group: give the group to the local users who may use it


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """A socket for each address of `host` ("localhost" may be 127.0.0.1 and ::1), as uvicorn binds them."""
    sockets = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(
                    socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1
                )  # the IPv4 address is its own socket
            sock.bind(address)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise GatewayConfigError(f"--http {host}:{port}: cannot listen there: {e.strerror or e}") from None
    return sockets


@dataclass
class UnixSocket:
    path: Path
    sock: socket.socket
    file: tuple[int, int]  # the socket file's (device, inode), so that removal spares a newer gateway's file

    def remove(self) -> None:
        """Remove the socket file at the end, unless another gateway has replaced it meanwhile."""
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self.file:
                os.unlink(self.path)


def bind_unix(path: Path) -> UnixSocket:
    """A unix socket at `path`, mode 0660; a socket file left by a gateway that died is replaced."""
    _check_folder(path)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Created with its mode (the umask), so no one can connect in a window before a chmod. The gateway runs no
    # other thread yet, so nothing else creates files under this umask.
    old_umask = os.umask(0o777 & ~UDS_MODE)
    try:
        sock.bind(os.fspath(path))
    except OSError as e:
        sock.close()
        raise GatewayConfigError(f"--uds {path}: cannot listen there: {e.strerror or e}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, UDS_MODE)
    st = os.lstat(path)
    return UnixSocket(path, sock, (st.st_dev, st.st_ino))


def _check_folder(path: Path) -> None:
    """Another user who may write to the folder could replace the socket with one of its own, and take the
    callers' requests and keys: the folder must be this user's or root's, and closed to others' writes unless
    sticky (as /tmp: there only a file's owner may remove or rename it)."""
    folder = path.parent
    try:
        st = os.stat(folder)
    except OSError as e:
        raise GatewayConfigError(f"--uds {path}: the folder {folder}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise GatewayConfigError(f"--uds {path}: {folder} is not a folder")
    if st.st_uid not in (os.geteuid(), 0):
        raise GatewayConfigError(
            f"--uds {path}: the folder {folder} belongs to another user (uid {st.st_uid}); choose a folder of yours"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise GatewayConfigError(
            f"--uds {path}: other users may write to the folder {folder}; run `chmod go-w {folder}` (or "
            "`chmod +t`) or choose a folder of yours"
        )


def probe_socket_file(path: Path) -> tuple[os.stat_result, bool] | None:
    """The unix socket file at `path` and whether a server answers on it (None: no file there). Raises
    ValueError when the path is no socket, and OSError when a probe cannot tell. The
    daemon's listener uses it too: binding over a live socket would silently take its server's clients."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError as e:
            if e.errno != errno.ECONNREFUSED:
                raise
            return st, False
    return st, True


def _remove_stale(path: Path) -> None:
    """A socket file nobody listens on is a dead gateway's: remove it. One that answers is refused."""
    try:
        found = probe_socket_file(path)
    except ValueError:
        raise GatewayConfigError(
            f"--uds {path} exists and is not a socket; remove it or choose another path"
        ) from None
    except OSError as e:
        raise GatewayConfigError(f"--uds {path}: cannot check whether a gateway listens there: {e}") from None
    if found is None:
        return
    st, listening = found
    if listening:
        raise GatewayConfigError(
            f"--uds {path}: a program already listens there; stop it or choose another path"
        )
    if st.st_uid != os.geteuid():
        raise GatewayConfigError(
            f"--uds {path} is another user's stale socket; remove it or choose another path"
        )
    path.unlink()

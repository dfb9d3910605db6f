"""The rendezvous store rank 0 hosts: kvd's startup exchange and torch.distributed's own (the process group's
addresses, NCCL's unique id) go through it.

Not torch's TCPStore: that listens on every interface whatever host it is given and lets any peer read and
write every key, so a host on the network could join the group, read every step and steer its outputs. This
one binds the one address given, and serves a connection only after it proved the group's secret
(kvd.parallel.handshake). It implements the torch.distributed Store calls kvd and the process groups use; rank
0 reads and writes its table directly (LocalStore), the other ranks over one connection each (RemoteStore).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch.distributed as dist

from kvd.parallel import handshake
from kvd.parallel.wire import recv_frame, send_frame

logger = logging.getLogger("kvd.parallel")

HANDSHAKE_TIMEOUT_S = 10.0  # a peer that does not answer the challenge in time is dropped
CONNECT_RETRY_S = 0.2  # a rank started before rank 0 retries until the startup timeout
_MAX_FRAME_BYTES = 64 << 20  # the largest value torch stores is a few KiB; this only bounds a broken peer


class StoreTimeout(TimeoutError):
    """A key was not set within the store's timeout."""


@dataclass
class Table:
    """The keys and values, with the waiting torch's stores do: a get blocks until its key is set."""

    values: dict[str, bytes] = field(default_factory=dict)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self.changed:
            self._wait([key], timeout_s)
            return self.values[key]

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            total = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(total).encode()
            self.changed.notify_all()
            return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set `desired` if the value is `expected` (absent counts as b""); the value after."""
        with self.changed:
            current = self.values.get(key)
            if current != expected and not (current is None and not expected):
                return expected if current is None else current
            self.values[key] = desired
            self.changed.notify_all()
            return desired

    def check(self, keys: list[str]) -> bool:
        with self.changed:
            return all(k in self.values for k in keys)

    def wait(self, keys: list[str], timeout_s: float) -> None:
        with self.changed:
            self._wait(keys, timeout_s)

    def _wait(self, keys: list[str], timeout_s: float) -> None:
        if not self.changed.wait_for(lambda: all(k in self.values for k in keys), timeout_s):
            raise StoreTimeout(f"the keys {keys} were not set within {timeout_s:g} s")

    def delete_key(self, key: str) -> bool:
        with self.changed:
            return self.values.pop(key, None) is not None

    def num_keys(self) -> int:
        with self.changed:
            return len(self.values)


_OPERATIONS = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys")


def _apply(table: Table, request: list) -> list:
    """One request [operation, *arguments] -> [True, result] or [False, message]."""
    try:
        operation, *arguments = request
        if operation not in _OPERATIONS:
            return [False, f"unknown operation {operation!r}"]
        return [True, getattr(table, operation)(*arguments)]
    except (TypeError, ValueError, StoreTimeout) as e:
        return [False, str(e)]


class RendezvousStore(dist.Store):
    """torch.distributed's Store interface over `_call(operation, *arguments)`."""

    def __init__(self, timeout_s: float, local_address: str) -> None:
        super().__init__()
        self.set_timeout(timedelta(seconds=timeout_s))
        self.local_address = local_address  # where this rank met the others: its network interface

    def _call(self, operation: str, *arguments: object) -> object:
        raise NotImplementedError

    def _timeout_s(self, timeout: timedelta | None = None) -> float:
        return (timeout or self.timeout).total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._timeout_s())

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return self._call("compare_set", key, *as_bytes)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", list(keys), self._timeout_s(timeout))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


class LocalStore(RendezvousStore):
    """Rank 0's view: the table it serves."""

    def __init__(self, table: Table, timeout_s: float, local_address: str) -> None:
        super().__init__(timeout_s, local_address)
        self.table = table

    def _call(self, operation: str, *arguments: object) -> object:
        ok, result = _apply(self.table, [operation, *arguments])
        if not ok:
            raise RuntimeError(f"rendezvous store: {result}")
        return result


class RemoteStore(RendezvousStore):
    """Another rank's view: one authenticated connection to rank 0, one request at a time."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        super().__init__(timeout_s, sock.getsockname()[0])
        self.sock = sock
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, address: str, port: int, secret: bytes, timeout_s: float) -> RemoteStore:
        """Connect (retrying while rank 0 is not listening yet, up to timeout_s) and prove the secret.

        Raises handshake.HandshakeError when either side's proof fails, OSError when rank 0 never listened."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except (ConnectionRefusedError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(CONNECT_RETRY_S)
        try:
            handshake.join(sock, secret)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)  # a get may wait as long as the store's timeout: the server bounds it
        return cls(sock, timeout_s)

    def _call(self, operation: str, *arguments: object) -> object:
        with self._lock:
            try:
                send_frame(self.sock, msgpack.packb([operation, *arguments]))
                ok, result = msgpack.unpackb(recv_frame(self.sock, _MAX_FRAME_BYTES))
            except OSError as e:
                raise RuntimeError(f"rendezvous store: rank 0 is gone ({e})") from e
        if not ok:
            raise RuntimeError(f"rendezvous store: {result}")
        return result

    def close(self) -> None:
        self.sock.close()


@dataclass
class StoreServer:
    """Rank 0's listener on exactly one address; a thread per connection, each served after the handshake."""

    sock: socket.socket
    secret: bytes
    table: Table = field(default_factory=Table)
    _connections: set[socket.socket] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, address: str, port: int, secret: bytes) -> StoreServer:
        """Listen on address:port (OSError when it cannot: the port taken, an address not this host's)."""
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted daemon need not wait out TIME_WAIT; a port another socket listens on stays refused.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        server = cls(sock, secret)
        threading.Thread(target=server._accept, name="kvd-tp-rendezvous", daemon=True).start()
        return server

    @property
    def address(self) -> str:
        return self.sock.getsockname()[0]

    def local_store(self, timeout_s: float) -> LocalStore:
        return LocalStore(self.table, timeout_s, self.address)

    def stop_listening(self) -> None:
        """Accept no more connections (every rank has joined); the ranks' connections stay served."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self.sock.close()

    def close(self) -> None:
        self.stop_listening()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError as e:
                if (
                    not self._closed.is_set()
                ):  # a peer gone before accept, out of descriptors: go on listening
                    logger.warning("tensor parallel: the rendezvous could not accept a connection: %s", e)
                    time.sleep(CONNECT_RETRY_S)
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="kvd-tp-store", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        where = f"{peer[0]}:{peer[1]}"
        with conn:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                handshake.accept(conn, self.secret)
            except OSError as e:  # HandshakeError included
                # The group is not disturbed: this connection ends, the ranks' own go on.
                logger.warning("tensor parallel: refused %s at the rendezvous: %s", where, e)
                return
            conn.settimeout(None)
            with self._lock:
                self._connections.add(conn)
            try:
                while True:
                    request = msgpack.unpackb(recv_frame(conn, _MAX_FRAME_BYTES))
                    reply = (
                        _apply(self.table, request) if isinstance(request, list) else [False, "not a list"]
                    )
                    send_frame(conn, msgpack.packb(reply))
            except (OSError, ValueError, msgpack.exceptions.UnpackException):
                pass  # the rank left (or broke the protocol): its connection ends, the others go on
            finally:
                with self._lock:
                    self._connections.discard(conn)

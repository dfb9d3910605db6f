"""Length-prefixed frames on a stream socket: the rendezvous's handshake and store requests both use them."""

from __future__ import annotations

import socket
import struct

_LENGTH = struct.Struct(">I")


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, max_bytes: int) -> bytes:
    """The next frame; ConnectionError when the peer closed or announced more than max_bytes (a frame is
    only read whole, so a peer cannot make this side hold more than max_bytes for it)."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > max_bytes:
        raise ConnectionError(f"the peer sent a frame of {length} bytes, more than {max_bytes}")
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = sock.recv(size - len(buffer))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buffer += chunk
    return bytes(buffer)

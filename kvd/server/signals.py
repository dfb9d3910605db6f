"""SIGTERM and SIGINT as readable bytes on a socket, so the daemon's poller wakes up for them."""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def signal_wakeup() -> Iterator[socket.socket]:
    """A socket that becomes readable (one byte per signal number) on SIGTERM or SIGINT, for the poller."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    # The handlers do nothing: the byte on the wakeup socket is the event.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield reader
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()

"""sd_notify with the standard library: READY, WATCHDOG, STOPPING, EXTEND_TIMEOUT_USEC and STATUS datagrams to
$NOTIFY_SOCKET."""

from __future__ import annotations

import logging
import os
import socket
import time

logger = logging.getLogger("kvd.server")


class Notifier:
    """Talks to the service manager when it asked to be told ($NOTIFY_SOCKET set); a no-op otherwise."""

    def __init__(self, environ: dict[str, str] | None = None, stop_timeout_s: float | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval = _watchdog_interval(env)
        # How long stopping takes at most (the drain, then the flush); None: the unit's TimeoutStopSec decides.
        self.stop_timeout_s = stop_timeout_s
        self._last_watchdog = 0.0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}")

    def stopping(self, status: str) -> None:
        """STOPPING=1, with EXTEND_TIMEOUT_USEC covering the whole stop: systemd then waits for a drain longer
        than TimeoutStopSec instead of killing it, whatever the unit says."""
        extend = f"EXTEND_TIMEOUT_USEC={int(self.stop_timeout_s * 1e6)}\n" if self.stop_timeout_s else ""
        self.send(f"STOPPING=1\n{extend}STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        """WATCHDOG=1 if half of WatchdogSec passed since the last one (systemd's recommended pace)."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_interval:
            self._last_watchdog = now
            self.send("WATCHDOG=1")

    def send(self, message: str) -> None:
        if self.address is None:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto(message.encode(), self.address)
            except OSError as e:
                # The manager may be restarting; serving clients matters more than telling it.
                logger.warning("cannot notify the service manager at %s: %s", self.address, e)


def _socket_address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # an abstract socket name
    if value.startswith("/"):
        return value
    logger.warning("ignoring NOTIFY_SOCKET=%r: neither an absolute path nor an abstract name (@...)", value)
    return None


def _watchdog_interval(env: dict[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 messages, or None when the watchdog is off or meant for another process."""
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None

"""One daemon connection per HTTP caller, so that the daemon's fair queue and per-client limits (which it keeps
per connection) share it among the gateway's callers rather than treat them as one client."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request

from kvd.gateway.auth import caller_of
from kvd_client import AsyncClient

KEEP = 256  # caller connections at most; past them, callers share one
IDLE_S = 60.0  # an idle connection (nothing in flight) unused this long makes room for a new caller


def connection_of(request: Request, user: str | None = None) -> str:
    """Whose connection runs the request: its caller's (a key's name, else the peer's address: kvd.gateway.auth),
    and within that caller its `user` field (OpenAI's end-user id) where given. `user` only shares the daemon
    fairly among an application's end users; it never chooses a prefix-cache namespace (anyone may claim any
    `user`), and it cannot reach another caller's connection."""
    caller = caller_of(request)
    return f"{caller}, user {user}" if user else caller


class CallerClients:
    """The connection of each caller, opened at its first request. At KEEP connections, one idle for IDLE_S is
    closed to make room; while none is, a new caller gets the shared connection (`shared`), so that callers
    named at will (`user` is the client's to choose) cannot open sockets without bound."""

    def __init__(self, connect: Callable[[], AsyncClient], shared: AsyncClient) -> None:
        self.connect = connect
        self.shared = shared
        self.clients: dict[str, tuple[AsyncClient, float]] = {}  # least recently used first

    def get(self, caller: str) -> AsyncClient:
        now = time.monotonic()
        client = self.clients.pop(caller, (None, 0.0))[0]
        if client is None:
            for key, (other, used) in list(self.clients.items()):  # oldest first
                if len(self.clients) < KEEP:
                    break
                if other.in_flight == 0 and now - used >= IDLE_S:
                    del self.clients[key]
                    other.close()
            if len(self.clients) >= KEEP:
                return self.shared
            client = self.connect()
        self.clients[caller] = (client, now)
        return client

    def close(self) -> None:
        for client, _ in self.clients.values():
            client.close()
        self.clients.clear()

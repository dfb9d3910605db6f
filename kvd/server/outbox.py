"""Sending replies without ever blocking the loop, and noticing clients that are gone or no longer reading."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import zmq

from kvd.server.config import HEARTBEAT_INTERVAL_S
from kvd.server.protocol import encode, heartbeat_reply
from kvd.server.sessions import ClientSession, Sessions

_HEARTBEAT = encode(heartbeat_reply())


class _Outcome(enum.Enum):
    SENT = enum.auto()
    FULL = enum.auto()  # the client's queue is at its high-water mark: it is not reading
    GONE = enum.auto()  # no connection has this routing id any more


class Outbox:
    """Every send is non-blocking on a ROUTER_MANDATORY socket, so a vanished client shows at once as
    EHOSTUNREACH and a client that stopped reading as EAGAIN. Replies a reader cannot take yet are held per
    client, in order; `on_lost` is called for a client that is gone or has accepted nothing for
    `client_timeout` seconds (the flag says it timed out), so the daemon can abort its requests."""

    def __init__(
        self,
        socket: zmq.Socket,
        sessions: Sessions,
        client_timeout: float,
        on_lost: Callable[[ClientSession, str, bool], None],
    ) -> None:
        self.socket = socket
        self.sessions = sessions
        self.client_timeout = client_timeout
        self.on_lost = on_lost

    def send(self, identity: bytes, reply: dict) -> None:
        payload = encode(reply)
        session = self.sessions.get(identity)
        if session is None:
            # Nothing in flight for this client: a reply it cannot take now is dropped; nothing to free.
            self._try(identity, payload)
        elif session.backlog:
            session.backlog.append(payload)
        else:
            self._deliver(session, payload)

    def service(self) -> None:
        """Retry held replies, give up on clients that stopped reading, heartbeat clients with requests."""
        now = time.monotonic()
        for session in self.sessions:
            if session.backlog:
                self._flush(session, now)
            elif (
                session.requests or session.num_waiting
            ) and now - session.last_sent >= HEARTBEAT_INTERVAL_S:
                # Also the probe that finds a vanished client whose requests send nothing yet (non-streaming).
                self._deliver(session, _HEARTBEAT)

    @property
    def has_backlog(self) -> bool:
        return any(s.backlog for s in self.sessions)

    def _deliver(self, session: ClientSession, payload: bytes) -> None:
        outcome = self._try(session.identity, payload)
        if outcome is _Outcome.SENT:
            self._progress(session)
        elif outcome is _Outcome.FULL:
            session.backlog.append(payload)
            session.stalled_since = time.monotonic()
        else:
            self.on_lost(session, "disconnected", False)

    def _flush(self, session: ClientSession, now: float) -> None:
        while session.backlog:
            outcome = self._try(session.identity, session.backlog[0])
            if outcome is _Outcome.GONE:
                self.on_lost(session, "disconnected", False)
                return
            if outcome is _Outcome.FULL:
                self._on_stalled(session, now)
                return
            session.backlog.popleft()
            self._progress(session)
        session.notices_until = None
        self.sessions.release_if_idle(session)

    def _on_stalled(self, session: ClientSession, now: float) -> None:
        stalled_since = session.stalled_since or now
        if session.requests:
            if now - stalled_since >= self.client_timeout:
                self.on_lost(session, f"read nothing for {self.client_timeout:g} s", True)
        elif now >= (session.notices_until or stalled_since + self.client_timeout):
            self.sessions.remove(session)  # nothing in flight: what it never read is dropped

    def _progress(self, session: ClientSession) -> None:
        session.last_sent = time.monotonic()
        session.stalled_since = None

    def _try(self, identity: bytes, payload: bytes) -> _Outcome:
        try:
            self.socket.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            return _Outcome.FULL
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return _Outcome.GONE
            raise
        return _Outcome.SENT

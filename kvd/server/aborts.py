"""Generations that end before the engine finishes them: aborts, the end of a drain, a failed engine step,
and the clients that are lost (gone, or no longer reading)."""

from __future__ import annotations

import logging
import time
from collections import deque

from kvd.server import protocol
from kvd.server.models import ServedModel
from kvd.server.protocol import CLIENT_TIMEOUT, INTERNAL, NOT_FOUND, SHUTTING_DOWN
from kvd.server.replies import Replies
from kvd.server.sessions import ClientSession, Generation
from kvd.server.state import ServerState

logger = logging.getLogger("kvd.server")

# How long a client that stopped reading keeps its `client_timeout` errors waiting for it to read again.
TIMEOUT_NOTICE_S = 60.0


class Aborts:
    def __init__(self, state: ServerState, replies: Replies) -> None:
        self.state = state
        self.replies = replies

    def abort(self, session: ClientSession, generation: Generation) -> None:
        """Abort wherever the generation is (engine, queue, tokenizer) and send its final reply, reason abort."""
        self._forget(session, generation)
        del session.requests[generation.id]
        self.replies.publish_finished(session, generation, "abort")
        if generation.embed is None:
            reply = self.replies.final_reply(generation, "abort")
        else:  # an embed request has no partial result to give
            code = SHUTTING_DOWN if self.state.draining else NOT_FOUND
            reply = protocol.error_reply(generation.id, code, "the embed request was aborted")
        self.replies.send(session.identity, reply)

    def abort_all(self) -> None:
        for session in self.state.sessions:
            for generation in list(session.requests.values()):
                self.abort(session, generation)
            self.state.sessions.release_if_idle(session)

    def fail_all(
        self, message: str = "the engine failed; see the log", model: ServedModel | None = None
    ) -> None:
        """Fail every generation in flight (of `model` alone, where given) with an internal error."""
        for session in self.state.sessions:
            for generation in list(session.requests.values()):
                if model is not None and generation.model is not model:
                    continue
                self._forget(session, generation)
                del session.requests[generation.id]
                self.replies.publish_finished(session, generation, "error")
                self.replies.send(
                    session.identity,
                    protocol.error_reply(generation.id, INTERNAL, message),
                )
            self.state.sessions.release_if_idle(session)

    def lose_client(self, session: ClientSession, reason: str, timed_out: bool = False) -> None:
        """The client is gone or not reading: free everything it holds (called by the outbox).

        A client that only stopped reading may come back: it then gets, after what it had been sent, one
        `client_timeout` error per aborted generation, so that none of its requests ends in silence."""
        notices = deque()
        for generation in session.requests.values():
            self._forget(session, generation)
            self.replies.publish_finished(session, generation, "abort")
            if timed_out:
                message = (
                    f"this client read no reply for {self.state.config.client_timeout:g} s "
                    "(--client-timeout); the request was aborted"
                )
                notices.append(protocol.encode(protocol.error_reply(generation.id, CLIENT_TIMEOUT, message)))
        if session.requests:
            self.state.counters.clients_lost += 1
            logger.info("client %s %s: aborted its %d requests", session.name, reason, len(session.requests))
        session.requests.clear()
        session.pending.clear()
        session.backlog = notices
        if notices:
            now = time.monotonic()
            session.stalled_since = now
            session.notices_until = now + TIMEOUT_NOTICE_S
        else:
            self.state.sessions.remove(session)

    def _forget(self, session: ClientSession, generation: Generation) -> None:
        """Take the generation out of the engine (its blocks are free at once) or out of its client's queue."""
        if generation.engine_ids:
            for engine_id in generation.engine_ids:
                if self.state.in_engine.pop(engine_id, None) is not None:
                    generation.model.engine.abort(engine_id)
        elif generation in session.pending:  # else it is still being tokenized
            session.pending.remove(generation)

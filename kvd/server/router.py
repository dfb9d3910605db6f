"""Engine outputs back to their clients: stream chunks, finals, aborts, and clients that are lost."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable

import zmq

from kvd.engine.outputs import RequestOutput
from kvd.server import events, protocol
from kvd.server.outbox import Outbox
from kvd.server.protocol import CLIENT_TIMEOUT, INTERNAL
from kvd.server.sessions import ClientSession, InflightRequest
from kvd.server.state import ServerState

logger = logging.getLogger("kvd.server")

# How long a client that stopped reading keeps its `client_timeout` errors waiting for it to read again.
TIMEOUT_NOTICE_S = 60.0


class Router:
    def __init__(self, state: ServerState, sock: zmq.Socket) -> None:
        self.state = state
        self.outbox = Outbox(sock, state.sessions, state.config.client_timeout, self.lose_client)

    def send(self, identity: bytes, reply: dict) -> None:
        self.outbox.send(identity, reply)

    def route(self, out: RequestOutput) -> None:
        identity, rid = out.request_id
        session = self.state.sessions.get(identity)
        request = session.requests.get(rid) if session else None
        if request is None:
            return  # its client was lost earlier in this turn
        request.num_output_tokens = out.num_output_tokens
        request.num_cached_tokens = out.num_cached_tokens
        logprobs = protocol.logprobs_payload(out.logprobs or []) if request.want_logprobs else None
        if request.stream:
            if out.finished:
                reply = self._final(request, out.finish_reason, out.new_text, out.new_token_ids, logprobs)
            else:
                reply = protocol.chunk_reply(rid, out.new_text, out.new_token_ids, logprobs)
        else:
            request.text.append(out.new_text)
            request.token_ids.extend(out.new_token_ids)
            request.logprobs.extend(logprobs or [])
            reply = self._final(request, out.finish_reason) if out.finished else None
        if out.finished:
            del session.requests[rid]
            self.publish_finished(session, request, out.finish_reason)
        if reply is not None:
            self.send(identity, reply)
        if out.finished:
            self.state.sessions.release_if_idle(session)

    def note_preemptions(self, engine_ids: list[Hashable]) -> None:
        """Count and announce each preemption the engine reports (the same events as its num_preemptions)."""
        for identity, rid in engine_ids:
            session = self.state.sessions.get(identity)
            request = session.requests.get(rid) if session else None
            if request is not None:
                request.num_preemptions += 1
                self.state.events.publish(
                    events.PREEMPTED, session, rid, output_tokens=request.num_output_tokens
                )

    def publish_finished(self, session: ClientSession, request: InflightRequest, reason: str) -> None:
        self.state.events.publish(
            events.FINISHED,
            session,
            request.id,
            finish_reason=reason,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            preemptions=request.num_preemptions,
        )

    def _final(
        self,
        request: InflightRequest,
        reason: str,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: list[dict] | None = None,
    ) -> dict:
        """The final reply: a stream's last delta, or a non-streaming request's whole output."""
        if not request.stream:
            text, token_ids, logprobs = "".join(request.text), request.token_ids, request.logprobs
        if not request.want_logprobs:
            logprobs = None
        elif logprobs is None:
            logprobs = []
        usage = protocol.usage(
            request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens
        )
        return protocol.final_reply(request.id, text, token_ids or [], logprobs, reason, usage)

    def abort_request(self, session: ClientSession, request: InflightRequest) -> None:
        """Abort wherever the request is (engine, queue, tokenizer) and send its final reply, reason abort."""
        self._forget(session, request)
        del session.requests[request.id]
        self.publish_finished(session, request, "abort")
        self.send(session.identity, self._final(request, "abort"))

    def abort_all(self) -> None:
        for session in self.state.sessions:
            for request in list(session.requests.values()):
                self.abort_request(session, request)
            self.state.sessions.release_if_idle(session)

    def fail_all(self) -> None:
        for session in self.state.sessions:
            for request in list(session.requests.values()):
                self._forget(session, request)
                del session.requests[request.id]
                self.publish_finished(session, request, "error")
                self.send(
                    session.identity,
                    protocol.error_reply(request.id, INTERNAL, "the engine failed; see the log"),
                )
            self.state.sessions.release_if_idle(session)

    def lose_client(self, session: ClientSession, reason: str, timed_out: bool = False) -> None:
        """The client is gone or not reading: free everything it holds (called by the outbox).

        A client that only stopped reading may come back: it then gets, after what it had been sent, one
        `client_timeout` error per aborted request, so that none of its requests ends in silence."""
        notices = deque()
        for request in session.requests.values():
            self._forget(session, request)
            self.publish_finished(session, request, "abort")
            if timed_out:
                message = (
                    f"this client read no reply for {self.state.config.client_timeout:g} s "
                    "(--client-timeout); the request was aborted"
                )
                notices.append(protocol.encode(protocol.error_reply(request.id, CLIENT_TIMEOUT, message)))
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

    def _forget(self, session: ClientSession, request: InflightRequest) -> None:
        """Take the request out of the engine (its blocks are free at once) or out of its client's queue."""
        if self.state.engine.abort(session.engine_id(request.id)):
            return
        for i, pending in enumerate(session.pending):
            if pending.request is request:
                del session.pending[i]
                return

"""The serving loop: one thread polls the socket, steps the engine and routes each output to its client."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

import kvd
from kvd.engine.llm_engine import LLMEngine, RequestRejectedError, RequestTooLongError
from kvd.engine.outputs import RequestOutput
from kvd.engine.sampling_params import MAX_LOGPROBS
from kvd.server import protocol
from kvd.server.config import HEARTBEAT_INTERVAL_S, ServerConfig
from kvd.server.outbox import Outbox
from kvd.server.protocol import (
    BAD_REQUEST,
    INTERNAL,
    NOT_FOUND,
    OVERLOADED,
    SHUTTING_DOWN,
    TOO_LARGE,
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    ProtocolError,
    Request,
    TokenizeRequest,
)
from kvd.server.sessions import ClientSession, InflightRequest, Sessions, engine_request_id

logger = logging.getLogger("kvd.server")

# Messages read between two engine steps at most, so a flood of requests cannot stall generation.
MAX_MESSAGES_PER_TURN = 256
IDLE_POLL_MS = 1000
# While replies are held back or a drain is under way, the loop looks again sooner.
SHORT_POLL_MS = 50
# On exit, how long held replies (the final ones above all) may take to go out.
CLOSE_FLUSH_S = 1.0


@dataclass
class DaemonCounters:
    requests_total: int = 0  # generate and chat requests admitted
    requests_rejected: int = 0  # requests answered with an error
    clients_lost: int = 0  # clients that vanished or stopped reading with requests in flight


class Daemon:
    def __init__(self, engine: LLMEngine, sock: zmq.Socket, config: ServerConfig) -> None:
        self.engine = engine
        self.socket = sock
        self.config = config
        self.sessions = Sessions()
        self.outbox = Outbox(sock, self.sessions, config.client_timeout, self._lose_client)
        model_limit = engine.max_model_len - 1  # room for at least one generated token
        self.max_prompt_tokens = min(config.max_prompt_tokens or model_limit, model_limit)
        self.counters = DaemonCounters()
        self.started = time.monotonic()
        self.drain_deadline: float | None = None
        self.stop_now = False
        self._handlers: dict[str, Callable] = {
            "generate": self._generate,
            "chat": self._generate,
            "tokenize": self._tokenize,
            "detokenize": self._detokenize,
            "abort": self._abort,
            "health": self._health,
            "info": self._info,
            "stats": self._stats,
        }

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain (see begin_drain) and return."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        with _signal_wakeup() as wakeup:
            poller.register(wakeup, zmq.POLLIN)
            while not self._done():
                for item, _ in poller.poll(self._poll_timeout_ms()):
                    if item is self.socket:
                        self._receive()
                    else:
                        self._on_signals(wakeup.recv(64))
                if self.engine.has_unfinished():
                    self._step()
                self.outbox.service()
        self._flush_before_close()

    def begin_drain(self) -> None:
        """Stop admitting; in-flight requests get until the drain timeout to finish."""
        self.drain_deadline = time.monotonic() + self.config.drain_timeout
        logger.info(
            "draining: %d requests in flight, up to %g s; new requests get shutting_down",
            self.sessions.num_requests,
            self.config.drain_timeout,
        )

    def _on_signals(self, signums: bytes) -> None:
        for signum in signums:
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            if self.drain_deadline is None:
                self.begin_drain()
            elif not self.stop_now:
                logger.info(
                    "second signal: aborting the %d requests in flight now", self.sessions.num_requests
                )
                self.stop_now = True

    def _done(self) -> bool:
        if self.drain_deadline is None:
            return False
        if self.sessions.num_requests and (self.stop_now or time.monotonic() >= self.drain_deadline):
            self._abort_all()
        return not self.sessions.num_requests

    def _poll_timeout_ms(self) -> int:
        if self.engine.has_unfinished():
            return 0
        if self.drain_deadline is not None or self.outbox.has_backlog:
            return SHORT_POLL_MS
        return IDLE_POLL_MS

    # Receiving and answering requests.

    def _receive(self) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):
            # EVENTS rather than recv until zmq.Again: cheaper than an exception per turn.
            if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
            self._handle(frames[0], frames[1:])

    def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        request_id = None
        try:
            if len(frames) != 1:
                raise ProtocolError(
                    BAD_REQUEST, "send each request as one frame from a DEALER socket (no envelope)"
                )
            request = protocol.parse_request(protocol.decode(frames[0], self.config.max_message_bytes))
            request_id = request.id
            self._handlers[request.op](identity, request)
        except ProtocolError as e:
            self.counters.requests_rejected += 1
            rid = e.request_id if e.request_id is not None else request_id
            self.outbox.send(identity, protocol.error_reply(rid, e.code, e.message, e.field))
        except Exception:
            # A bug, not the client's fault: answer, log, and keep serving everyone else.
            logger.exception("internal error while handling a request of client %s", identity.hex())
            self.counters.requests_rejected += 1
            self.outbox.send(
                identity, protocol.error_reply(request_id, INTERNAL, "internal error; see the daemon log")
            )

    def _generate(self, identity: bytes, request: GenerateRequest) -> None:
        if self.drain_deadline is not None:
            raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down and takes no new requests")
        session = self.sessions.get(identity)
        in_flight = session.requests if session else {}
        if request.id in in_flight:
            raise ProtocolError(
                BAD_REQUEST, f"request {request.id!r} is already in flight; use a new id", "id"
            )
        if len(in_flight) >= self.config.max_queued_per_client:
            raise ProtocolError(
                OVERLOADED,
                f"this client has {len(in_flight)} requests in flight, the limit (--max-queued-per-client); "
                "wait for some to finish",
            )
        if self.sessions.num_requests >= self.config.max_queued:
            raise ProtocolError(
                OVERLOADED,
                f"the daemon has {self.config.max_queued} requests in flight (--max-queued); retry later",
            )
        field, token_ids = self._prompt_tokens(request.prompt, request.prompt_token_ids, request.messages)
        if len(token_ids) > self.max_prompt_tokens:
            raise ProtocolError(
                TOO_LARGE,
                f"the prompt has {len(token_ids)} tokens; the limit is {self.max_prompt_tokens}",
                field,
            )
        try:
            self.engine.add_request(
                engine_request_id(identity, request.id), token_ids, request.params, request.cache_salt
            )
        except RequestTooLongError as e:
            raise ProtocolError(TOO_LARGE, str(e), field) from None
        except RequestRejectedError as e:
            raise ProtocolError(BAD_REQUEST, str(e), field) from None
        self.sessions.open(identity).requests[request.id] = InflightRequest(
            request.id, request.stream, len(token_ids), want_logprobs=request.params.logprobs is not None
        )
        self.counters.requests_total += 1

    def _prompt_tokens(
        self, prompt: str | None, token_ids: list[int] | None, messages: list[dict[str, str]] | None
    ) -> tuple[str, list[int]]:
        """The prompt's token ids, and the request field they came from (for error replies)."""
        if messages is not None:
            try:
                return "messages", self.engine.apply_chat_template(messages)
            except Exception as e:  # the template is a program: whatever it raises, the input is at fault
                raise ProtocolError(
                    BAD_REQUEST, f"the chat template rejected the messages: {e}", "messages"
                ) from None
        if prompt is not None:
            return "prompt", self.engine.encode(prompt)
        return "prompt_token_ids", token_ids

    def _tokenize(self, identity: bytes, request: TokenizeRequest) -> None:
        _, token_ids = self._prompt_tokens(request.text, None, request.messages)
        self.outbox.send(identity, protocol.result_reply(request.id, {"token_ids": token_ids}))

    def _detokenize(self, identity: bytes, request: DetokenizeRequest) -> None:
        vocab = self.engine.config.vocab_size
        if any(t >= vocab for t in request.token_ids):
            raise ProtocolError(BAD_REQUEST, f"token ids must lie in [0, {vocab})", "token_ids")
        text = self.engine.tokenizer.decode(request.token_ids)
        self.outbox.send(identity, protocol.result_reply(request.id, {"text": text}))

    def _abort(self, identity: bytes, request: AbortRequest) -> None:
        session = self.sessions.get(identity)
        target = session.requests.get(request.target) if session else None
        if target is None:
            raise ProtocolError(
                NOT_FOUND, f"request {request.target!r} is not in flight for this client", "target"
            )
        self._abort_request(session, target)
        self.sessions.release_if_idle(session)
        self.outbox.send(identity, protocol.result_reply(request.id, {"aborted": True}))

    def _health(self, identity: bytes, request: Request) -> None:
        status = "draining" if self.drain_deadline is not None else "ready"
        self.outbox.send(identity, protocol.result_reply(request.id, {"status": status}))

    def _info(self, identity: bytes, request: Request) -> None:
        info = self.engine.info() | {
            "kvd_version": kvd.__version__,
            "protocol_version": protocol.PROTOCOL_VERSION,
            "supported_versions": list(protocol.SUPPORTED_VERSIONS),
            "limits": {
                "max_message_bytes": self.config.max_message_bytes,
                "max_prompt_tokens": self.max_prompt_tokens,
                "max_queued_per_client": self.config.max_queued_per_client,
                "max_queued": self.config.max_queued,
                "max_logprobs": MAX_LOGPROBS,
                "max_stop_sequences": protocol.MAX_STOP_SEQUENCES,
                "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
                "client_timeout_s": self.config.client_timeout,
            },
        }
        self.outbox.send(identity, protocol.result_reply(request.id, info))

    def _stats(self, identity: bytes, request: Request) -> None:
        stats = self.engine.stats() | {
            "daemon": {
                "uptime_s": time.monotonic() - self.started,
                "num_clients": len(self.sessions),
                "num_requests": self.sessions.num_requests,
                "draining": self.drain_deadline is not None,
                **vars(self.counters),
            }
        }
        self.outbox.send(identity, protocol.result_reply(request.id, stats))

    # Engine outputs back to clients.

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all()
            return
        for out in outputs:
            self._route(out)

    def _route(self, out: RequestOutput) -> None:
        identity, rid = out.request_id
        session = self.sessions.get(identity)
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
        if reply is not None:
            self.outbox.send(identity, reply)
        if out.finished:
            self.sessions.release_if_idle(session)

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

    def _abort_request(self, session: ClientSession, request: InflightRequest) -> None:
        """Abort in the engine (its blocks are free at once) and send the final reply, reason abort."""
        self.engine.abort(session.engine_id(request.id))
        del session.requests[request.id]
        self.outbox.send(session.identity, self._final(request, "abort"))

    def _abort_all(self) -> None:
        logger.info("drain ended: aborting the %d requests still in flight", self.sessions.num_requests)
        for session in self.sessions:
            for request in list(session.requests.values()):
                self._abort_request(session, request)
            self.sessions.release_if_idle(session)

    def _fail_all(self) -> None:
        for session in self.sessions:
            for rid in list(session.requests):
                self.engine.abort(session.engine_id(rid))
                del session.requests[rid]
                self.outbox.send(
                    session.identity, protocol.error_reply(rid, INTERNAL, "the engine failed; see the log")
                )
            self.sessions.release_if_idle(session)

    def _lose_client(self, session: ClientSession, reason: str) -> None:
        """The client is gone or not reading: free everything it holds (called by the outbox)."""
        for rid in session.requests:
            self.engine.abort(session.engine_id(rid))
        if session.requests:
            self.counters.clients_lost += 1
            logger.info("client %s %s: aborted its %d requests", session.name, reason, len(session.requests))
        session.requests.clear()
        session.backlog.clear()
        self.sessions.remove(session)

    def _flush_before_close(self) -> None:
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while self.outbox.has_backlog and time.monotonic() < deadline:
            time.sleep(0.01)
            self.outbox.service()


@contextlib.contextmanager
def _signal_wakeup() -> Iterator[socket.socket]:
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

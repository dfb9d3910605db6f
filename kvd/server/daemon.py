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
from kvd.engine.sequence import SequenceStatus
from kvd.server import events, protocol
from kvd.server.config import HEARTBEAT_INTERVAL_S, ServerConfig
from kvd.server.events import EventStream
from kvd.server.fairness import FairQueue
from kvd.server.isolation import cache_salt, peer_tenant
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
from kvd.server.sessions import ClientSession, InflightRequest, PendingRequest, Sessions
from kvd.server.systemd import Notifier

logger = logging.getLogger("kvd.server")

# Messages read between two engine steps at most, so a flood of requests cannot stall generation.
MAX_MESSAGES_PER_TURN = 256
IDLE_POLL_MS = 1000
# While replies are held back or a drain is under way, the loop looks again sooner.
SHORT_POLL_MS = 50
# On exit, how long held replies (the final ones above all) may take to go out.
CLOSE_FLUSH_S = 1.0
# How often the service manager hears the load (STATUS=) while it changes.
STATUS_INTERVAL_S = 5.0


@dataclass
class DaemonCounters:
    requests_total: int = 0  # generate and chat requests admitted into the engine
    requests_rejected: int = 0  # requests answered with an error
    clients_lost: int = 0  # clients that vanished or stopped reading with requests in flight


class Daemon:
    def __init__(
        self,
        engine: LLMEngine,
        sock: zmq.Socket,
        config: ServerConfig,
        notifier: Notifier | None = None,
        event_socket: zmq.Socket | None = None,
    ) -> None:
        self.engine = engine
        self.events = EventStream(event_socket)
        self.notifier = notifier or Notifier({})
        self.socket = sock
        self.config = config
        self.sessions = Sessions()
        self.queue = FairQueue()
        self.outbox = Outbox(sock, self.sessions, config.client_timeout, self._lose_client)
        model_limit = engine.max_model_len - 1  # room for at least one generated token
        self.max_prompt_tokens = min(config.max_prompt_tokens or model_limit, model_limit)
        self.counters = DaemonCounters()
        self.started = time.monotonic()
        self.drain_deadline: float | None = None
        self.stop_now = False
        self._last_status = (0.0, "")
        # Engine ids of preempted requests still waiting to be recomputed, and the engine's count seen last.
        self._preempted: set[tuple[bytes, object]] = set()
        self._preemptions_seen = 0
        self._handlers: dict[str, Callable] = {
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
                self._admit()
                if self.engine.has_unfinished():
                    self._step()
                self.outbox.service()
                self._tell_manager()
        self._flush_before_close()

    def begin_drain(self) -> None:
        """Stop admitting; in-flight requests get until the drain timeout to finish."""
        self.drain_deadline = time.monotonic() + self.config.drain_timeout
        self.notifier.stopping(f"draining: {self.load_status()}")
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
        if self.notifier.watchdog_interval is not None:
            return min(IDLE_POLL_MS, int(self.notifier.watchdog_interval * 1000))
        return IDLE_POLL_MS

    def load_status(self) -> str:
        """One line of load for the service manager's STATUS= (systemctl status shows it)."""
        kv = self.engine.block_manager.usage()
        total = self.engine.num_blocks
        return (
            f"{len(self.engine.scheduler.running)} running, {len(self.engine.scheduler.waiting)} waiting, "
            f"KV {100 * kv.used_blocks / total:.0f}% used, {len(self.sessions)} clients"
        )

    def _tell_manager(self) -> None:
        """WATCHDOG=1 from this loop (a stuck engine step stops it), and STATUS= when the load changed."""
        self.notifier.watchdog()
        if not self.notifier.enabled:
            return
        now = time.monotonic()
        last_time, last_status = self._last_status
        if now - last_time >= STATUS_INTERVAL_S:
            status = self.load_status()
            if status != last_status:
                self.notifier.status(status)
            self._last_status = (now, status)

    # Receiving and answering requests.

    def _receive(self) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):
            # EVENTS rather than recv until zmq.Again: cheaper than an exception per turn.
            if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            # Frames, not bytes: the routing frame carries the peer's address (its uid on an ipc socket).
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            tenant = peer_tenant(frames[0].get("Peer-Address"))
            self._handle(frames[0].bytes, tenant, [f.bytes for f in frames[1:]])

    def _handle(self, identity: bytes, tenant: str, frames: list[bytes]) -> None:
        request_id = None
        try:
            if len(frames) != 1:
                raise ProtocolError(
                    BAD_REQUEST, "send each request as one frame from a DEALER socket (no envelope)"
                )
            request = protocol.parse_request(protocol.decode(frames[0], self.config.max_message_bytes))
            request_id = request.id
            if isinstance(request, GenerateRequest):
                self._generate(identity, tenant, request)
            else:
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

    def _generate(self, identity: bytes, tenant: str, request: GenerateRequest) -> None:
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
        inflight = InflightRequest(
            request.id, request.stream, len(token_ids), want_logprobs=request.params.logprobs is not None
        )
        session = self.sessions.open(identity, tenant)
        session.requests[request.id] = inflight
        salt = cache_salt(None if self.config.shared_prefix_cache else tenant, request.cache_salt)
        self.queue.push(session, PendingRequest(inflight, token_ids, request.params, salt, field))
        self.events.publish(events.QUEUED, session, request.id, prompt_tokens=len(token_ids))
        self._admit()  # at once when the engine has room: a bad prompt's error comes back now

    # Fair admission: the engine's own queue stays short, the clients' queues take turns filling it.

    def _admit(self) -> None:
        scheduler = self.engine.scheduler
        room = scheduler.max_num_seqs - len(scheduler.running) - len(scheduler.waiting)
        while room > 0 and (turn := self.queue.pop(self._may_admit)) is not None:
            session, pending = turn
            try:
                self.engine.add_request(
                    session.engine_id(pending.request.id),
                    pending.token_ids,
                    pending.params,
                    pending.cache_salt,
                )
            except RequestRejectedError as e:
                code = TOO_LARGE if isinstance(e, RequestTooLongError) else BAD_REQUEST
                del session.requests[pending.request.id]
                self.counters.requests_rejected += 1
                self.events.publish(events.FINISHED, session, pending.request.id, finish_reason="error")
                self.outbox.send(
                    session.identity, protocol.error_reply(pending.request.id, code, str(e), pending.field)
                )
                self.sessions.release_if_idle(session)
                continue
            self.counters.requests_total += 1
            self.events.publish(events.SCHEDULED, session, pending.request.id)
            room -= 1

    def _may_admit(self, session: ClientSession) -> bool:
        cap = self.config.max_running_per_client
        if cap is not None and session.num_in_engine >= cap:
            return False
        block_cap = self.config.max_blocks_per_client
        if block_cap is None or not session.num_in_engine:
            return True  # a client's first request always runs, however large
        wanted = -(-len(session.pending[0].token_ids) // self.engine.args.block_size)
        return self._blocks_held(session) + wanted <= block_cap

    def _blocks_held(self, session: ClientSession) -> int:
        """KV blocks the client's requests in the engine hold, or will once scheduled (a waiting prompt's)."""
        in_engine = (self.engine.requests.get(session.engine_id(rid)) for rid in session.requests)
        return sum(r.seq.num_blocks for r in in_engine if r is not None)

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
                "max_running_per_client": self.config.max_running_per_client,
                "max_blocks_per_client": self.config.max_blocks_per_client,
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
                "num_queued": len(self.queue),
                "draining": self.drain_deadline is not None,
                **vars(self.counters),
                "clients": [self._client_stats(s) for s in self.sessions if s.requests],
            }
        }
        self.outbox.send(identity, protocol.result_reply(request.id, stats))

    def _client_stats(self, session: ClientSession) -> dict:
        in_engine = [self.engine.requests.get(session.engine_id(rid)) for rid in session.requests]
        return {
            "client": session.name,
            "tenant": session.tenant,
            "requests": len(session.requests),
            "queued": len(session.pending),
            "in_engine": session.num_in_engine,
            "kv_blocks": sum(len(r.seq.block_table) for r in in_engine if r is not None),  # allocated now
            "generated_tokens": sum(r.num_output_tokens for r in session.requests.values()),
            "preemptions": sum(r.num_preemptions for r in session.requests.values()),
        }

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
        self._note_preemptions()

    def _note_preemptions(self) -> None:
        """Find the requests the engine preempted in this step: back in its waiting queue after running."""
        count = self.engine.scheduler.num_preemptions
        if count == self._preemptions_seen and not self._preempted:
            return
        self._preemptions_seen = count
        waiting = {
            engine_id
            for engine_id, r in self.engine.requests.items()
            if r.seq.status is SequenceStatus.WAITING and r.seq.num_admitted_tokens > 0
        }
        for identity, rid in waiting - self._preempted:
            session = self.sessions.get(identity)
            request = session.requests.get(rid) if session else None
            if request is not None:
                request.num_preemptions += 1
                self.events.publish(events.PREEMPTED, session, rid, output_tokens=request.num_output_tokens)
        self._preempted = waiting

    def _publish_finished(self, session: ClientSession, request: InflightRequest, reason: str) -> None:
        self.events.publish(
            events.FINISHED,
            session,
            request.id,
            finish_reason=reason,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.num_cached_tokens,
            preemptions=request.num_preemptions,
        )

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
            self._publish_finished(session, request, out.finish_reason)
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
        if not self.engine.abort(session.engine_id(request.id)):
            _drop_pending(session, request)
        del session.requests[request.id]
        self._publish_finished(session, request, "abort")
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
                self._publish_finished(session, session.requests.pop(rid), "error")
                self.outbox.send(
                    session.identity, protocol.error_reply(rid, INTERNAL, "the engine failed; see the log")
                )
            session.pending.clear()
            self.sessions.release_if_idle(session)

    def _lose_client(self, session: ClientSession, reason: str) -> None:
        """The client is gone or not reading: free everything it holds (called by the outbox)."""
        for request in session.requests.values():
            self.engine.abort(session.engine_id(request.id))
            self._publish_finished(session, request, "abort")
        if session.requests:
            self.counters.clients_lost += 1
            logger.info("client %s %s: aborted its %d requests", session.name, reason, len(session.requests))
        session.requests.clear()
        session.pending.clear()
        session.backlog.clear()
        self.sessions.remove(session)

    def _flush_before_close(self) -> None:
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while self.outbox.has_backlog and time.monotonic() < deadline:
            time.sleep(0.01)
            self.outbox.service()


def _drop_pending(session: ClientSession, request: InflightRequest) -> None:
    """Take a request that never reached the engine out of its client's queue."""
    for i, pending in enumerate(session.pending):
        if pending.request is request:
            del session.pending[i]
            return


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

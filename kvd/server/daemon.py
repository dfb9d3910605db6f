"""The serving loop: one thread polls the socket, steps the engine and dispatches each step's output as replies."""

from __future__ import annotations

import logging
import signal
import subprocess
import time

import zmq

from kvd.distributed.errors import TensorParallelError
from kvd.engine.engine_args import EngineArgs
from kvd.server.aborts import Aborts
from kvd.server.admission import Admission
from kvd.server.config import ServerConfig
from kvd.server.events import EventStream
from kvd.server.handlers import RequestHandler
from kvd.server.isolation import peer_tenant
from kvd.server.model_loading import ModelLoading
from kvd.server.models import ServedModel, ServedModels
from kvd.server.outbox import Outbox
from kvd.server.replies import Replies
from kvd.server.signals import signal_wakeup
from kvd.server.state import ServerState
from kvd.server.stats import load_status
from kvd.server.systemd import Notifier

logger = logging.getLogger("kvd.server")

# Messages and bytes read between two engine steps at most, so a flood of requests cannot stall generation
# (a message larger than the byte budget is still read, alone in its turn).
MAX_MESSAGES_PER_TURN = 256
MAX_BYTES_PER_TURN = 1 << 20
IDLE_POLL_MS = 1000
# While replies are held back or a drain is under way, the loop looks again sooner.
SHORT_POLL_MS = 50
# On exit, how long held replies (the final ones above all) may take to go out.
CLOSE_FLUSH_S = 1.0
# How often the service manager hears the load (STATUS=) while it changes.
STATUS_INTERVAL_S = 5.0


class Daemon:
    def __init__(
        self,
        models: ServedModels,
        sock: zmq.Socket,
        config: ServerConfig,
        engine_args: EngineArgs,
        notifier: Notifier | None = None,
        event_socket: zmq.Socket | None = None,
        gateway: subprocess.Popen | None = None,
    ) -> None:
        self.models = models
        self.socket = sock
        self.gateway = gateway  # the `--http` child, part of this daemon: watched (_check_gateway)
        self.gateway_failed = False
        self.state = ServerState(models, config, EventStream(event_socket))
        # A send can find its client lost, and aborting the client's generations sends: the outbox calls the
        # aborts, built after it, through this lambda.
        outbox = Outbox(
            sock, self.state.sessions, config.client_timeout, lambda *lost: self.aborts.lose_client(*lost)
        )
        self.replies = Replies(self.state, outbox)
        self.aborts = Aborts(self.state, self.replies)
        self.admission = Admission(self.state, self.replies)
        self.loading = ModelLoading(self.state, engine_args)
        self.handler = RequestHandler(self.state, self.replies, self.admission, self.aborts, self.loading)
        self.notifier = notifier or Notifier({})
        self.drain_deadline: float | None = None
        self.stop_now = False
        # Set when another tensor-parallel rank died or hung: every request failed, the loop ends, serve exits.
        self.failure: TensorParallelError | None = None
        self._last_status = (0.0, "")

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain (see begin_drain) and return."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        # Plain sockets come back from poll() as their file descriptors.
        prompts = self.handler.prompts.wakeup.fileno()
        poller.register(prompts, zmq.POLLIN)
        loads = self.loading.worker.wakeup.fileno()
        poller.register(loads, zmq.POLLIN)
        try:
            with signal_wakeup() as wakeup:
                poller.register(wakeup, zmq.POLLIN)
                while not self._done() and self.failure is None:
                    for item, _ in poller.poll(self._poll_timeout_ms()):
                        if item is self.socket:
                            self._receive()
                        elif item == prompts:
                            self.handler.on_prompts_ready()
                        elif item == loads:
                            self.loading.on_loaded()
                        else:
                            self._on_signals(wakeup.recv(64))
                    self.admission.admit()
                    if self._has_unfinished():
                        # One step of each model with work, in turn: no model's steps wait on another's queue.
                        for model in self.models.loaded():
                            if model.engine.has_unfinished():
                                self._step(model)
                        # What the steps' finished requests made room for (a client's cap), so that it runs
                        # next turn instead of waiting out the idle poll.
                        self.admission.admit()
                    self._check_workers()
                    self.loading.expire()
                    self._check_gateway()
                    self.replies.outbox.service()
                    self._tell_manager()
            self._flush_before_close()
        finally:
            self.handler.close()

    def begin_drain(self) -> None:
        """Stop admitting; in-flight requests get until the drain timeout to finish."""
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.state.config.drain_timeout
        self.notifier.stopping(f"draining: {self.load_status()}")
        logger.info(
            "draining: %d requests in flight, up to %g s; new requests get shutting_down",
            self.state.sessions.num_requests,
            self.state.config.drain_timeout,
        )

    def load_status(self) -> str:
        return load_status(self.state)

    def _on_signals(self, signums: bytes) -> None:
        for signum in signums:
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            if self.drain_deadline is None:
                self.begin_drain()
            elif not self.stop_now:
                logger.info(
                    "second signal: aborting the %d requests in flight now", self.state.sessions.num_requests
                )
                self.stop_now = True

    def _done(self) -> bool:
        if self.drain_deadline is None:
            return False
        num_requests = self.state.sessions.num_requests
        if num_requests and (self.stop_now or time.monotonic() >= self.drain_deadline):
            logger.info("drain ended: aborting the %d requests still in flight", num_requests)
            self.aborts.abort_all()
        return not self.state.sessions.num_requests

    def _has_unfinished(self) -> bool:
        return any(m.engine.has_unfinished() for m in self.models.loaded())

    def _poll_timeout_ms(self) -> int:
        if self._has_unfinished():
            return 0
        if self.drain_deadline is not None or self.replies.outbox.has_backlog:
            return SHORT_POLL_MS
        if self.notifier.watchdog_interval is not None:
            return min(IDLE_POLL_MS, int(self.notifier.watchdog_interval * 1000))
        return IDLE_POLL_MS

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

    def _receive(self) -> None:
        budget = MAX_BYTES_PER_TURN
        for _ in range(MAX_MESSAGES_PER_TURN):
            # EVENTS rather than recv until zmq.Again: cheaper than an exception per turn.
            if budget <= 0 or not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            # Frames, not bytes: the routing frame carries the peer's address (its uid on an ipc socket) and
            # the routing id the peer declared, empty unless it chose one.
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            tenant = peer_tenant(frames[0].get("Peer-Address"))
            payload = [f.bytes for f in frames[1:]]
            budget -= sum(map(len, payload))
            self.handler.handle(frames[0].bytes, tenant, payload, chosen_id=_chose_routing_id(frames[0]))

    def _step(self, model: ServedModel) -> None:
        try:
            step = model.engine.step()
        except TensorParallelError as e:
            self._fail_group(e)
            return
        except Exception:
            logger.exception("model %s: engine step failed; failing its requests in flight", model.name)
            self.aborts.fail_all(model=model)
            return
        self.replies.dispatch(step)

    def _check_workers(self) -> None:
        """A rank that died while the engine was idle fails the daemon as one that dies in a step does."""
        try:
            for model in self.models.loaded():
                model.engine.check_workers()
        except TensorParallelError as e:
            self._fail_group(e)

    def _check_gateway(self) -> None:
        """A gateway that exits while the daemon serves (a crash, a port taken after all, a kill) leaves HTTP
        clients nothing to talk to: drain and stop, with a failing status unless it was stopped by a signal."""
        if self.gateway is None or self.drain_deadline is not None or self.gateway.poll() is None:
            return
        code = self.gateway.returncode
        self.gateway_failed = code not in (0, -signal.SIGTERM, -signal.SIGINT)
        logger.error(
            "the HTTP gateway (pid %d) exited with status %s; draining and stopping", self.gateway.pid, code
        )
        self.begin_drain()

    def _fail_group(self, error: TensorParallelError) -> None:
        if self.failure is not None:
            return
        logger.error("tensor-parallel group failed: %s; failing every request in flight and exiting", error)
        self.failure = error
        self.aborts.fail_all(
            f"the tensor-parallel group failed ({error}); the daemon exits, retry once it is back"
        )

    def _flush_before_close(self) -> None:
        outbox = self.replies.outbox
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while outbox.has_backlog and time.monotonic() < deadline:
            time.sleep(0.01)
            outbox.service()


def _chose_routing_id(frame: zmq.Frame) -> bool:
    """Whether the peer set ZMQ_ROUTING_ID (libzmq hands the declared id on as the "Identity" property)."""
    try:
        return bool(frame.get("Identity"))
    except UnicodeDecodeError:  # a binary id: chosen all the same
        return True

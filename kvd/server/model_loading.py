"""Models loaded on demand: a request for a model not loaded waits while it loads (on a thread of its own, the
other models serving meanwhile; a second request waits for the same load), room is made by unloading the least
recently used idle models (--max-loaded-models, and --memory: the bytes every loaded model's weights and pool
hold), and an idle model unloads after its keep-alive."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator

from kvd.engine.engine_args import EngineArgs
from kvd.engine.errors import MemoryBudgetError
from kvd.engine.llm_engine import LLMEngine, release_memory
from kvd.server import events
from kvd.server.models import OnLoad, ServedModel
from kvd.server.prompts import longest_token_bytes
from kvd.server.protocol import INTERNAL, OVERLOADED, SHUTTING_DOWN, ProtocolError
from kvd.server.state import ServerState
from kvd.server.worker import Worker

logger = logging.getLogger("kvd.server")

LOAD_NICE = 10  # the loader thread's niceness: below the loop's, above nothing else's
LOAD_SWITCH_S = 0.0005  # the interpreter's switch interval while a model loads (_beside_the_loop)
# The model, its engine (None: it failed), the seconds it took, why not.
LoadResult = tuple[ServedModel, LLMEngine | None, float, Exception | None]


class ModelLoading:
    def __init__(self, state: ServerState, engine_args: EngineArgs) -> None:
        self.state = state
        self.engine_args = engine_args
        self.worker: Worker[ServedModel, LoadResult] = Worker(self._load, "kvd-models")
        # Loads run one at a time (one loader thread): the others wait here, so that each is given what the memory
        # budget has left when it starts.
        self._queue: deque[ServedModel] = deque()
        self._running: ServedModel | None = None
        self._retried: set[ServedModel] = set()  # loaded once more after a first try told their size

    def ensure(self, model: ServedModel, then: OnLoad) -> None:
        """Run `then` once `model` is loaded (now, if it is), or with the error that keeps it from loading."""
        model.last_used, model.idle_since = time.monotonic(), None  # a request: its keep-alive counts anew
        if model.engine is not None:
            then(None)
            return
        if self.state.draining:
            then(ProtocolError(SHUTTING_DOWN, "the daemon is shutting down and loads no model"))
            return
        model.waiting.append(then)
        if model.loading:
            return
        model.loading = True  # from now on its requests wait for this one load
        self.state.events.publish_model(events.MODEL_LOADING, model.name)
        logger.info("loading model %s (%s)", model.name, model.spec.source or "the bundled default")
        self._queue.append(model)
        self._start_next()

    def _start_next(self) -> None:
        """Start the next queued load, if none runs: room made for it, and under a memory budget what the others
        leave given to it."""
        while self._running is None and self._queue:
            model = self._queue.popleft()
            error = self._make_room(model)
            budget = self.engine_args.memory
            if error is None and budget is not None:
                model.granted = budget - self.state.models.held_bytes(besides=model)
                if model.granted <= 0:  # nothing left, and no idle model to unload: its size is unknown yet
                    error = self._overloaded(model, "the memory budget is held by busy or pinned models")
            if self.state.draining:
                error = ProtocolError(SHUTTING_DOWN, "the daemon is shutting down and loads no model")
            if error is not None:
                model.loading = False
                self._fail(model, error)
                continue
            self._running = model
            self.worker.submit(model)

    def on_loaded(self) -> None:
        """Take the loads the worker finished: serve each model, and let what waited for it go on."""
        for model, engine, seconds, error in self.worker.results():
            self._running, model.granted = None, 0
            retry = model not in self._retried and model.waiting and not self.state.draining
            if isinstance(error, MemoryBudgetError) and retry:
                model.bytes = error.needed  # its size, learned: room is made for that, and it loads once more
                self._retried.add(model)
                self._queue.appendleft(model)
                continue
            model.loading = False
            self._retried.discard(model)
            if isinstance(error, MemoryBudgetError):
                self._fail(model, ProtocolError(OVERLOADED, f"model {model.name}: {error}", "model"))
                continue
            if engine is None:
                why = f"{type(error).__name__}: {error}"[:300]
                message = f"model {model.name} failed to load ({why}); see the daemon log"
                self._fail(model, ProtocolError(INTERNAL, message, "model"))
                continue
            try:
                model.attach(engine, self.state.config)
            except Exception:
                logger.exception("model %s loaded but cannot serve", model.name)
                engine.close()
                self._fail(
                    model, ProtocolError(INTERNAL, f"model {model.name} failed to load; see the log", "model")
                )
                continue
            # The new engine joins what the daemon holds for good (serve.py freezes the first models so): out of
            # the full collections, which would walk it on the loop's turns (50-150 ms stalls of every stream).
            gc.freeze()
            self.state.events.publish_model(events.MODEL_LOADED, model.name, seconds=seconds)
            logger.info("model %s loaded in %.2f s", model.name, seconds)
            waiting, model.waiting = model.waiting, []
            for then in waiting:
                then(None)
        self._start_next()

    def expire(self) -> None:
        """Unload each model idle for longer than its keep-alive (pinned models stay)."""
        # Every loop turn: a daemon whose loaded models are all pinned (one model, say) pays nothing here.
        candidates = [m for m in self.state.models.loaded() if not m.pinned]
        if not candidates:
            return
        now, busy = time.monotonic(), self._busy()
        for model in candidates:
            if model in busy:
                model.idle_since = None
                continue
            if model.idle_since is None:
                model.idle_since = now
            if now - model.idle_since >= model.keep_alive:
                self.unload(model)

    def unload(self, model: ServedModel) -> None:
        model.detach()
        gc.unfreeze()  # the engine's cycles were frozen with it: collected now, the survivors frozen again
        release_memory()
        if self._running is None:  # else on_loaded freezes them (not a load's engine that may yet fail)
            gc.freeze()
        self.state.events.publish_model(events.MODEL_UNLOADED, model.name)
        logger.info("model %s unloaded", model.name)

    def close(self) -> None:
        """Answer what waits for a load (the daemon is stopping); a load under way is not waited for."""
        for model in self.state.models:
            self._fail(model, ProtocolError(SHUTTING_DOWN, "the daemon stopped before the model loaded"))
        self.worker.close(wait=False)

    def _load(self, model: ServedModel) -> LoadResult:
        # The serving loop comes first: this thread, and the compute threads it starts, run at a lower priority
        # (a thread's nice value is its own on Linux, and threads inherit it).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICE)
        started = time.monotonic()
        memory = None if self.engine_args.memory is None else model.granted
        try:
            with _beside_the_loop():
                engine = LLMEngine(model.spec.engine_args(self.engine_args, memory=memory))
                try:
                    longest_token_bytes(
                        engine.tokenizer
                    )  # here, not on the loop (ServedModel.attach reads it)
                except Exception:
                    engine.close()
                    raise
        except MemoryBudgetError as e:  # what it needs is known now (on_loaded makes room, or says so)
            logger.warning("model %s does not fit what the memory budget has left: %s", model.name, e)
            return model, None, time.monotonic() - started, e
        except Exception as e:  # a bad file, a missing id, no memory: this request fails, the others serve on
            logger.exception("model %s failed to load", model.name)
            return model, None, time.monotonic() - started, e
        return model, engine, time.monotonic() - started, None

    def _busy(self) -> set[ServedModel]:
        """Models with a request in flight (in any state) or one waiting for them to load."""
        busy = {m for m in self.state.models if m.waiting or m.loading or m.num_jobs}
        return busy | {g.model for s in self.state.sessions for g in s.requests.values()}

    def _make_room(self, model: ServedModel) -> ProtocolError | None:
        """Unload the least recently used idle models while `model` would be one too many or would not fit in the
        memory budget beside the others (its bytes of its last load; unknown before a first, when the load itself
        finds out); the error if no idle model is left to unload."""
        limit, budget = self.state.config.max_loaded_models, self.engine_args.memory
        if budget is not None and model.bytes > budget:  # no unloading makes room: leave the others be
            return ProtocolError(
                OVERLOADED,
                f"model {model.name} needs {model.bytes} bytes, more than the whole memory budget ({budget}); "
                "raise --memory",
                "model",
            )
        while True:
            live = [m for m in self.state.models if m.engine is not None and m is not model]
            held = self.state.models.held_bytes(besides=model)
            too_many = limit is not None and len(live) >= limit
            too_big = budget is not None and held + model.bytes > budget
            if not too_many and not too_big:
                return None
            busy = self._busy() - {model}
            idle = [m for m in live if m.engine is not None and not m.pinned and m not in busy]
            if idle:
                self.unload(min(idle, key=lambda m: m.last_used))
                continue
            why = (
                f"{len(live)} models are loaded (--max-loaded-models {limit})"
                if too_many
                else f"it needs {model.bytes} bytes and the memory budget ({budget}) has {budget - held} left"
            )
            return self._overloaded(model, why)

    @staticmethod
    def _overloaded(model: ServedModel, why: str) -> ProtocolError:
        return ProtocolError(
            OVERLOADED,
            f"model {model.name} cannot be loaded now: {why}, and every loaded model is busy or pinned; retry "
            "when one is idle",
            "model",
        )

    def _fail(self, model: ServedModel, error: ProtocolError) -> None:
        waiting, model.waiting = model.waiting, []
        for then in waiting:
            then(error)


@contextlib.contextmanager
def _beside_the_loop() -> Iterator[None]:
    """While a load builds an engine beside the serving loop: the interpreter's lock handed over every
    LOAD_SWITCH_S, and no full collection.

    The loop's turn drops and retakes the lock at every native call and torch op; with a loader running Python
    beside it, each retake waits up to the switch interval (5 ms by default), and a turn of dozens of them held
    a stream's token by 80-200 ms. The objects a load makes would also trigger full collections, each a walk of
    the whole heap on whichever thread allocates next (the loop's, mostly): on_loaded freezes the engine instead.
    The young generations are still collected meanwhile."""
    interval = sys.getswitchinterval()
    young, middle, full = gc.get_threshold()
    sys.setswitchinterval(LOAD_SWITCH_S)
    gc.set_threshold(young, middle, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)
        sys.setswitchinterval(interval)

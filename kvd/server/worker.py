"""A thread beside the serving loop for work that must not silence it (tokenizing, loading a model): jobs go in,
results come back in order, and a socket the loop polls says when there are some."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")


class Worker(Generic[Job, Result]):
    """One thread that runs `work` on each submitted job in order; the loop polls `wakeup` and collects."""

    def __init__(self, work: Callable[[Job], Result], name: str) -> None:
        self._work = work
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self.wakeup, self._notify = socket.socketpair()
        self.wakeup.setblocking(False)
        self._notify.setblocking(False)
        self.num_pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.num_pending += 1
        self._jobs.put(job)

    def results(self) -> list[Result]:
        """The jobs finished so far, in submission order."""
        with contextlib.suppress(BlockingIOError):
            while self.wakeup.recv(4096):
                pass
        done = []
        while not self._results.empty():
            done.append(self._results.get())
        self.num_pending -= len(done)
        return done

    def close(self, wait: bool = True) -> None:
        """Stop after the jobs submitted; `wait`: until they are done (else the thread, a daemon one, may still
        be at one when the process exits)."""
        self._jobs.put(None)
        if wait:
            self._thread.join()
            self.wakeup.close()
            self._notify.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._results.put(self._work(job))  # `work` answers its own failures with a result
            # A full wakeup socket is readable already: the byte is not needed.
            with contextlib.suppress(BlockingIOError):
                self._notify.send(b"\0")

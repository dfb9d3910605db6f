"""What the daemon's parts share: the models, the clients and their queues, the limits and the counters."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvd.server.config import ServerConfig
from kvd.server.events import EventStream
from kvd.server.fairness import FairQueue
from kvd.server.models import ServedModel, ServedModels
from kvd.server.sessions import ClientSession, Generation, Sessions


@dataclass
class DaemonCounters:
    requests_total: int = 0  # generate and chat requests admitted into the engine
    requests_rejected: int = 0  # requests answered with an error
    clients_lost: int = 0  # clients that vanished or stopped reading with requests in flight


@dataclass
class ServerState:
    models: ServedModels
    config: ServerConfig
    events: EventStream
    sessions: Sessions = field(default_factory=Sessions)
    queue: FairQueue = field(default_factory=FairQueue)
    counters: DaemonCounters = field(default_factory=DaemonCounters)
    # The generations the engines hold, by the opaque engine id each got at admission (never reused, unique
    # across the models).
    in_engine: dict[int, tuple[ClientSession, Generation]] = field(default_factory=dict)
    engine_ids: Iterator[int] = field(default_factory=itertools.count)
    started: float = field(default_factory=time.monotonic)
    draining: bool = False

    def num_in_engine(self, model: ServedModel) -> int:
        """The engine requests of `model`'s generations."""
        return sum(1 for _, generation in self.in_engine.values() if generation.model is model)

"""What the daemon's parts share: the engine, its clients and their queues, the limits and the counters."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.server.config import ServerConfig
from kvd.server.events import EventStream
from kvd.server.fairness import FairQueue
from kvd.server.sessions import ClientSession, Generation, Sessions

if TYPE_CHECKING:
    from kvd.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class DaemonCounters:
    requests_total: int = 0  # generate and chat requests admitted into the engine
    requests_rejected: int = 0  # requests answered with an error
    clients_lost: int = 0  # clients that vanished or stopped reading with requests in flight


@dataclass
class ServerState:
    engine: LLMEngine
    config: ServerConfig
    events: EventStream
    sessions: Sessions = field(default_factory=Sessions)
    queue: FairQueue = field(default_factory=FairQueue)
    counters: DaemonCounters = field(default_factory=DaemonCounters)
    # The generations the engine holds, by the opaque engine id each got at admission (never reused).
    in_engine: dict[int, tuple[ClientSession, Generation]] = field(default_factory=dict)
    engine_ids: Iterator[int] = field(default_factory=itertools.count)
    started: float = field(default_factory=time.monotonic)
    draining: bool = False

    def __post_init__(self) -> None:
        asked = self.config.max_prompt_tokens
        if asked is not None and asked > self.max_prompt_tokens:  # once: one state a daemon
            logger.warning(
                "--max-prompt-tokens %d is past the model's context (max_model_len %d): prompts are limited to %d "
                "tokens (info's limits.max_prompt_tokens)",
                asked,
                self.engine.max_model_len,
                self.max_prompt_tokens,
            )

    @property
    def max_prompt_tokens(self) -> int:
        model_limit = self.engine.max_model_len - 1  # room for at least one generated token
        return min(self.config.max_prompt_tokens or model_limit, model_limit)

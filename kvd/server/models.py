"""The models a daemon serves, found by the name a request gives (its `model` field): each with its engine
while it is loaded, the limits requests for it are held to, and what waits for it to load."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.server.config import ServerConfig
from kvd.server.isolation import visible_info
from kvd.server.model_specs import ModelSpec
from kvd.server.prompts import max_prompt_bytes
from kvd.server.protocol import BAD_REQUEST, MODEL_NOT_FOUND, ProtocolError

if TYPE_CHECKING:
    from kvd.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvd.server")

# Called when the model has loaded (None) or failed to (the error to answer with).
OnLoad = Callable[[ProtocolError | None], None]


@dataclass(eq=False)
class ServedModel:
    """One model: its engine while loaded, and the limits requests for it are held to (known once loaded)."""

    name: str
    spec: ModelSpec
    pinned: bool = False  # loaded at start and never unloaded
    keep_alive: float = math.inf  # seconds it stays loaded once idle (the last request's keep_alive)
    engine: LLMEngine | None = None
    max_prompt_tokens: int = 0
    max_prompt_bytes: int | None = (
        None  # a prompt past this is refused before it is tokenized (None: no bound)
    )
    max_num_seqs: int = 0  # requests its engine holds at most, running and waiting
    block_size: int = 0
    loading: bool = False
    waiting: list[OnLoad] = field(default_factory=list)  # what its load will let go on
    num_jobs: int = 0  # its prompts on the prompt worker (which uses its engine's tokenizer)
    idle_since: float | None = None  # since when nothing was in flight for it (None: busy, or unloaded)
    last_used: float = 0.0
    # Its weights and KV pool in bytes, as its engine holds them (kept when it unloads: what it needs to load
    # again; 0 before a first load tells it); while it loads, the part of the memory budget it was given.
    bytes: int = 0
    granted: int = 0

    def attach(self, engine: LLMEngine, config: ServerConfig) -> None:
        """Serve with `engine`, its limits from its context and the daemon's settings."""
        model_limit = engine.max_model_len - 1  # room for at least one generated token
        limit = min(config.max_prompt_tokens or model_limit, model_limit)
        if config.max_prompt_tokens is not None and config.max_prompt_tokens > limit:
            logger.warning(
                "--max-prompt-tokens %d is past model %s's context (max_model_len %d): its prompts are limited to "
                "%d tokens (info's limits.max_prompt_tokens)",
                config.max_prompt_tokens,
                self.name,
                engine.max_model_len,
                limit,
            )
        info = engine.info()
        self.engine, self.max_prompt_tokens = engine, limit
        self.max_prompt_bytes = max_prompt_bytes(engine.tokenizer, limit)
        self.max_num_seqs, self.block_size = info["max_num_seqs"], info["block_size"]
        self.bytes = engine.weight_bytes + engine.kv_cache_bytes

    def detach(self) -> None:
        engine, self.engine, self.idle_since = self.engine, None, None
        if engine is not None:
            engine.close()

    def listing(self, tenant: str) -> dict:
        """Its entry in `list_models`, as `tenant` may see it."""
        entry = {
            "name": self.name,
            "loaded": self.engine is not None,
            "loading": self.loading,
            "pinned": self.pinned,
        }
        if self.engine is not None:
            info = visible_info(self.engine.info(), tenant)
            entry |= {"max_model_len": self.engine.max_model_len, "bytes": self.bytes, "info": info}
        return entry


class ServedModels:
    """The daemon's models by name, in the order they were given (the first answers `info` and `stats` that
    name none, and requests that name none when it is the only one)."""

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise ValueError("a daemon serves at least one model")
        self._by_name = {m.name: m for m in models}
        if len(self._by_name) != len(models):
            raise ValueError("two models have the same name: give each its own with --model NAME=PATH")

    def get(self, name: str | None) -> ServedModel:
        """The model a request names; without a name, the daemon's only model."""
        if name is None:
            if len(self._by_name) == 1:
                return self.first
            raise ProtocolError(
                BAD_REQUEST, f"model is required: this daemon serves {', '.join(self._by_name)}", "model"
            )
        model = self._by_name.get(name)
        if model is None:
            raise ProtocolError(
                MODEL_NOT_FOUND,
                f"model {name!r} is not served here; served: {', '.join(self._by_name)}",
                "model",
            )
        return model

    @property
    def first(self) -> ServedModel:
        return next(iter(self._by_name.values()))

    def loaded(self) -> list[ServedModel]:
        return [m for m in self if m.engine is not None]

    def held_bytes(self, besides: ServedModel | None = None) -> int:
        """The memory budget's bytes the other models hold: loaded ones their weights and pools, loading ones what
        they were given."""
        return sum(
            m.bytes if m.engine is not None else m.granted if m.loading else 0
            for m in self
            if m is not besides
        )

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

"""The models a daemon serves, each with its own engine, found by the name a request gives (its `model` field)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.server.config import ServerConfig
from kvd.server.prompts import max_prompt_bytes
from kvd.server.protocol import BAD_REQUEST, MODEL_NOT_FOUND, ProtocolError

if TYPE_CHECKING:
    from kvd.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvd.server")


@dataclass
class ServedModel:
    """One model: its engine and the limits requests for it are held to."""

    name: str
    engine: LLMEngine
    max_prompt_tokens: int
    max_prompt_bytes: int | None  # a prompt past this is refused before it is tokenized (None: no bound)
    max_num_seqs: int  # requests its engine holds at most, running and waiting
    block_size: int

    @classmethod
    def of(cls, name: str, engine: LLMEngine, config: ServerConfig) -> ServedModel:
        model_limit = engine.max_model_len - 1  # room for at least one generated token
        limit = min(config.max_prompt_tokens or model_limit, model_limit)
        if config.max_prompt_tokens is not None and config.max_prompt_tokens > limit:
            logger.warning(
                "--max-prompt-tokens %d is past model %s's context (max_model_len %d): its prompts are limited to "
                "%d tokens (info's limits.max_prompt_tokens)",
                config.max_prompt_tokens,
                name,
                engine.max_model_len,
                limit,
            )
        info = engine.info()
        return cls(
            name,
            engine,
            limit,
            max_prompt_bytes(engine.tokenizer, limit),
            info["max_num_seqs"],
            info["block_size"],
        )


class ServedModels:
    """The daemon's models by name, in the order they were given (the first answers requests that name none
    when it is the only one)."""

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
                return next(iter(self._by_name.values()))
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

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

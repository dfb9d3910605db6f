"""Why the engine refuses a request (or a pool too small to serve any): raised at admission and at startup."""

from __future__ import annotations


class RequestRejectedError(ValueError):
    """A request cannot be admitted; the message says why and what to change, `field` names the setting at
    fault when one is (None: the prompt)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class MemoryBudgetError(RequestRejectedError):
    """A model's weights and smallest KV pool do not fit in what the memory budget has left: `needed` bytes."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message, "memory")
        self.needed = needed


class RequestTooLongError(RequestRejectedError):
    """The prompt does not fit in max_model_len or in the KV pool."""

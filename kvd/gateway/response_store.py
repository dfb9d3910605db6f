"""Responses kept for `previous_response_id` and retrieval: in memory, per caller, for a bounded time and count.

A response is found only by the caller that created it (a key's name, else its address: kvd.gateway.auth), so
one tenant never reads or continues another's conversation, even with its id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_PER_OWNER = 256  # so that one caller's responses cannot push every other caller's out
TTL_S = 3600.0


@dataclass
class StoredResponse:
    owner: str
    body: dict[str, Any]  # the response object as it was returned
    turns: list[dict[str, Any]]  # its conversation in the daemon's messages, its own output included
    expires: float


class ResponseStore:
    def __init__(
        self, max_responses: int = MAX_RESPONSES, ttl_s: float = TTL_S, max_per_owner: int = MAX_PER_OWNER
    ) -> None:
        self.max_responses = max_responses
        self.max_per_owner = max_per_owner
        self.ttl_s = ttl_s
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def put(self, owner: str, body: dict[str, Any], turns: list[dict[str, Any]]) -> None:
        self._expire()
        owned = [key for key, stored in self._responses.items() if stored.owner == owner]
        for key in owned[: max(0, len(owned) + 1 - self.max_per_owner)]:  # the owner's oldest make room
            del self._responses[key]
        self._responses[body["id"]] = StoredResponse(owner, body, turns, time.monotonic() + self.ttl_s)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        self._expire()
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._responses[response_id]
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._responses and next(iter(self._responses.values())).expires <= now:
            self._responses.popitem(last=False)

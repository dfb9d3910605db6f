"""The fair queue: each client's accepted generations wait in its own queue, and the clients take turns."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvd.server.sessions import ClientSession, Generation


class FairQueue:
    """The clients with queued generations, in turn order. A client that takes a turn goes to the back, so a
    client with a thousand queued generations gets one admission per round like a client with one."""

    def __init__(self) -> None:
        self._turns: deque[ClientSession] = deque()

    def push(self, session: ClientSession, generation: Generation) -> None:
        session.pending.append(generation)
        if not session.has_turn:
            session.has_turn = True
            self._turns.append(session)

    def pop(self, may_admit: Callable[[ClientSession], bool]) -> tuple[ClientSession, Generation] | None:
        """The oldest queued generation of the next client in turn that `may_admit` (under its quotas)."""
        for _ in range(len(self._turns)):
            session = self._turns.popleft()
            if not session.pending:  # its generations were aborted, or the client was lost
                session.has_turn = False
                continue
            self._turns.append(session)
            if may_admit(session):
                return session, session.pending.popleft()
        return None

    def __len__(self) -> int:
        return sum(len(s.pending) for s in self._turns)

"""The fair queue: each client's accepted generations wait in its own queue; tenants take turns, and within a
tenant its clients (connections) do."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvd.server.sessions import ClientSession, Generation


class FairQueue:
    """Two rounds of turns. A tenant (a uid; the gateway's callers each have their own connection under its
    uid) that takes a turn goes to the back, so a user with sixteen connections gets one admission per round
    like a user with one; within the tenant, the client that took the turn goes to the back of its tenant's
    clients, so a client with a thousand queued generations gets one per round of its tenant like a client
    with one."""

    def __init__(self) -> None:
        self._tenants: deque[str] = deque()
        self._clients: dict[str, deque[ClientSession]] = {}

    def push(self, session: ClientSession, generation: Generation) -> None:
        session.pending.append(generation)
        if session.has_turn:
            return
        session.has_turn = True
        clients = self._clients.get(session.tenant)
        if clients is None:
            clients = self._clients[session.tenant] = deque()
            self._tenants.append(session.tenant)
        clients.append(session)

    def pop(
        self, pick: Callable[[ClientSession], Generation | None]
    ) -> tuple[ClientSession, Generation] | None:
        """The generation `pick` takes (under its quotas; a model's engine, its oldest queued for that model) of
        the next client in turn that has one."""
        for _ in range(len(self._tenants)):
            tenant = self._tenants.popleft()
            turn = self._next_client(self._clients[tenant], pick)
            if self._clients[tenant]:
                self._tenants.append(tenant)
            else:
                del self._clients[tenant]
            if turn is not None:
                return turn
        return None

    @staticmethod
    def _next_client(
        clients: deque[ClientSession], pick: Callable[[ClientSession], Generation | None]
    ) -> tuple[ClientSession, Generation] | None:
        for _ in range(len(clients)):
            session = clients.popleft()
            if not session.pending:  # its generations were aborted, or the client was lost
                session.has_turn = False
                continue
            clients.append(session)
            generation = pick(session)
            if generation is not None:
                session.pending.remove(generation)
                return session, generation
        return None

    def __len__(self) -> int:
        return sum(len(s.pending) for clients in self._clients.values() for s in clients)

"""Fair admission: the engine's own queue stays short, and the clients' queues take turns filling it."""

from __future__ import annotations

from kvd.engine.llm_engine import RequestRejectedError, RequestTooLongError
from kvd.server import events, protocol
from kvd.server.protocol import BAD_REQUEST, TOO_LARGE
from kvd.server.router import Router
from kvd.server.sessions import ClientSession
from kvd.server.state import ServerState


class Admission:
    def __init__(self, state: ServerState, router: Router) -> None:
        self.state = state
        self.router = router

    def admit(self) -> None:
        """Hand queued requests to the engine, round-robin across clients, while it has room."""
        engine = self.state.engine
        room = engine.num_free_slots
        while room > 0 and (turn := self.state.queue.pop(self._may_admit)) is not None:
            session, pending = turn
            try:
                engine.add_request(
                    session.engine_id(pending.request.id),
                    pending.token_ids,
                    pending.params,
                    pending.cache_salt,
                )
            except RequestRejectedError as e:
                code = TOO_LARGE if isinstance(e, RequestTooLongError) else BAD_REQUEST
                del session.requests[pending.request.id]
                self.state.counters.requests_rejected += 1
                self.state.events.publish(events.FINISHED, session, pending.request.id, finish_reason="error")
                self.router.send(
                    session.identity, protocol.error_reply(pending.request.id, code, str(e), pending.field)
                )
                self.state.sessions.release_if_idle(session)
                continue
            pending.request.in_engine = True
            self.state.counters.requests_total += 1
            self.state.events.publish(events.SCHEDULED, session, pending.request.id)
            room -= 1

    def _may_admit(self, session: ClientSession) -> bool:
        config = self.state.config
        cap = config.max_running_per_client
        if cap is not None and session.num_in_engine >= cap:
            return False
        block_cap = config.max_blocks_per_client
        if block_cap is None or not session.num_in_engine:
            return True  # a client's first request always runs, however large
        wanted = -(-len(session.pending[0].token_ids) // self.state.engine.block_size)
        return self.blocks_held(session) + wanted <= block_cap

    def blocks_held(self, session: ClientSession) -> int:
        """KV blocks the client's requests in the engine hold, or will once scheduled (a waiting prompt's)."""
        engine = self.state.engine
        return sum(engine.num_blocks_needed(session.engine_id(rid)) for rid in session.requests)

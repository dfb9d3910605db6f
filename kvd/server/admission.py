"""Admission: queued generations enter the engine while it has room, under each client's quotas."""

from __future__ import annotations

from kvd.engine.llm_engine import RequestRejectedError, RequestTooLongError
from kvd.server import events, protocol
from kvd.server.models import ServedModel
from kvd.server.protocol import BAD_REQUEST, TOO_LARGE
from kvd.server.replies import Replies
from kvd.server.sessions import ClientSession, Generation
from kvd.server.state import ServerState


class Admission:
    def __init__(self, state: ServerState, replies: Replies) -> None:
        self.state = state
        self.replies = replies

    def admit(self) -> None:
        """Hand queued generations to their models' engines, round-robin across clients, while they have room."""
        for model in self.state.models.loaded():
            self._admit(model)

    def _admit(self, model: ServedModel) -> None:
        state = self.state
        # An engine holds at most max_num_seqs requests, running and waiting; all of them are ours.
        room = model.max_num_seqs - state.num_in_engine(model)

        def pick(session: ClientSession) -> Generation | None:
            # The client's oldest generation for this model: one queued for a model whose engine is full does not
            # hold back its generations for another.
            generation = next((g for g in session.pending if g.model is model), None)
            return generation if generation is not None and self._may_admit(session, generation) else None

        while room > 0 and (turn := state.queue.pop(pick)) is not None:
            session, generation = turn
            try:
                self._add(generation)
            except RequestRejectedError as e:
                for engine_id in generation.engine_ids:
                    model.engine.abort(engine_id)
                generation.engine_ids = []
                self._reject(session, generation, e)
                continue
            generation.prompt_token_ids = []  # the engine has its own copy
            generation.matcher = None
            for engine_id in generation.engine_ids:
                state.in_engine[engine_id] = (session, generation)
            state.counters.requests_total += 1
            state.events.publish(events.SCHEDULED, session, generation.id)
            room -= len(generation.engine_ids)

    def _add(self, generation: Generation) -> None:
        """The generation's engine requests: one, or one per input of an embed request."""
        engine = generation.model.engine
        if generation.embed is None:
            engine_id = next(self.state.engine_ids)
            engine.add_request(
                engine_id,
                generation.prompt_token_ids,
                generation.params,
                generation.cache_salt,
                matcher=generation.matcher,
            )
            generation.engine_ids.append(engine_id)
            return
        for i, token_ids in enumerate(generation.embed.inputs):
            engine_id = next(self.state.engine_ids)
            try:
                engine.add_embed_request(engine_id, token_ids, generation.cache_salt)
            except RequestRejectedError as e:
                raise type(e)(str(e), f"input[{i}]") from None
            generation.engine_ids.append(engine_id)

    def _reject(self, session: ClientSession, generation: Generation, error: RequestRejectedError) -> None:
        code = TOO_LARGE if isinstance(error, RequestTooLongError) else BAD_REQUEST
        del session.requests[generation.id]
        self.state.counters.requests_rejected += 1
        self.state.events.publish(events.FINISHED, session, generation.id, finish_reason="error")
        reply = protocol.error_reply(generation.id, code, str(error), error.field or generation.prompt_field)
        self.replies.send(session.identity, reply)
        self.state.sessions.release_if_idle(session)

    def _may_admit(self, session: ClientSession, generation: Generation) -> bool:
        config = self.state.config
        cap = config.max_running_per_client
        if cap is not None and session.num_in_engine >= cap:
            return False
        block_cap = config.max_blocks_per_client
        if block_cap is None or not session.num_in_engine:
            return True  # a client's first generation always runs, however large
        wanted = _num_blocks(generation.num_prompt_tokens, generation.model)
        return _blocks_held(session) + wanted <= block_cap


def _blocks_held(session: ClientSession) -> int:
    """KV blocks the client's generations in the engines hold, or will once scheduled (a waiting prompt's)."""
    return sum(
        _num_blocks(g.num_prompt_tokens + g.num_output_tokens, g.model)
        for g in session.requests.values()
        if g.engine_ids
    )


def _num_blocks(num_tokens: int, model: ServedModel) -> int:
    return -(-num_tokens // model.block_size)

"""Engine step outputs back to their clients: stream chunks, final replies and preemption events."""

from __future__ import annotations

import math

from kvd.engine.outputs import EngineStepOutput, RequestOutput
from kvd.server import events, protocol
from kvd.server.outbox import Outbox
from kvd.server.sessions import ClientSession, Generation
from kvd.server.state import ServerState


class Replies:
    def __init__(self, state: ServerState, outbox: Outbox) -> None:
        self.state = state
        self.outbox = outbox

    def send(self, identity: bytes, reply: dict) -> None:
        self.outbox.send(identity, reply)

    def dispatch(self, step: EngineStepOutput) -> None:
        """Send each increment to its client, then count and announce the step's preemptions."""
        for out in step.outputs:
            self._dispatch(out)
        for engine_id in step.preempted:
            self._note_preemption(engine_id)

    def _dispatch(self, out: RequestOutput) -> None:
        entry = self.state.in_engine.get(out.request_id)
        if entry is None:
            return  # its client was lost earlier in this turn
        session, generation = entry
        if generation.embed is not None:
            self._route_embedding(session, generation, out)
            return
        generation.num_output_tokens = out.num_output_tokens
        generation.num_cached_tokens = out.num_cached_tokens
        generation.num_draft_tokens = out.num_draft_tokens
        generation.num_accepted_tokens = out.num_accepted_tokens
        if out.prompt_logprobs is not None:
            generation.prompt_logprobs = protocol.logprobs_payload(out.prompt_logprobs)
        logprobs = protocol.logprobs_payload(out.logprobs or []) if generation.want_logprobs else None
        reasoning, text = "", out.new_text
        if generation.reasoning_parser is not None:
            generation.reasoning_parser.count(out.new_token_ids)
            reasoning, text = generation.reasoning_parser.feed(text)
        if generation.tool_parser is not None:
            text = generation.tool_parser.feed(text)
        if generation.stream:
            if out.finished:
                reply = self.final_reply(
                    generation,
                    out.finish_reason,
                    text,
                    out.new_token_ids,
                    logprobs,
                    out.stop_string,
                    reasoning,
                )
            else:
                reply = protocol.chunk_reply(generation.id, text, out.new_token_ids, logprobs, reasoning)
        else:
            generation.reasoning.append(reasoning)
            generation.text.append(text)
            generation.token_ids.extend(out.new_token_ids)
            generation.logprobs.extend(logprobs or [])
            reply = (
                self.final_reply(generation, out.finish_reason, stop_string=out.stop_string)
                if out.finished
                else None
            )
        if out.finished:
            del self.state.in_engine[out.request_id]
            self._finished(session, generation, reply["finish_reason"])
        if reply is not None:
            self.send(session.identity, reply)
        if out.finished:
            self.state.sessions.release_if_idle(session)

    def _route_embedding(self, session: ClientSession, generation: Generation, out: RequestOutput) -> None:
        """One input's vector; the result goes out when every input has one."""
        del self.state.in_engine[out.request_id]
        job = generation.embed
        job.vectors[generation.engine_ids.index(out.request_id)] = _truncated(out.embedding, job.dimensions)
        if not job.done:
            return
        self._finished(session, generation, "stop")
        result = {
            "embeddings": job.vectors,
            "dimensions": len(job.vectors[0]),
            "pooling": generation.model.engine.pooling,
            "usage": {"prompt_tokens": generation.num_prompt_tokens},
        }
        self.send(session.identity, protocol.result_reply(generation.id, result))
        self.state.sessions.release_if_idle(session)

    def _finished(self, session: ClientSession, generation: Generation, reason: str) -> None:
        del session.requests[generation.id]
        self.publish_finished(session, generation, reason)

    def _note_preemption(self, engine_id: int) -> None:
        entry = self.state.in_engine.get(engine_id)
        if entry is not None:  # not finished within the same step
            session, generation = entry
            generation.num_preemptions += 1
            self.state.events.publish(
                events.PREEMPTED, session, generation.id, output_tokens=generation.num_output_tokens
            )

    def publish_finished(self, session: ClientSession, generation: Generation, reason: str) -> None:
        self.state.events.publish(
            events.FINISHED,
            session,
            generation.id,
            finish_reason=reason,
            prompt_tokens=generation.num_prompt_tokens,
            completion_tokens=generation.num_output_tokens,
            cached_tokens=generation.num_cached_tokens,
            preemptions=generation.num_preemptions,
        )

    def final_reply(
        self,
        generation: Generation,
        reason: str,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: list[dict] | None = None,
        stop_string: str | None = None,
        reasoning: str = "",
    ) -> dict:
        """The final reply: a stream's last delta, or a non-streaming generation's whole output."""
        if not generation.stream:
            text, token_ids, logprobs = "".join(generation.text), generation.token_ids, generation.logprobs
            reasoning = "".join(generation.reasoning)
        if not generation.want_logprobs:
            logprobs = None
        elif logprobs is None:
            logprobs = []
        usage = protocol.usage(
            generation.num_prompt_tokens,
            generation.num_output_tokens,
            generation.num_cached_tokens,
            generation.num_draft_tokens,
            generation.num_accepted_tokens,
        )
        extra = {}
        if generation.reasoning_parser is not None:
            usage["reasoning_tokens"] = generation.reasoning_parser.num_tokens
            last, rest = generation.reasoning_parser.finish()
            reasoning += last
            text += generation.tool_parser.feed(rest) if generation.tool_parser is not None else rest
        if reasoning:
            extra["reasoning"] = reasoning
        if generation.tool_parser is not None:
            rest, calls, reason = generation.tool_parser.finish(reason)
            text += rest
            if calls:
                extra["tool_calls"] = protocol.tool_calls_payload(calls)
        if generation.prompt_logprobs is not None:
            extra["prompt_logprobs"] = generation.prompt_logprobs
        if stop_string is not None and reason == "stop":
            extra["stop_string"] = stop_string
        return protocol.final_reply(generation.id, text, token_ids or [], logprobs, reason, usage, extra)


def _truncated(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` components, normalised again (Matryoshka-style embeddings)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]

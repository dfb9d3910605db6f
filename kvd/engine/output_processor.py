"""The output path (vLLM's OutputProcessor): a sampled token or an ended request in, the request's
`RequestOutput` increment out, with the stop checks and the release of a finished sequence."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.engine.engine_request import EngineRequest
from kvd.engine.outputs import RequestOutput
from kvd.engine.sampler import SampledToken
from kvd.engine.scheduler import Scheduler


@dataclass
class OutputProcessor:
    scheduler: Scheduler  # frees a finished sequence's blocks
    eos_token_ids: set[int]
    max_model_len: int

    def on_token(self, request: EngineRequest, token: SampledToken) -> RequestOutput:
        """The increment of a token sampled for the request (already appended to its sequence)."""
        seq = request.seq
        first = seq.num_output_tokens == 1
        if first:
            request.num_cached_tokens = seq.num_cached_tokens
        if request.matcher is not None:
            request.matcher.consume_token(token.token_id)
        request.detokenizer.add_tokens([token.token_id])
        request.pending.append(token)
        reason = self._stop_reason(request, token.token_id)
        prompt_logprobs = request.prompt_logprobs.entries if first and request.prompt_logprobs else None
        return self._output(request, reason, sampled=True, prompt_logprobs=prompt_logprobs)

    def on_embedded(self, request: EngineRequest) -> RequestOutput:
        """An embed request's only output: its prompt is computed, the vector pooled."""
        output = self.finish(request, "stop")
        output.embedding = request.embedding.vector()
        return output

    def finish(self, request: EngineRequest, reason: str) -> RequestOutput:
        """The last increment of a request that ends without a new token."""
        return self._output(request, reason, sampled=False)

    def release(self, request: EngineRequest) -> None:
        """Free the sequence's blocks at once (finished or aborted) and flush its detokenizer."""
        self.scheduler.finish(request.seq)
        if request.detokenizer is not None:
            request.detokenizer.finish()

    def _stop_reason(self, request: EngineRequest, token_id: int) -> str | None:
        params, seq = request.params, request.seq
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if request.detokenizer.stopped:
            return "stop"
        # The grammar takes no further token (it ended, end-of-sequence included): the output is complete.
        if request.matcher is not None and (request.matcher.is_stopped() or request.matcher.is_error()):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _output(
        self,
        request: EngineRequest,
        reason: str | None,
        sampled: bool,
        prompt_logprobs: list[SampledToken | None] | None = None,
    ) -> RequestOutput:
        """The text and tokens that go out now; with a `reason`, the request's last (released first, so that
        the detokenizer's held-back bytes go out with it)."""
        finished = reason is not None
        if finished:
            self.release(request)
        detokenizer, seq = request.detokenizer, request.seq
        text = detokenizer.take_delta(finished) if detokenizer else ""
        tokens = self._take_pending(request, finished) if detokenizer else []
        # A sampled step reports its list even when stop strings hold every token back; a finish only a flush.
        want_logprobs = request.params.logprobs is not None and (sampled or bool(tokens))
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[t.token_id for t in tokens],
            new_text=text,
            finished=finished,
            finish_reason=reason,
            logprobs=tokens if want_logprobs else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            stop_string=detokenizer.stop_string if finished and detokenizer else None,
        )

    @staticmethod
    def _take_pending(request: EngineRequest, finished: bool) -> list[SampledToken]:
        """The pending tokens that go out with the text taken so far."""
        count = request.detokenizer.take_tokens(finished)
        tokens, request.pending = request.pending[:count], request.pending[count:]
        return tokens

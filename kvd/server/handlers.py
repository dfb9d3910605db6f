"""Requests from clients: decode and validate each message, answer the quick ops, and accept generations."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import kvd
from kvd.engine.llm_engine import LLMEngine, RequestRejectedError
from kvd.request.reasoning import ReasoningError
from kvd.request.sampling_params import MAX_LOGPROBS
from kvd.request.tool_grammar import tool_call_grammar
from kvd.request.tool_parse import ToolCallParser
from kvd.server import events, protocol
from kvd.server.aborts import Aborts
from kvd.server.admission import Admission
from kvd.server.config import HEARTBEAT_INTERVAL_S
from kvd.server.isolation import cache_salt, owner_tenant, visible_info
from kvd.server.model_loading import ModelLoading
from kvd.server.models import ServedModel
from kvd.server.prompts import PromptJob, PromptMessage, PromptResult, PromptWorker, prompt_bytes
from kvd.server.protocol import (
    BAD_REQUEST,
    INTERNAL,
    NOT_FOUND,
    OVERLOADED,
    SHUTTING_DOWN,
    TOO_LARGE,
    AbortMessage,
    DetokenizeMessage,
    EmbedMessage,
    GenerateMessage,
    Message,
    ProtocolError,
    TokenizeMessage,
)
from kvd.server.replies import Replies
from kvd.server.sessions import EmbedJob, Generation
from kvd.server.state import ServerState
from kvd.server.stats import client_stats

logger = logging.getLogger("kvd.server")
# The ops whose keep_alive (or the daemon's default) sets how long their model stays loaded once idle.
KEEPS_ALIVE = ("generate", "chat", "embed", "load")


class RequestHandler:
    def __init__(
        self,
        state: ServerState,
        replies: Replies,
        admission: Admission,
        aborts: Aborts,
        loading: ModelLoading,
    ) -> None:
        self.state = state
        self.replies = replies
        self.admission = admission
        self.aborts = aborts
        self.loading = loading
        self.prompts = PromptWorker(self._prepare)
        self._handlers: dict[str, Callable] = {
            "detokenize": self._detokenize,
            "abort": self._abort,
            "health": self._health,
            "info": self._info,
            "stats": self._stats,
            "list_models": self._list_models,
            "load": self._load,
            "unload": self._unload,
        }

    def handle(self, identity: bytes, tenant: str, frames: list[bytes], chosen_id: bool = False) -> None:
        """One message. `chosen_id`: the peer set its own routing id (ZMQ_ROUTING_ID), which kvd refuses."""
        request_id = None
        try:
            # Refusing chosen ids also keeps a connection id to one peer for the daemon's life (libzmq's own
            # ids never repeat), so a session's tenant never changes and no peer can take another's replies.
            if chosen_id:
                raise ProtocolError(
                    BAD_REQUEST,
                    "connections that choose their own ZeroMQ routing id are refused; leave "
                    "ZMQ_ROUTING_ID unset (every kvd client does)",
                    "routing_id",
                )
            if len(frames) != 1:
                raise ProtocolError(
                    BAD_REQUEST, "send each request as one frame from a DEALER socket (no envelope)"
                )
            message = protocol.parse_message(protocol.decode(frames[0], self.state.config.max_message_bytes))
            request_id = message.id
            if isinstance(message, GenerateMessage | EmbedMessage):
                self._generate(identity, tenant, message)
            elif isinstance(message, TokenizeMessage):
                self._tokenize(identity, tenant, message)
            else:
                self._handlers[message.op](identity, tenant, message)
        except ProtocolError as e:
            self._reject(identity, e.request_id if e.request_id is not None else request_id, e)
        except Exception:
            # A bug, not the client's fault: answer, log, and keep serving everyone else.
            logger.exception("internal error while handling a request of client %s", identity.hex())
            self._reject(identity, request_id, ProtocolError(INTERNAL, "internal error; see the daemon log"))

    def on_prompts_ready(self) -> None:
        """Take the prompts the worker has tokenized: queue the generations, answer the tokenize requests."""
        for result in self.prompts.results():
            job = result.job
            job.model.num_jobs -= 1
            if job.generation is None:
                self._tokenized(result)
            else:
                self._queue(result)

    def close(self) -> None:
        self.prompts.close()
        self.loading.close()

    def _submit(self, job: PromptJob) -> None:
        job.model.num_jobs += 1  # its engine stays loaded while the worker holds the job
        self.prompts.submit(job)

    def _when_loaded(
        self,
        identity: bytes,
        tenant: str,
        message: Message,
        model: ServedModel,
        go: Callable[[], None],
        forget: Callable[[], bool] = lambda: True,
    ) -> None:
        """Run `go` once `model` is loaded (at once, if it is); the load's error, or go's, is the reply, once
        `forget` has dropped what the request holds (False: it is gone already, its reply sent). While it waits,
        its client hears heartbeats."""
        if message.op in KEEPS_ALIVE:  # the requests that say how long the model stays
            model.keep_alive = (
                self.state.config.keep_alive if message.keep_alive is None else message.keep_alive
            )
        session = self.state.sessions.open(identity, tenant) if model.engine is None else None
        if session is not None:
            session.num_waiting += 1

        def then(error: ProtocolError | None) -> None:
            try:
                if error is not None:
                    raise error
                go()
            except ProtocolError as e:
                if forget():
                    self._reject(identity, message.id, e)
            except Exception:  # a bug: this request fails, the daemon serves on
                logger.exception("internal error while serving a request for model %s", model.name)
                if forget():
                    self._reject(
                        identity, message.id, ProtocolError(INTERNAL, "internal error; see the daemon log")
                    )
            finally:
                if session is not None:
                    session.num_waiting -= 1
                    self.state.sessions.release_if_idle(session)

        self.loading.ensure(model, then)

    def _tokenize(self, identity: bytes, tenant: str, message: TokenizeMessage) -> None:
        model = self.state.models.get(message.model)

        def tokenize() -> None:
            self._check_prompt_bytes(message, model)
            self._submit(PromptJob(identity, tenant, message, model))

        self._when_loaded(identity, tenant, message, model, tokenize)

    def _reject(self, identity: bytes, request_id: object, error: ProtocolError) -> None:
        self.state.counters.requests_rejected += 1
        self.replies.send(identity, protocol.error_reply(request_id, error.code, error.message, error.field))

    def _generate(self, identity: bytes, tenant: str, message: GenerateMessage | EmbedMessage) -> None:
        state = self.state
        if state.draining:
            raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down and takes no new requests")
        model = state.models.get(message.model)
        session = state.sessions.get(identity)
        in_flight = session.requests if session else {}
        if message.id in in_flight:
            raise ProtocolError(
                BAD_REQUEST, f"request {message.id!r} is already in flight; use a new id", "id"
            )
        if len(in_flight) >= state.config.max_queued_per_client:
            raise ProtocolError(
                OVERLOADED,
                f"this client has {len(in_flight)} requests in flight, the limit (--max-queued-per-client); "
                "wait for some to finish",
            )
        if session is None and state.sessions.num_sessions_of(tenant) >= state.config.max_clients_per_tenant:
            raise ProtocolError(
                OVERLOADED,
                f"this user has {state.config.max_clients_per_tenant} clients with requests in flight, the "
                "limit (--max-clients-per-tenant); send more requests on fewer connections",
            )
        if state.sessions.num_requests_of(tenant) >= state.config.max_queued_per_tenant:
            raise ProtocolError(
                OVERLOADED,
                f"this user has {state.config.max_queued_per_tenant} requests in flight over all its "
                "clients, the limit (--max-queued-per-tenant); wait for some to finish",
            )
        if state.sessions.num_requests >= state.config.max_queued:
            raise ProtocolError(
                OVERLOADED,
                f"the daemon has {state.config.max_queued} requests in flight (--max-queued); retry later",
            )
        # Reserved now, so that its id is taken and an abort finds it while its model loads or its prompt is
        # tokenized.
        if isinstance(message, EmbedMessage):
            generation = Generation(message.id, stream=False, model=model)
        else:
            generation = Generation(message.id, message.stream, params=message.params, model=model)
        session = state.sessions.open(identity, tenant)
        session.requests[message.id] = generation

        def forget() -> bool:
            if session.requests.get(message.id) is not generation:
                return False  # aborted, or its client lost, while its model loaded: answered already
            del session.requests[message.id]
            state.sessions.release_if_idle(session)
            return True

        def tokenize() -> None:
            if session.requests.get(message.id) is generation:
                self._check_prompt_bytes(message, model)
                self._submit(PromptJob(identity, tenant, message, model, generation))

        self._when_loaded(identity, tenant, message, model, tokenize, forget)

    @staticmethod
    def _check_prompt_bytes(message: PromptMessage, model: ServedModel) -> None:
        """Refuse, without tokenizing it, a prompt too long to fit whatever its tokens."""
        size, field = prompt_bytes(message)
        if model.max_prompt_bytes is not None and size > model.max_prompt_bytes:
            raise ProtocolError(
                TOO_LARGE,
                f"the prompt has {size} bytes, more than {model.max_prompt_tokens} tokens (the limit) "
                "can hold; shorten it",
                field,
            )

    def _queue(self, result: PromptResult) -> None:
        job, state = result.job, self.state
        generation = job.generation
        session = state.sessions.get(job.identity)
        if session is None or session.requests.get(generation.id) is not generation:
            return  # aborted, or its client lost, while it was tokenized
        error, limit = result.error, job.model.max_prompt_tokens
        if error is None and generation.embed is None and len(result.token_ids) > limit:
            error = ProtocolError(
                TOO_LARGE,
                f"the prompt has {len(result.token_ids)} tokens; the limit is {limit}",
                result.field,
            )
        if error is not None:
            del session.requests[generation.id]
            state.sessions.release_if_idle(session)
            self._reject(job.identity, generation.id, error)
            return
        generation.num_prompt_tokens = len(result.token_ids)
        generation.prompt_token_ids = result.token_ids
        generation.prompt_field = result.field
        tenant = None if state.config.shared_prefix_cache else job.tenant
        generation.cache_salt = cache_salt(tenant, job.message.cache_salt)
        state.queue.push(session, generation)
        state.events.publish(events.QUEUED, session, generation.id, prompt_tokens=len(result.token_ids))
        self.admission.admit()  # at once when the engine has room: a bad prompt's error comes back now

    def _tokenized(self, result: PromptResult) -> None:
        job = result.job
        if result.error is not None:
            self._reject(job.identity, job.message.id, result.error)
        else:
            reply = protocol.result_reply(job.message.id, {"token_ids": result.token_ids})
            self.replies.send(job.identity, reply)

    def _prepare(self, job: PromptJob) -> PromptResult:
        """Tokenize the job's prompt(s); for a generation also compile its grammar and set up its tool-call
        parser (runs on the worker thread)."""
        message = job.message
        if isinstance(message, EmbedMessage):
            job.generation.embed = self._embed_job(message, job.model)
            return PromptResult(job, "input", [t for i in job.generation.embed.inputs for t in i])
        field, token_ids = self._prompt_tokens(message, job.model.engine)
        if isinstance(message, GenerateMessage):
            self._prepare_generation(message, job.generation, job.tenant, token_ids)
        return PromptResult(job, field, token_ids)

    @staticmethod
    def _prompt_tokens(
        message: GenerateMessage | TokenizeMessage, engine: LLMEngine
    ) -> tuple[str, list[int]]:
        """The prompt's token ids, and the request field they came from."""
        if message.messages is not None:
            try:
                engine.check_reasoning(message.reasoning)
            except ReasoningError as e:
                raise ProtocolError(BAD_REQUEST, str(e), e.field) from None
            try:
                return "messages", engine.apply_chat_template(
                    message.messages, message.tools, message.reasoning
                )
            except Exception as e:  # the template is a program: whatever it raises, the input is at fault
                raise ProtocolError(
                    BAD_REQUEST, f"the chat template rejected the messages: {e}", "messages"
                ) from None
        if isinstance(message, TokenizeMessage):
            return "text", engine.encode(message.text)
        if message.prompt is not None:
            return "prompt", engine.encode(message.prompt)
        return "prompt_token_ids", message.prompt_token_ids

    def _prepare_generation(
        self, message: GenerateMessage, generation: Generation, tenant: str, prompt_ids: list[int]
    ) -> None:
        engine = generation.model.engine
        params, field = message.params, None
        chat = message.messages is not None
        # The tools whose calls are read from the output: none with tool_choice "none".
        calls = frozenset(t.name for t in message.tools or [] if message.tool_choice.mode != "none")
        if chat:
            generation.params = engine.chat_params(generation.params)  # what the engine is given (admission)
            generation.reasoning_parser = engine.chat_parser(prompt_ids, calls)
        if calls:
            grammar = tool_call_grammar(
                message.tools, message.tool_choice, engine.tool_template, message.parallel_tool_calls
            )
            generation.tool_parser = ToolCallParser(engine.tool_template, message.tools, grammar is not None)
            if grammar is not None:
                params, field = replace(params, grammar=grammar), "tools"
        try:
            engine.check_params(params)
            generation.matcher = engine.compile_grammar(params, tenant, chat)
            if chat:
                generation.matcher = engine.chat_constraint(generation.matcher, prompt_ids, message.reasoning)
        except RequestRejectedError as e:
            raise ProtocolError(BAD_REQUEST, str(e), field or e.field) from None

    @staticmethod
    def _embed_job(message: EmbedMessage, model: ServedModel) -> EmbedJob:
        engine, limit = model.engine, model.max_prompt_tokens
        hidden = engine.config.hidden_size
        if message.dimensions is not None and message.dimensions > hidden:
            raise ProtocolError(
                BAD_REQUEST, f"dimensions must be at most {hidden} (the model's hidden size)", "dimensions"
            )
        inputs = [engine.encode(i) if isinstance(i, str) else i for i in message.inputs]
        for i, token_ids in enumerate(inputs):
            if len(token_ids) > limit:
                raise ProtocolError(
                    TOO_LARGE, f"input {i} has {len(token_ids)} tokens; the limit is {limit}", f"input[{i}]"
                )
            if not token_ids:
                raise ProtocolError(BAD_REQUEST, f"input {i} has no tokens", f"input[{i}]")
        return EmbedJob(inputs, message.dimensions)

    def _detokenize(self, identity: bytes, tenant: str, message: DetokenizeMessage) -> None:
        model = self.state.models.get(message.model)

        def detokenize() -> None:
            vocab = model.engine.config.vocab_size
            if any(t >= vocab for t in message.token_ids):
                raise ProtocolError(BAD_REQUEST, f"token ids must lie in [0, {vocab})", "token_ids")
            text = model.engine.decode(message.token_ids)
            self.replies.send(identity, protocol.result_reply(message.id, {"text": text}))

        self._when_loaded(identity, tenant, message, model, detokenize)

    def _abort(self, identity: bytes, tenant: str, message: AbortMessage) -> None:
        session = self.state.sessions.get(identity)
        target = session.requests.get(message.target) if session else None
        if target is None:
            raise ProtocolError(
                NOT_FOUND, f"request {message.target!r} is not in flight for this client", "target"
            )
        self.aborts.abort(session, target)
        self.state.sessions.release_if_idle(session)
        self.replies.send(identity, protocol.result_reply(message.id, {"aborted": True}))

    def _health(self, identity: bytes, tenant: str, message: Message) -> None:
        status = "draining" if self.state.draining else "ready"
        self.replies.send(identity, protocol.result_reply(message.id, {"status": status}))

    def _info(self, identity: bytes, tenant: str, message: Message) -> None:
        config, model = self.state.config, self._described(message)
        info = {
            "model": model.name,
            "loaded": model.engine is not None,
            "models": [m.name for m in self.state.models],
            "kvd_version": kvd.__version__,
            "protocol_version": protocol.PROTOCOL_VERSION,
            "supported_versions": list(protocol.SUPPORTED_VERSIONS),
        }
        if model.engine is None:  # described by name: asking about a model does not load it
            self.replies.send(identity, protocol.result_reply(message.id, info))
            return
        info = visible_info(model.engine.info(), tenant) | info
        info |= {
            "limits": {
                "max_message_bytes": config.max_message_bytes,
                "max_prompt_tokens": model.max_prompt_tokens,
                "max_prompt_bytes": model.max_prompt_bytes,
                "max_queued_per_client": config.max_queued_per_client,
                "max_queued": config.max_queued,
                "max_queued_per_tenant": config.max_queued_per_tenant,
                "max_clients_per_tenant": config.max_clients_per_tenant,
                "max_running_per_client": config.max_running_per_client,
                "max_blocks_per_client": config.max_blocks_per_client,
                "max_logprobs": MAX_LOGPROBS,
                "max_stop_sequences": protocol.MAX_STOP_SEQUENCES,
                "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
                "client_timeout_s": config.client_timeout,
            },
        }
        self.replies.send(identity, protocol.result_reply(message.id, info))

    def _stats(self, identity: bytes, tenant: str, message: Message) -> None:
        """The load; per-client rows only of the asker's own tenant, unless it is the daemon's owner (another
        user's activity is none of a tenant's business)."""
        state = self.state
        sessions = state.sessions
        everyone = tenant == owner_tenant()
        model = self._described(message)
        stats = (model.engine.stats() if model.engine is not None else {"loaded": False}) | {
            "model": model.name,
            "daemon": {
                "uptime_s": time.monotonic() - state.started,
                "num_clients": len(sessions),
                "num_requests": sessions.num_requests,
                "num_queued": len(state.queue),
                "num_tokenizing": self.prompts.num_pending,
                "draining": state.draining,
                **vars(state.counters),
                "clients": [
                    client_stats(s) for s in sessions if s.requests and (everyone or s.tenant == tenant)
                ],
            },
        }
        if len(state.models) > 1:  # every loaded model's engine, so that one request sees the whole daemon
            stats["models"] = {m.name: m.engine.stats() for m in state.models.loaded()}
        self.replies.send(identity, protocol.result_reply(message.id, stats))

    def _described(self, message: Message) -> ServedModel:
        """The model `info` and `stats` describe: the one named, else the first."""
        models = self.state.models
        return models.first if message.model is None else models.get(message.model)

    def _list_models(self, identity: bytes, tenant: str, message: Message) -> None:
        models = [m.listing(tenant) for m in self.state.models]
        self.replies.send(identity, protocol.result_reply(message.id, {"models": models}))

    def _load(self, identity: bytes, tenant: str, message: Message) -> None:
        """Load the model (answered once it is loaded); a later keep_alive of its requests may unload it."""
        model = self.state.models.get(message.model)

        def loaded() -> None:
            self.replies.send(identity, protocol.result_reply(message.id, model.listing(tenant)))

        self._when_loaded(identity, tenant, message, model, loaded)

    def _unload(self, identity: bytes, tenant: str, message: Message) -> None:
        """Unload the model now if nothing is in flight for it, else as soon as nothing is."""
        model = self.state.models.get(message.model)
        if model.pinned:
            raise ProtocolError(BAD_REQUEST, f"model {model.name} is pinned: it stays loaded", "model")
        model.keep_alive = 0.0
        self.loading.expire()
        done = {"unloaded": model.engine is None and not model.loading}
        self.replies.send(identity, protocol.result_reply(message.id, done))

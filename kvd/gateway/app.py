"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings, OpenAI's /v1/responses,
Anthropic's /v1/messages,
Ollama's /api, /health and /metrics; /metrics needs the API key as the others do (its counters show the callers' activity)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvd.gateway import anthropic, embeddings, ollama, responses_api
from kvd.gateway.auth import Access, Guard
from kvd.gateway.bodies import EchoedPrompt, Reply
from kvd.gateway.callers import CallerClients
from kvd.gateway.choices import Job, collect, merged, prompt_fields, unless_disconnected
from kvd.gateway.errors import (
    from_kvd_error,
    generation_cut,
    install_handlers,
    invalid_fields,
    unavailable_reason,
)
from kvd.gateway.http_metrics import CountRequests
from kvd.gateway.metrics import GatewayMetrics
from kvd.gateway.outcome import answer
from kvd.gateway.schemas import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from kvd.gateway.state import Gateway, ServedModel, gateway_of
from kvd_client import AsyncClient, KvdError

logger = logging.getLogger("kvd.gateway")

# A health probe's answer within this: the daemon answers health between engine steps (a long prefill step can
# take seconds), and a probe must not hang for the client's whole timeout.
HEALTH_TIMEOUT_S = 5.0

# What a route prepares once the model is checked: the daemon requests, the reply's shape, and whether the
# one token generated is dropped (echo with max_tokens 0).
Plan = tuple[list[Job], Reply, bool]


def create_app(
    endpoint: str | None = None,
    served_model_name: str | None = None,
    timeout: float = 30.0,
    access: Access | None = None,
) -> FastAPI:
    """The app; `access` (default: loopback Hosts, no keys) says who may use it (kvd.gateway.auth)."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncClient(endpoint, timeout=timeout)
        callers = CallerClients(lambda: AsyncClient(endpoint, timeout=timeout), shared=client)
        app.state.gateway = Gateway(client, callers, metrics, served_model_name, started=int(time.time()))
        try:
            yield
        finally:
            callers.close()
            client.close()

    app = FastAPI(title="kvd", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, access=access or Access())
    app.add_middleware(CountRequests, metrics=metrics)  # the outer one: refused requests are counted too
    install_handlers(app)
    app.include_router(embeddings.router)
    app.include_router(ollama.router)
    app.include_router(anthropic.router)
    app.include_router(responses_api.router)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            status = (await asyncio.wait_for(gateway_of(request).client.health(), HEALTH_TIMEOUT_S))["status"]
        except (KvdError, asyncio.TimeoutError) as e:  # asyncio's is not the builtin before Python 3.11
            message = unavailable_reason(e) or f"the kvd daemon did not answer within {HEALTH_TIMEOUT_S:g} s"
            return JSONResponse({"status": "unavailable", "message": message}, status_code=503)
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        gateway = gateway_of(request)
        try:
            stats = await gateway.client.stats()
        except KvdError:
            stats = None  # kvd_daemon_up 0; the gateway's own metrics still count
        return Response(gateway.metrics.exposition(stats), media_type=CONTENT_TYPE_LATEST)

    def model_card(gateway: Gateway, model: ServedModel) -> dict:
        return {
            "id": model.shown,
            "object": "model",
            "created": gateway.started,
            "owned_by": "kvd",
            "max_model_len": model.info.get("max_model_len"),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway = gateway_of(request)
        return {"object": "list", "data": [model_card(gateway, m) for m in await gateway.models(request)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict:
        gateway = gateway_of(request)
        return model_card(gateway, await gateway.check_model(request, model))  # 404 for a name not served

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async def plan(gateway: Gateway, model: ServedModel) -> Plan:
            prompts = body.prompts()
            echo = None
            if body.echo:
                # Token ids, so that the prompt's log-probabilities line up with known tokens.
                prompts = list(await asyncio.gather(*(_token_ids(gateway.client, model, p) for p in prompts)))
                texts = await asyncio.gather(*(_text(gateway.client, model, p) for p in body.prompts()))
                echo = [EchoedPrompt(t, ids) for t, ids in zip(texts, prompts, strict=True)]
                await model.texts.fill([], [t for ids in prompts for t in ids])
            max_tokens = body.requested_max_tokens
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
            # max_tokens 0 with echo scores the prompt only: the daemon generates one token, dropped here.
            fields = [body.daemon_fields(max(max_tokens, 1), j) for j in range(body.n)]
            if echo is not None and body.logprobs is not None:
                fields = [{**f, "prompt_logprobs": body.logprobs} for f in fields]
            reply = Reply(model.shown, False, body.logprobs is not None, model.texts, n=body.n, echo=echo)
            if body.continuous_usage:
                reply.prompt_counts = await _prompt_counts(gateway.client, model, "generate", prompts)
            return [(p, f) for p in prompts for f in fields], reply, echo is not None and max_tokens == 0

        return await _generate(request, body, "generate", plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        async def plan(gateway: Gateway, model: ServedModel) -> Plan:
            # Like OpenAI's chat API: without a limit, the reply may run to the end of the context.
            max_tokens = body.requested_max_tokens or model.context_tokens
            messages = body.conversation()
            jobs = [(messages, body.daemon_fields(max_tokens, j)) for j in range(body.n)]
            reply = Reply(model.shown, True, body.num_logprobs is not None, model.texts, n=body.n)
            if body.continuous_usage:
                reply.prompt_counts = await _prompt_counts(
                    gateway.client, model, "chat", [messages], jobs[0][1]
                )
            return jobs, reply, False

        return await _generate(request, body, "chat", plan)

    return app


async def _token_ids(client: AsyncClient, model: ServedModel, prompt: str | list[int]) -> list[int]:
    return await client.tokenize(prompt, model=model.name) if isinstance(prompt, str) else prompt


async def _text(client: AsyncClient, model: ServedModel, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else await client.detokenize(prompt, model.name)


async def _prompt_counts(
    client: AsyncClient, model: ServedModel, op: str, prompts: list, fields: dict | None = None
) -> list[int]:
    """Each prompt's token count as the daemon will see it (a chat's tools and reasoning fields as chat's)."""
    if op == "chat":
        fields = prompt_fields(fields or {})
        return [len(await client.tokenize(messages=m, **fields, model=model.name)) for m in prompts]
    return [len(await _token_ids(client, model, p)) for p in prompts]


async def _generate(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    op: str,
    plan: Callable[[Gateway, ServedModel], Awaitable[Plan]],
) -> Response:
    gateway = gateway_of(request)
    names = body.param_names()
    return await answer(
        gateway.metrics, request.url.path, names, _reply(request, gateway, body, op, plan, names)
    )


async def _reply(
    request: Request,
    gateway: Gateway,
    body: CompletionRequest | ChatCompletionRequest,
    op: str,
    plan: Callable[[Gateway, ServedModel], Awaitable[Plan]],
    names: dict[str, str],
) -> dict | StreamingResponse:
    """The whole reply's body, or the stream of its events."""
    model = await gateway.check_model(request, body.model)
    refused = body.refusals()
    if refused:
        raise invalid_fields(refused)
    jobs, reply, drop_generated = await plan(gateway, model)
    streams = gateway.streams(request, model, op, jobs, body.user or body.safety_identifier)
    chunks = merged(streams, gateway.metrics, body.choice_field)
    if body.stream:
        # Send the first chunk's errors (a bad field, an overloaded daemon) as an HTTP error, not a stream.
        first = await anext(chunks)
        events = _events(gateway, reply, body.include_usage, first, chunks, request.url.path, names)
        return StreamingResponse(events, media_type="text/event-stream")
    choices = await unless_disconnected(request, collect(chunks, len(jobs)))
    if any(c.finish_reason == "abort" for c in choices):
        raise generation_cut()
    if drop_generated:
        for choice in choices:
            choice.drop_generated()
    await reply.texts.fill([lp for c in choices for lp in [*c.logprobs, *(c.prompt_logprobs or [])]])
    return reply.whole(choices)


async def _events(
    gateway: Gateway,
    reply: Reply,
    include_usage: bool,
    first: tuple,
    rest: AsyncIterator,
    endpoint: str,
    names: dict[str, str],
) -> AsyncIterator[str]:
    """Server-sent events: the bodies of each chunk, the usage chunk when asked for, then `data: [DONE]`."""
    outcome = "disconnected"  # unless the loop below ends
    try:
        item = first
        while item is not None:
            index, chunk = item
            if chunk.finish_reason == "abort":
                outcome = "server_error"
                yield _event(generation_cut().body())
                return
            await reply.texts.fill(chunk.logprobs or [])
            for body in reply.chunks(index, chunk):
                yield _event(body)
            item = await anext(rest, None)
        if include_usage:
            yield _event(reply.usage_chunk())
        yield "data: [DONE]\n\n"
        outcome = "success"
    except KvdError as e:
        outcome = "server_error"
        yield _event(from_kvd_error(e, names).body())
    finally:
        await rest.aclose()
        gateway.metrics.request_done(endpoint, outcome)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

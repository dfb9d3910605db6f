"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvd.gateway.choices import ClientDisconnected, collect, merged, open_streams, unless_disconnected
from kvd.gateway.errors import ApiError, from_kvd_error, install_handlers
from kvd.gateway.logprobs import TokenTexts
from kvd.gateway.metrics import GatewayMetrics
from kvd.gateway.responses import Reply
from kvd.gateway.schemas import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from kvd_client import AsyncClient, KvdError

logger = logging.getLogger("kvd.gateway")

CUT_MESSAGE = "the kvd daemon stopped before the generation finished; retry once it is back"


@dataclass
class Gateway:
    """What the routes share: one connection to the daemon, the metrics, the daemon's `info`."""

    client: AsyncClient
    metrics: GatewayMetrics
    texts: TokenTexts
    served_model_name: str | None
    info: dict | None = None
    started: int = 0

    async def model_info(self) -> dict:
        if self.info is None:  # asked lazily: the gateway may start before the daemon
            self.info = await self.client.info()
        return self.info

    async def model_name(self) -> str:
        return self.served_model_name or (await self.model_info())["model"]


def create_app(
    endpoint: str | None = None, served_model_name: str | None = None, timeout: float = 30.0
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncClient(endpoint, timeout=timeout)
        app.state.gateway = Gateway(
            client, GatewayMetrics(), TokenTexts(client), served_model_name, started=int(time.time())
        )
        try:
            yield
        finally:
            client.close()

    app = FastAPI(title="kvd", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            status = (await _gateway(request).client.health())["status"]
        except KvdError as e:
            return JSONResponse({"status": "unavailable", "message": str(e)}, status_code=503)
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway = _gateway(request)
        try:
            stats = await gateway.client.stats()
        except KvdError:
            stats = None  # kvd_daemon_up 0; the gateway's own metrics still count
        return Response(gateway.metrics.exposition(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway = _gateway(request)
        info = await gateway.model_info()
        card = {
            "id": await gateway.model_name(),
            "object": "model",
            "created": gateway.started,
            "owned_by": "kvd",
            "max_model_len": info["max_model_len"],
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _generate(request, body, "generate", body.prompt, max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        # Like OpenAI's chat API: without a limit, the reply may run to the end of the context.
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _generate(request, body, "chat", body.conversation(), max_tokens)

    return app


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def _generate(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    op: str,
    payload: object,
    max_tokens: int | None,
) -> Response:
    gateway = _gateway(request)
    endpoint = request.url.path
    try:
        name = await gateway.model_name()
        if body.model != name:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; GET /v1/models lists {name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        max_tokens = max_tokens or (await gateway.model_info())["max_model_len"]
        fields = [body.sampling_fields(max_tokens, i) for i in range(body.n)]
        reply = Reply(name, op == "chat", body.num_logprobs is not None, gateway.texts)
        streams = open_streams(gateway.client, op, payload, fields)
        if body.stream:
            # Send the first chunk's errors (a bad field, an overloaded daemon) as an HTTP error, not a stream.
            chunks = merged(streams, gateway.metrics)
            first = await anext(chunks)
            return StreamingResponse(
                _events(gateway, reply, body.include_usage, body.n, first, chunks, endpoint),
                media_type="text/event-stream",
            )
        choices = await unless_disconnected(request, collect(merged(streams, gateway.metrics), body.n))
        if any(c.finish_reason == "abort" for c in choices):
            raise ApiError(503, CUT_MESSAGE, "server_error", code="generation_cut")
        await gateway.texts.fill([lp for c in choices for lp in c.logprobs])
        result = reply.whole(choices)
    except ClientDisconnected:
        gateway.metrics.request_done(endpoint, "disconnected")
        return Response(status_code=499)
    except (ApiError, KvdError) as e:
        error = e if isinstance(e, ApiError) else from_kvd_error(e)
        gateway.metrics.request_done(endpoint, "client_error" if error.status < 500 else "server_error")
        raise error from None
    gateway.metrics.request_done(endpoint, "success")
    return JSONResponse(result)


async def _events(
    gateway: Gateway,
    reply: Reply,
    include_usage: bool,
    n: int,
    first: tuple,
    rest: AsyncIterator,
    endpoint: str,
) -> AsyncIterator[str]:
    """Server-sent events: one per chunk, the usage chunk when asked for, then `data: [DONE]`."""
    usages = {}
    outcome = "disconnected"  # unless the loop below ends
    try:
        item = first
        while item is not None:
            index, chunk = item
            if chunk.finish_reason == "abort":
                outcome = "server_error"
                yield _event(ApiError(503, CUT_MESSAGE, "server_error", code="generation_cut").body())
                return
            await gateway.texts.fill(chunk.logprobs or [])
            yield _event(reply.chunk(index, chunk))
            if chunk.finished:
                usages[index] = chunk.usage
            item = await anext(rest, None)
        if include_usage:
            yield _event(reply.usage_chunk([usages[i] for i in range(n)]))
        yield "data: [DONE]\n\n"
        outcome = "success"
    except KvdError as e:
        outcome = "server_error"
        yield _event(from_kvd_error(e).body())
    finally:
        await rest.aclose()
        gateway.metrics.request_done(endpoint, outcome)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

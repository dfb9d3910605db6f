"""Ollama's API on the same app: /api/chat and /api/generate (NDJSON streams), /api/embed, /api/embeddings,
/api/tags, /api/show, /api/ps and /api/version."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvd.gateway.choices import Choice, Job, arguments_object, merged, unless_disconnected
from kvd.gateway.errors import ApiError, from_kvd_error, generation_cut, invalid_fields
from kvd.gateway.logprobs import TokenTexts
from kvd.gateway.ollama_schemas import (
    PARAM_NAMES,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
)
from kvd.gateway.outcome import answer
from kvd.gateway.schemas import Strict
from kvd.gateway.state import Gateway, ServedModel, gateway_of
from kvd.settings import parse_duration
from kvd_client import Chunk, KvdError, TokenLogprob, ToolCall

# The Ollama release whose API shapes these routes follow (tool call ids, tool_name, embed dimensions): what
# /api/version reports as `version`, which Ollama's clients compare with the release they need.
OLLAMA_VERSION = "0.12.0"
# The installed kvd's (the daemon's too: one install), read without importing kvd and what it imports.
KVD_VERSION = importlib.metadata.version("kvd")
TAG = ":latest"  # Ollama's default tag: "model" and "model:latest" name the same model

router = APIRouter(prefix="/api")


@router.get("/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION, "kvd_version": KVD_VERSION}


@router.get("/tags")
async def tags(request: Request) -> dict:
    gateway = gateway_of(request)
    return {"models": [_model_card(gateway, m) for m in await gateway.models(request)]}


@router.get("/ps")
async def ps(request: Request) -> dict:
    """The models loaded now; each stays loaded until its keep-alive passes idle (kvd's list knows no date)."""
    gateway = gateway_of(request)
    loaded = [m for m in await gateway.models(request) if m.info]
    running = {"expires_at": "2999-12-31T23:59:59Z", "size_vram": 0}
    return {
        "models": [
            {**_model_card(gateway, m), **running, "context_length": m.info["max_model_len"]} for m in loaded
        ]
    }


class ShowRequest(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None


@router.post("/show")
async def show(body: ShowRequest, request: Request) -> dict:
    gateway = gateway_of(request)
    model = await _check_model(request, gateway, body.model or body.name or "")
    info = model.info
    card = _model_card(gateway, model)
    model_info = {
        "general.architecture": "llama",
        "llama.context_length": info.get("max_model_len"),
        "llama.embedding_length": info.get("hidden_size"),
    }
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": card["details"],
        "model_info": model_info,
        "capabilities": [
            "completion",
            "tools",
            "embedding",
            *(["thinking"] if info.get("reasoning") else []),
        ],
        "modified_at": card["modified_at"],
    }


@router.post("/chat")
async def chat(body: ChatRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    model = await _check(request, gateway, body)
    if not body.messages:  # Ollama's way to load a model (or, with keep_alive 0, to unload it)
        return JSONResponse(
            await _load(gateway, model, body, {"message": {"role": "assistant", "content": ""}})
        )
    fields = body.daemon_fields(model.context_tokens)
    job = (body.conversation(), {**fields, **body.reasoning_fields()})
    return await _generate(request, model, body, "chat", job)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    model = await _check(request, gateway, body)
    if not body.prompt:
        return JSONResponse(await _load(gateway, model, body, {"response": ""}))
    fields = body.daemon_fields(model.context_tokens)
    if body.raw:
        return await _generate(request, model, body, "generate", (body.prompt, fields))
    job = (body.conversation(), {**fields, **body.reasoning_fields()})
    return await _generate(request, model, body, "chat", job)


@router.post("/embed")
async def embed(body: EmbedRequest, request: Request) -> dict:
    gateway = gateway_of(request)
    model = await _check_model(request, gateway, body.model)
    if body.input == []:
        raise invalid_fields([("input", "at least one input")])
    started = time.monotonic_ns()
    try:
        out = await gateway.embed(request, model, body.input, body.dimensions)
    except KvdError as e:
        raise from_kvd_error(e) from None
    return {
        "model": body.model,
        "embeddings": out.embeddings,
        "total_duration": time.monotonic_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": out.prompt_tokens,
    }


@router.post("/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> dict:
    gateway = gateway_of(request)
    model = await _check_model(request, gateway, body.model)
    try:
        out = await gateway.embed(request, model, [body.prompt])
    except KvdError as e:
        raise from_kvd_error(e, {"input": "prompt"}) from None
    return {"embedding": out.embeddings[0]}


async def _check_model(request: Request, gateway: Gateway, model: str) -> ServedModel:
    try:
        return await gateway.check_model(request, model, also=(TAG,))
    except ApiError as e:
        raise ApiError(404, f"model {model!r} not found", e.type, "model", e.code) from None


async def _check(request: Request, gateway: Gateway, body: ChatRequest | GenerateRequest) -> ServedModel:
    model = await _check_model(request, gateway, body.model)
    refused = body.refusals()
    if refused:
        raise invalid_fields(refused)
    return model


def _model_card(gateway: Gateway, model: ServedModel) -> dict:
    name, info = model.shown, model.info
    tagged = name if ":" in name else name + TAG
    # A model not loaded yet is known by name alone.
    quantization, dtype = info.get("quantization", "none"), info.get("dtype", "")
    details = {
        "parent_model": "",
        "format": "" if not info else "gguf" if quantization != "none" else "safetensors",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "",
        "quantization_level": quantization.upper() if quantization != "none" else dtype.upper(),
    }
    return {
        "name": tagged,
        "model": tagged,
        "modified_at": _timestamp(gateway.started),
        "size": info.get("weight_bytes", 0) + info.get("kv_cache_bytes", 0),  # what it holds loaded (0: not)
        "digest": hashlib.sha256(name.encode()).hexdigest(),
        "details": details,
    }


def _timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama's created_at."""
    moment = datetime.now(timezone.utc) if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def _load(
    gateway: Gateway, model: ServedModel, body: ChatRequest | GenerateRequest, content: dict
) -> dict:
    """Ollama's load: the model loaded (its keep_alive set), or with keep_alive 0 unloaded."""
    try:
        if body.keep_alive is not None and parse_duration(body.keep_alive) == 0:
            await gateway.client.unload(model.name)
            reason = "unload"
        else:
            await gateway.client.load(model.name, body.keep_alive)
            reason = "load"
    except ValueError:
        raise invalid_fields([("keep_alive", "a duration: seconds, or like 30s, 5m, 1h")]) from None
    except KvdError as e:
        raise from_kvd_error(e, PARAM_NAMES) from None
    return {"model": body.model, "created_at": _timestamp(), **content, "done": True, "done_reason": reason}


@dataclass
class ReplyShape:
    """Ollama's bodies for one generation: chat's `message` or generate's `response`, with timings."""

    model: str
    chat: bool
    want_logprobs: bool
    texts: TokenTexts
    started: int = field(default_factory=time.monotonic_ns)
    first_token: int | None = None

    def lines(self, chunk: Chunk) -> list[dict]:
        """The NDJSON lines for one daemon chunk; the last chunk ends with the `done` line."""
        self.observe(chunk)
        lines = []
        if chunk.text or chunk.reasoning or chunk.logprobs or not chunk.finished:
            lines.append(self._body(chunk.text, [], chunk.logprobs, False, chunk.reasoning))
        if chunk.tool_calls:
            lines.append(self._body("", chunk.tool_calls, None, False))
        if chunk.finished:
            lines.append({**self._body("", [], None, True), **self._stats(chunk)})
        return lines

    def observe(self, chunk: Chunk) -> None:
        if chunk.token_ids and self.first_token is None:
            self.first_token = time.monotonic_ns()

    def whole(self, choice: Choice, final: Chunk) -> dict:
        body = self._body(choice.text, choice.tool_calls, choice.logprobs, True, choice.reasoning)
        return {**body, **self._stats(final)}

    def _body(
        self,
        text: str,
        calls: list[ToolCall],
        logprobs: list[TokenLogprob] | None,
        done: bool,
        thinking: str = "",
    ) -> dict:
        body: dict[str, Any] = {"model": self.model, "created_at": _timestamp()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [_tool_call(k, c) for k, c in enumerate(calls)]
            body["message"] = message
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        body["done"] = done
        if self.want_logprobs and logprobs:
            body["logprobs"] = [_logprob(lp, self.texts) for lp in logprobs]
        return body

    def _stats(self, final: Chunk) -> dict:
        now = time.monotonic_ns()
        first = self.first_token or now
        return {
            # Ollama reports a tool call as an ordinary stop.
            "done_reason": "stop" if final.finish_reason == "tool_calls" else final.finish_reason,
            "total_duration": now - self.started,
            "load_duration": 0,
            "prompt_eval_count": final.usage.prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": final.usage.completion_tokens,
            "eval_duration": now - first,
        }


def _tool_call(index: int, call: ToolCall) -> dict:
    return {
        "id": call.id,
        "function": {"index": index, "name": call.name, "arguments": arguments_object(call)},
    }


def _logprob(lp: TokenLogprob, texts: TokenTexts) -> dict:
    top = [{"token": texts[t], "logprob": v} for t, v in lp.top_logprobs]
    return {"token": texts[lp.token_id], "logprob": lp.logprob, "top_logprobs": top}


async def _generate(
    request: Request, model: ServedModel, body: ChatRequest | GenerateRequest, op: str, job: Job
) -> Response:
    gateway = gateway_of(request)
    return await answer(
        gateway.metrics, request.url.path, PARAM_NAMES, _reply(request, gateway, model, body, op, job)
    )


async def _reply(
    request: Request,
    gateway: Gateway,
    model: ServedModel,
    body: ChatRequest | GenerateRequest,
    op: str,
    job: Job,
) -> dict | StreamingResponse:
    """The whole reply's body, or the stream of its lines."""
    shape = ReplyShape(body.model, isinstance(body, ChatRequest), bool(body.logprobs), model.texts)
    streams = gateway.streams(request, model, op, [job])
    if body.stream:
        chunks = merged(streams, gateway.metrics)
        first = await anext(chunks)  # errors before the first token are HTTP errors
        lines = _lines(gateway, shape, first, chunks, request.url.path)
        return StreamingResponse(lines, media_type="application/x-ndjson")

    async def collect() -> Choice:
        choice = Choice(0)
        async for _, chunk in merged(streams, gateway.metrics):
            shape.observe(chunk)
            choice.add(chunk)
        return choice

    choice = await unless_disconnected(request, collect())
    if choice.finish_reason == "abort":
        raise generation_cut()
    await shape.texts.fill(choice.logprobs)
    final = Chunk(choice.index, "", [], finish_reason=choice.finish_reason, usage=choice.usage)
    return shape.whole(choice, final)


async def _lines(
    gateway: Gateway, shape: ReplyShape, first: tuple, rest: AsyncIterator, endpoint: str
) -> AsyncIterator[str]:
    outcome = "disconnected"  # unless the loop below ends
    try:
        item = first
        while item is not None:
            _, chunk = item
            if chunk.finish_reason == "abort":
                outcome = "server_error"
                yield _line({"error": generation_cut().message})
                return
            await shape.texts.fill(chunk.logprobs or [])
            for line in shape.lines(chunk):
                yield _line(line)
            item = await anext(rest, None)
        outcome = "success"
    except KvdError as e:
        outcome = "server_error"
        yield _line({"error": from_kvd_error(e, PARAM_NAMES).message})
    finally:
        await rest.aclose()
        gateway.metrics.request_done(endpoint, outcome)


def _line(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"

"""Anthropic's Messages API on the same app: POST /v1/messages (whole or as Anthropic's server-sent events) and
/v1/messages/count_tokens; errors in Anthropic's shape (kvd.gateway.errors)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvd.gateway.anthropic_schemas import PARAM_NAMES, CountTokensRequest, MessagesRequest
from kvd.gateway.choices import Choice, arguments_object, merged, prompt_fields, unless_disconnected
from kvd.gateway.errors import anthropic_error, from_kvd_error, generation_cut, invalid_fields
from kvd.gateway.outcome import answer
from kvd.gateway.state import Gateway, ServedModel, gateway_of
from kvd_client import KvdError, ToolCall

# The daemon's finish reasons as Anthropic's stop reasons ("stop" with a stop string: stop_sequence).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

router = APIRouter(prefix="/v1/messages")


@router.post("")
async def messages(body: MessagesRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    return await answer(gateway.metrics, request.url.path, PARAM_NAMES, _reply(request, gateway, body))


@router.post("/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    gateway = gateway_of(request)
    model = await _check(request, gateway, body)
    fields = prompt_fields({**body.daemon_tools(), **body.reasoning_fields()})
    try:
        ids = await gateway.client.tokenize(messages=body.conversation(), **fields, model=model.name)
    except KvdError as e:
        raise from_kvd_error(e, PARAM_NAMES) from None
    return {"input_tokens": len(ids)}


async def _check(
    request: Request, gateway: Gateway, body: MessagesRequest | CountTokensRequest
) -> ServedModel:
    model = await gateway.check_model(request, body.model)
    refused = body.refusals()
    if refused:
        raise invalid_fields(refused)
    return model


async def _reply(request: Request, gateway: Gateway, body: MessagesRequest) -> dict | StreamingResponse:
    model = await _check(request, gateway, body)
    messages = body.conversation()
    shape = ReplyShape(body.model, body.thinking is None or body.thinking.display != "omitted")
    job = (messages, body.daemon_fields())
    # A stream's message_start gives the prompt's size first (tokenize lists tools as chat does); asked before the
    # generation starts, so that nothing runs on if it fails.
    prompt = (
        await gateway.client.tokenize(messages=messages, **prompt_fields(job[1]), model=model.name)
        if body.stream
        else []
    )
    streams = gateway.streams(request, model, "chat", [job], body.user)
    chunks = merged(streams, gateway.metrics)
    if body.stream:
        first = await anext(chunks)  # errors before the first token are HTTP errors
        events = _events(gateway, shape, len(prompt), first, chunks, request.url.path)
        return StreamingResponse(events, media_type="text/event-stream")

    async def collect() -> Choice:
        choice = Choice(0)
        async for _, chunk in chunks:
            choice.add(chunk)
        return choice

    choice = await unless_disconnected(request, collect())
    if choice.finish_reason == "abort":
        raise generation_cut()
    return shape.whole(choice)


@dataclass
class ReplyShape:
    """Anthropic's bodies for one generation: the whole message, or its stream's events."""

    model: str
    show_thinking: bool = True  # thinking.display "omitted": thinking blocks go out empty
    id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")
    open_block: int | None = None  # the index of the block being streamed
    open_kind: str = ""  # its type: "thinking" or "text"
    blocks: int = 0  # content blocks started so far

    def message(self, content: list[dict], stop: dict, usage: dict) -> dict:
        body = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
        }
        return {**body, **stop, "usage": usage}

    def whole(self, choice: Choice) -> dict:
        content = [_thinking(self._shown(choice.reasoning))] if choice.reasoning else []
        if choice.text or not choice.tool_calls:
            content.append({"type": "text", "text": choice.text})
        content += [_tool_use(call) for call in choice.tool_calls]
        return self.message(content, _stop(choice), _usage(choice))

    def start(self, input_tokens: int) -> list[tuple[str, dict]]:
        body = self.message(
            [],
            {"stop_reason": None, "stop_sequence": None},
            {"input_tokens": input_tokens, "output_tokens": 0},
        )
        return [("message_start", {"type": "message_start", "message": body}), ("ping", {"type": "ping"})]

    def text(self, text: str, kind: str = "text") -> list[tuple[str, dict]]:
        """The events of a piece of the answer's text, or of its thinking (`kind` "thinking")."""
        events = []
        if self.open_kind != kind:
            events += self._close()
            self.open_block, self.open_kind, self.blocks = self.blocks, kind, self.blocks + 1
            block = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append(("content_block_start", _block_start(self.open_block, block)))
        if kind == "thinking":
            text = self._shown(text)
        if text or kind == "text":
            delta = {"type": f"{kind}_delta", kind: text}
            events.append(("content_block_delta", _delta(self.open_block, delta)))
        return events

    def _close(self) -> list[tuple[str, dict]]:
        if self.open_block is None:
            return []
        index, self.open_block, self.open_kind = self.open_block, None, ""
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _shown(self, thinking: str) -> str:
        return thinking if self.show_thinking else ""

    def finish(self, choice: Choice) -> list[tuple[str, dict]]:
        """The last events: the open block closed, each tool use as a block of its own, the stop reason."""
        events = []
        if self.open_kind != "text" and not choice.text and not choice.tool_calls:
            events += self.text("")  # a reply with no text still has its text block
        events += self._close()
        for call in choice.tool_calls:
            index, self.blocks = self.blocks, self.blocks + 1
            use = _tool_use(call)
            events.append(("content_block_start", _block_start(index, {**use, "input": {}})))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
            events.append(("content_block_delta", _delta(index, delta)))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(
            ("message_delta", {"type": "message_delta", "delta": _stop(choice), "usage": _usage(choice)})
        )
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def _stop(choice: Choice) -> dict:
    if choice.stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_string}
    return {"stop_reason": STOP_REASONS.get(choice.finish_reason, "end_turn"), "stop_sequence": None}


def _usage(choice: Choice) -> dict:
    return {"input_tokens": choice.usage.prompt_tokens, "output_tokens": choice.usage.completion_tokens}


def _block_start(index: int, block: dict) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _thinking(text: str) -> dict[str, Any]:
    # The signature lets Anthropic check a thinking block sent back; kvd drops earlier turns' thinking instead.
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call)}


async def _events(
    gateway: Gateway, shape: ReplyShape, input_tokens: int, first: tuple, rest: AsyncIterator, endpoint: str
) -> AsyncIterator[str]:
    outcome = "disconnected"  # unless the loop below ends
    choice = Choice(0)
    try:
        for event in shape.start(input_tokens):
            yield _event(*event)
        item = first
        while item is not None:
            _, chunk = item
            if chunk.finish_reason == "abort":
                outcome = "server_error"
                yield _event("error", anthropic_error(generation_cut()))
                return
            choice.add(chunk)
            if chunk.reasoning:
                for event in shape.text(chunk.reasoning, "thinking"):
                    yield _event(*event)
            if chunk.text:
                for event in shape.text(chunk.text):
                    yield _event(*event)
            item = await anext(rest, None)
        for event in shape.finish(choice):
            yield _event(*event)
        outcome = "success"
    except KvdError as e:
        outcome = "server_error"
        yield _event("error", anthropic_error(from_kvd_error(e, PARAM_NAMES)))
    finally:
        await rest.aclose()
        gateway.metrics.request_done(endpoint, outcome)


def _event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

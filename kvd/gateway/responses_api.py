"""OpenAI's Responses API on the same app: POST /v1/responses (whole, or as the Responses server-sent events),
GET and DELETE /v1/responses/{id} for the responses kept (kvd.gateway.response_store); errors in OpenAI's shape."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvd.gateway.auth import caller_of
from kvd.gateway.choices import Choice, collect, merged, unless_disconnected
from kvd.gateway.errors import ApiError, from_kvd_error, generation_cut, invalid_fields
from kvd.gateway.outcome import answer
from kvd.gateway.response_store import TTL_S
from kvd.gateway.responses_schemas import PARAM_NAMES, ResponsesRequest
from kvd.gateway.state import Gateway, gateway_of
from kvd_client import KvdError, ToolCall

router = APIRouter(prefix="/v1/responses")


@router.post("")
async def create(body: ResponsesRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    return await answer(gateway.metrics, request.url.path, PARAM_NAMES, _reply(request, gateway, body))


@router.get("/{response_id}")
async def retrieve(response_id: str, request: Request) -> dict:
    return _stored(request, response_id, "response_id").body


@router.delete("/{response_id}")
async def delete(response_id: str, request: Request) -> dict:
    _stored(request, response_id, "response_id")
    gateway_of(request).responses.delete(caller_of(request), response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _stored(request: Request, response_id: str, param: str):
    stored = gateway_of(request).responses.get(caller_of(request), response_id)
    if stored is None:
        message = (
            f"no response {response_id!r}: kvd keeps a stored response {TTL_S / 60:g} minutes, in memory, for "
            "the caller that created it"
        )
        raise ApiError(404, message, "invalid_request_error", param, "not_found")
    return stored


async def _reply(request: Request, gateway: Gateway, body: ResponsesRequest) -> dict | StreamingResponse:
    model = await gateway.check_model(request, body.model)
    refused = body.refusals()
    if refused:
        raise invalid_fields(refused)
    history = []
    if body.previous_response_id is not None:
        history = _stored(request, body.previous_response_id, "previous_response_id").turns
    turns = body.turns(history)
    fields = body.daemon_fields(model.context_tokens)
    shape = ResponseShape(model.shown, body)
    job = (body.conversation(turns), fields)
    chunks = merged(
        gateway.streams(request, model, "chat", [job], body.user or body.safety_identifier), gateway.metrics
    )

    def keep(response: dict, choice: Choice) -> None:
        if body.store:
            gateway.responses.put(caller_of(request), response, [*turns, _assistant_turn(choice)])

    if body.stream:
        first = await anext(chunks)  # errors before the first token are HTTP errors
        events = _events(gateway, shape, first, chunks, request.url.path, keep)
        return StreamingResponse(events, media_type="text/event-stream")
    (choice,) = await unless_disconnected(request, collect(chunks, 1))
    if choice.finish_reason == "abort":
        raise generation_cut()
    response = shape.whole(choice)
    keep(response, choice)
    return response


def _assistant_turn(choice: Choice) -> dict[str, Any]:
    """The reply as the next response's history holds it (its reasoning left out, as templates drop it)."""
    if not choice.tool_calls:
        return {"role": "assistant", "content": choice.text}
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in choice.tool_calls
    ]
    return {"role": "assistant", "content": choice.text or None, "tool_calls": calls}


@dataclass
class ResponseShape:
    """The response object for one generation, and its stream's events (whose items carry the same ids)."""

    model: str
    request: ResponsesRequest
    id: str = field(default_factory=lambda: f"resp_{secrets.token_hex(12)}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    ids: dict[str, str] = field(default_factory=dict)  # each output item's id, by its place
    sequence: int = 0
    open_kind: str = ""  # the item being streamed: "reasoning" or "message"
    streamed: dict[str, str] = field(default_factory=dict)  # the text streamed so far, by kind

    def whole(self, choice: Choice) -> dict:
        incomplete = choice.finish_reason == "length"
        output = []
        if choice.reasoning:
            output.append(self._reasoning(choice.reasoning, "completed"))
        if choice.text or not choice.tool_calls:
            output.append(self._message(choice.text, "incomplete" if incomplete else "completed"))
        output += [self._call(k, call) for k, call in enumerate(choice.tool_calls)]
        body = self._object("incomplete" if incomplete else "completed", output)
        body["usage"] = _usage(choice)
        body["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        return body

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self._object("in_progress", [])),
            self._event("response.in_progress", response=self._object("in_progress", [])),
        ]

    def text(self, kind: str, text: str) -> list[dict]:
        """The events of a piece of the reasoning (`kind` "reasoning") or of the answer ("message")."""
        events = []
        if self.open_kind != kind:
            events += self._close()
            events += self._open(kind)
        self.streamed[kind] = self.streamed.get(kind, "") + text
        place = self._place(kind)
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **place, content_index=0, delta=text))
        else:
            events.append(
                self._event("response.output_text.delta", **place, content_index=0, delta=text, logprobs=[])
            )
        return events

    def finish(self, choice: Choice, response: dict) -> list[dict]:
        """The last events: the open item closed, the tool calls, then the whole response."""
        events = []
        if self.open_kind != "message" and not choice.text and not choice.tool_calls:
            events += self.text("message", "")  # a reply with no text still has its message
        events += self._close(choice.finish_reason == "length")
        for k, call in enumerate(choice.tool_calls):
            item = self._call(k, call)
            place = {"output_index": self._index(f"call{k}"), "item_id": item["id"]}
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=place["output_index"],
                    item={**item, "arguments": "", "status": "in_progress"},
                )
            )
            events.append(
                self._event("response.function_call_arguments.delta", **place, delta=call.arguments)
            )
            events.append(
                self._event("response.function_call_arguments.done", **place, arguments=call.arguments)
            )
            events.append(
                self._event("response.output_item.done", output_index=place["output_index"], item=item)
            )
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events

    def error(self, error: ApiError) -> dict:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _open(self, kind: str) -> list[dict]:
        self.open_kind = kind
        item = self._reasoning("", "in_progress") if kind == "reasoning" else self._message("", "in_progress")
        item["content"] = []
        place = self._place(kind)
        return [
            self._event("response.output_item.added", output_index=place["output_index"], item=item),
            self._event("response.content_part.added", **place, content_index=0, part=_part(kind, "")),
        ]

    def _close(self, incomplete: bool = False) -> list[dict]:
        kind, self.open_kind = self.open_kind, ""
        if not kind:
            return []
        text, place = self.streamed.get(kind, ""), self._place(kind)
        if kind == "reasoning":
            item = self._reasoning(text, "completed")
            done = self._event("response.reasoning_text.done", **place, content_index=0, text=text)
        else:
            item = self._message(text, "incomplete" if incomplete else "completed")
            done = self._event("response.output_text.done", **place, content_index=0, text=text, logprobs=[])
        return [
            done,
            self._event("response.content_part.done", **place, content_index=0, part=_part(kind, text)),
            self._event("response.output_item.done", output_index=place["output_index"], item=item),
        ]

    def _reasoning(self, text: str, status: str) -> dict:
        content = [_part("reasoning", text)]
        return {
            "type": "reasoning",
            "id": self._id("reasoning", "rs"),
            "summary": [],
            "content": content,
            "status": status,
        }

    def _message(self, text: str, status: str) -> dict:
        return {
            "type": "message",
            "id": self._id("message", "msg"),
            "status": status,
            "role": "assistant",
            "content": [_part("message", text)],
        }

    def _call(self, k: int, call: ToolCall) -> dict:
        return {
            "type": "function_call",
            "id": self._id(f"call{k}", "fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }

    def _id(self, place: str, prefix: str) -> str:
        return self.ids.setdefault(place, f"{prefix}_{secrets.token_hex(12)}")

    def _index(self, place: str) -> int:
        """An item's index in the output: items are numbered as they are first made."""
        self._id(place, "")
        return list(self.ids).index(place)

    def _place(self, kind: str) -> dict:
        item_id = self._id(kind, "rs" if kind == "reasoning" else "msg")
        return {"output_index": self._index(kind), "item_id": item_id}

    def _event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _object(self, status: str, output: list[dict]) -> dict:
        r = self.request
        tool_choice = r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump") else r.tool_choice
        text_format = (
            r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else None
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tool_choice": tool_choice or "auto",
            "tools": r.tools or [],
            "temperature": r.temperature,
            "top_p": r.top_p,
            "reasoning": r.reasoning.model_dump() if r.reasoning else {"effort": None, "summary": None},
            "text": {"format": text_format or {"type": "text"}},
            "store": r.store,
            "truncation": r.truncation or "disabled",
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": None,
            "incomplete_details": None,
            "error": None,
        }


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(choice: Choice) -> dict:
    usage = choice.usage
    return {
        "input_tokens": usage.prompt_tokens,
        # kvd's prefix cache keeps every prompt block it computes: the tokens not read from it are written.
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


async def _events(
    gateway: Gateway, shape: ResponseShape, first: tuple, rest: AsyncIterator, endpoint: str, keep
) -> AsyncIterator[str]:
    outcome = "disconnected"  # unless the loop below ends
    choice = Choice(0)
    try:
        for event in shape.start():
            yield _event(event)
        item = first
        while item is not None:
            _, chunk = item
            if chunk.finish_reason == "abort":
                outcome = "server_error"
                yield _event(shape.error(generation_cut()))
                return
            choice.add(chunk)
            for kind, text in (("reasoning", chunk.reasoning), ("message", chunk.text)):
                if text:
                    for event in shape.text(kind, text):
                        yield _event(event)
            item = await anext(rest, None)
        response = shape.whole(choice)
        keep(response, choice)
        for event in shape.finish(choice, response):
            yield _event(event)
        outcome = "success"
    except KvdError as e:
        outcome = "server_error"
        yield _event(shape.error(from_kvd_error(e, PARAM_NAMES)))
    finally:
        await rest.aclose()
        gateway.metrics.request_done(endpoint, outcome)


def _event(body: dict) -> str:
    return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

"""Running the n choices of one HTTP request as n streamed kvd requests, merged in arrival order."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kvd.gateway.metrics import GatewayMetrics
from kvd_client import AsyncClient, AsyncStream, Chunk, DaemonError, TokenLogprob, ToolCall, Usage

# One daemon request: its prompt (text, token ids, or messages) and its other fields.
Job = tuple[Any, dict[str, Any]]
# (choice index, a field of that choice's daemon request) -> the field as the HTTP request names it.
FieldOf = Callable[[int, str], str]


class ClientDisconnected(Exception):
    """The HTTP client went away before its reply was complete; its kvd requests were aborted."""


@dataclass
class Choice:
    """One choice's output, accumulated from its chunks."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_string: str | None = None
    reasoning: str = ""  # a reasoning model's thinking section

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
            self.tool_calls = chunk.tool_calls
            self.prompt_logprobs = chunk.prompt_logprobs
            self.stop_string = chunk.stop_string

    def drop_generated(self) -> None:
        """Forget the output (the one token asked for so that the daemon scores the prompt)."""
        self.text, self.reasoning, self.token_ids, self.logprobs = (
            "",
            "",
            [],
            [],
        )  # no completion token counted
        self.finish_reason = "length"


def arguments_object(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as the object the daemon wrote (its calls are JSON objects; {} only guards a broken
    reply), for the APIs that send arguments as an object (Ollama's, Anthropic's)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def prompt_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """What of a chat's daemon fields its prompt depends on, as tokenize's keywords (so a count is exact)."""
    return {name: fields.get(name) for name in ("tools", "think", "reasoning_effort")}


def open_streams(client: AsyncClient, op: str, jobs: Sequence[Job]) -> list[AsyncStream]:
    """One stream per choice; the daemon always streams, so latency is measured for every request."""
    if op == "chat":
        return [client.stream_chat(payload, **fields) for payload, fields in jobs]
    return [client.stream(payload, **fields) for payload, fields in jobs]


async def merged(
    streams: list[AsyncStream], metrics: GatewayMetrics, field_of: FieldOf | None = None
) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) as they arrive; leaving early (error, cancellation) aborts every stream. A daemon
    error names its field by `field_of`."""
    queue: asyncio.Queue[tuple[int, Chunk | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncStream) -> None:
        started = last = time.monotonic()
        try:
            async for chunk in stream:
                now = time.monotonic()
                if chunk.token_ids:
                    metrics.observe_tokens(now - started, now - last, len(chunk.token_ids), last == started)
                    last = now
                if chunk.finished:
                    metrics.observe_usage(chunk.usage)
                await queue.put((index, chunk))
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        unfinished = len(streams)
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, DaemonError) and field_of is not None:
                raise _renamed(item, field_of(index, item.field or ""))
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                unfinished -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def _renamed(error: DaemonError, field: str) -> DaemonError:
    """`error` naming `field`: the daemon names a field of its one request, and one HTTP request may hold
    several (a list of prompts). The message says which, as the whole request names it."""
    if not field or field == error.field:
        return error
    renamed = type(error)(f"{field}: {error.message}", field, error.request_id)
    renamed.code = error.code  # a code this client does not know is kept on the instance
    return renamed


async def collect(chunks: AsyncIterator[tuple[int, Chunk]], n: int) -> list[Choice]:
    choices = [Choice(i) for i in range(n)]
    async for index, chunk in chunks:
        choices[index].add(chunk)
    return choices


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`; if the HTTP client disconnects first, cancel it (which aborts its generations)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it abort its streams before the reply is given up
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body is read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""The asyncio client: the same surface as Client, for many concurrent requests from one event loop."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvd_client.client import DEFAULT_TIMEOUT_S
from kvd_client.endpoint import resolve_endpoint
from kvd_client.errors import ClosedError, DaemonError, KvdError, KvdTimeoutError, NotFoundError
from kvd_client.messages import (
    Chunk,
    Completion,
    Embeddings,
    Message,
    RequestId,
    chat_fields,
    embed_fields,
    pack_request,
    prompt_fields,
    to_chunk,
    to_completion,
    to_embeddings,
    to_result,
    tokenize_fields,
    unpack_reply,
)


class AsyncClient:
    """A connection to the kvd daemon for asyncio code.

    Any number of tasks of one event loop may share an AsyncClient: a reader task routes each reply to the
    call waiting for its id. Use it from one event loop only, and (like Client) not across fork. `timeout`
    bounds how long a call waits while the daemon says nothing (it sends heartbeats while requests are in
    flight).
    """

    def __init__(self, endpoint: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.endpoint = resolve_endpoint(endpoint)
        if not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = timeout
        self._pid = os.getpid()
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, self.endpoint.is_ipv6)
        self._socket.connect(self.endpoint.url)
        self._ids = itertools.count(1)
        self._inbox: dict[RequestId, asyncio.Queue[dict | BaseException]] = {}
        self._reader: asyncio.Task | None = None
        self._last_heard = 0.0

    async def generate(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        return await self._complete("generate", prompt_fields(prompt, params))

    def stream(self, prompt: str | Sequence[int], **params: Any) -> AsyncStream:
        """`async for chunk in client.stream(...)`; the request is sent at the first iteration."""
        return AsyncStream(self, "generate", {**prompt_fields(prompt, params), "stream": True})

    async def chat(self, messages: Sequence[Message], **params: Any) -> Completion:
        return await self._complete("chat", chat_fields(messages, params))

    def stream_chat(self, messages: Sequence[Message], **params: Any) -> AsyncStream:
        return AsyncStream(self, "chat", {**chat_fields(messages, params), "stream": True})

    async def embed(
        self,
        input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        dimensions: int | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
    ) -> Embeddings:
        return to_embeddings(
            await self._call_reply("embed", {**embed_fields(input, dimensions, cache_salt), "model": model})
        )

    async def tokenize(
        self,
        text: str | None = None,
        messages: Sequence[Message] | None = None,
        tools: Sequence[dict] | None = None,
        think: bool | None = None,
        reasoning_effort: str | None = None,
        model: str | None = None,
    ) -> list[int]:
        """Token ids of `text` as a prompt, or of `messages` with the chat template applied (listing `tools`,
        with `think` and `reasoning_effort`, as chat does)."""
        fields = {**tokenize_fields(text, messages, tools, think, reasoning_effort), "model": model}
        return (await self._call("tokenize", fields))["token_ids"]

    async def detokenize(self, token_ids: Sequence[int], model: str | None = None) -> str:
        return (await self._call("detokenize", {"token_ids": list(token_ids), "model": model}))["text"]

    async def abort(self, request_id: RequestId) -> bool:
        try:
            await self._call("abort", {"target": request_id})
        except NotFoundError:
            return False
        return True

    async def health(self) -> dict:
        return await self._call("health", {})

    async def info(self, model: str | None = None) -> dict:
        """The model's (the daemon's only one, without a name), the daemon's limits and its `models`."""
        return await self._call("info", {"model": model})

    async def list_models(self) -> list[dict]:
        """The models the daemon serves, each {"name", "loaded", "max_model_len", "info"}."""
        return (await self._call("list_models", {}))["models"]

    async def load(self, model: str, keep_alive: float | str | None = None) -> dict:
        """Load `model` (answered once it is loaded); `keep_alive`: how long it then stays loaded idle (seconds
        or "5m"; negative: for good)."""
        return await self._call("load", {"model": model, "keep_alive": keep_alive})

    async def unload(self, model: str) -> bool:
        """Unload `model` now if nothing is in flight for it (True), else as soon as nothing is (False)."""
        return (await self._call("unload", {"model": model}))["unloaded"]

    async def stats(self, model: str | None = None) -> dict:
        return await self._call("stats", {"model": model})

    @property
    def in_flight(self) -> int:
        """Requests sent and not finished yet."""
        return len(self._inbox)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for queue in self._inbox.values():
            queue.put_nowait(ClosedError("the AsyncClient was closed"))
        if not self._socket.closed:
            self._socket.close(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _complete(self, op: str, fields: dict[str, Any]) -> Completion:
        rid = self._register()
        try:
            await self._send(op, rid, fields)
            return to_completion(await self._next(rid))
        except DaemonError:
            raise
        except BaseException:
            self._abort_quietly(rid)  # timed out or cancelled: stop the generation
            raise
        finally:
            self._finish(rid)

    async def _call(self, op: str, fields: dict[str, Any]) -> dict:
        return to_result(await self._call_reply(op, fields))

    async def _call_reply(self, op: str, fields: dict[str, Any]) -> dict:
        rid = self._register()
        try:
            await self._send(op, rid, fields)
            return await self._next(rid)
        finally:
            self._finish(rid)

    def _register(self) -> RequestId:
        if self._socket.closed:
            raise ClosedError("this AsyncClient is closed; create a new one")
        if os.getpid() != self._pid:
            raise ClosedError(
                "this AsyncClient was created in another process (before fork); create one per process"
            )
        rid = next(self._ids)
        self._inbox[rid] = asyncio.Queue()
        return rid

    async def _send(self, op: str, rid: RequestId, fields: dict[str, Any]) -> None:
        self.endpoint.check_listening("AsyncClient(endpoint=...)")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            await asyncio.wait_for(self._socket.send(pack_request(op, rid, fields)), self.timeout)
        except asyncio.TimeoutError:
            raise self._timeout_error() from None

    async def _next(self, rid: RequestId) -> dict:
        queue = self._inbox[rid]
        started = time.monotonic()
        while True:
            quiet = time.monotonic() - max(started, self._last_heard)
            if quiet >= self.timeout:
                raise self._timeout_error()
            try:
                item = await asyncio.wait_for(queue.get(), self.timeout - quiet)
            except asyncio.TimeoutError:
                continue  # heard something meanwhile (a heartbeat)? the loop decides
            if isinstance(item, BaseException):
                raise item
            return item

    async def _read(self) -> None:
        """Route every reply to the queue of its request; heartbeats only refresh the liveness clock."""
        while True:
            data = await self._socket.recv()
            self._last_heard = time.monotonic()
            try:
                reply = unpack_reply(data)
            except KvdError as e:
                for queue in self._inbox.values():
                    queue.put_nowait(e)
                continue
            queue = self._inbox.get(reply.get("id"))
            if queue is not None and reply["type"] != "heartbeat":
                queue.put_nowait(reply)

    def _abort_quietly(self, rid: RequestId) -> None:
        if self._socket.closed or os.getpid() != self._pid:
            return
        # A NOBLOCK send on an asyncio socket is attempted at once; the future only reports the outcome.
        sent = self._socket.send(pack_request("abort", next(self._ids), {"target": rid}), zmq.NOBLOCK)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _finish(self, rid: RequestId) -> None:
        self._inbox.pop(rid, None)

    def _timeout_error(self) -> KvdTimeoutError:
        return KvdTimeoutError(
            f"no reply from the kvd daemon at {self.endpoint} within {self.timeout:g} s: is `kvd serve` "
            "running there? (choose the endpoint with AsyncClient(endpoint=...) or $KVD_ENDPOINT)"
        )


class AsyncStream:
    """Chunks of one streamed generation; the last carries finish_reason and usage. Closing early aborts."""

    def __init__(self, client: AsyncClient, op: str, fields: dict[str, Any]) -> None:
        self.client = client
        self.id = client._register()
        self._op = op
        self._fields = fields
        self._sent = False
        self.done = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if self.done:
            raise StopAsyncIteration
        try:
            if not self._sent:
                self._sent = True
                await self.client._send(self._op, self.id, self._fields)
            chunk = to_chunk(await self.client._next(self.id))
        except DaemonError:
            self._end()
            raise
        except BaseException:
            self.close()
            raise
        if chunk.finished:
            self._end()
        return chunk

    def close(self) -> None:
        """Stop reading; an unfinished generation is aborted in the daemon."""
        if not self.done:
            if self._sent:
                self.client._abort_quietly(self.id)
            self._end()

    async def aclose(self) -> None:
        self.close()

    def _end(self) -> None:
        self.done = True
        self.client._finish(self.id)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

"""The blocking client: one DEALER socket to the daemon, replies demultiplexed by request id."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from kvd_client.endpoint import resolve_endpoint
from kvd_client.errors import ClosedError, DaemonError, KvdTimeoutError, NotFoundError
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

DEFAULT_TIMEOUT_S = 30.0


class Client:
    """A connection to the kvd daemon.

    `timeout` bounds how long any call waits while the daemon says nothing. The daemon sends a heartbeat
    every second to a client with requests in flight, so a long generation never times out while the daemon
    is alive, and a dead or missing daemon is reported within `timeout` seconds.

    Not thread-safe (ZeroMQ sockets are not): give each thread its own Client, or use AsyncClient. Any number
    of processes may each hold their own Client; a Client does not survive fork (create one in the child).
    Several streams of one Client may be consumed interleaved from the same thread.
    """

    def __init__(self, endpoint: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.endpoint = resolve_endpoint(endpoint)
        if not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = timeout
        self._pid = os.getpid()
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, self.endpoint.is_ipv6)
        self._socket.connect(self.endpoint.url)
        self._ids = itertools.count(1)
        self._inbox: dict[RequestId, deque[dict]] = {}
        self._last_heard = 0.0

    def generate(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        """Complete `prompt` (text or token ids); `params` are the protocol's sampling fields."""
        return self._complete("generate", prompt_fields(prompt, params))

    def stream(self, prompt: str | Sequence[int], **params: Any) -> Stream:
        """Like generate, but yields Chunks as tokens are produced; closing the Stream early aborts it."""
        return Stream(self, self._start("generate", {**prompt_fields(prompt, params), "stream": True}))

    def chat(self, messages: Sequence[Message], **params: Any) -> Completion:
        """The assistant's reply to `messages` ([{"role", "content"}]); the daemon applies the template."""
        return self._complete("chat", chat_fields(messages, params))

    def stream_chat(self, messages: Sequence[Message], **params: Any) -> Stream:
        return Stream(self, self._start("chat", {**chat_fields(messages, params), "stream": True}))

    def embed(
        self,
        input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        dimensions: int | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
    ) -> Embeddings:
        """One L2-normalised vector per input (a text, texts, one token id list, or token id lists); `dimensions`
        truncates."""
        return to_embeddings(
            self._call_reply("embed", {**embed_fields(input, dimensions, cache_salt), "model": model})
        )

    def tokenize(
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
        return self._call("tokenize", fields)["token_ids"]

    def detokenize(self, token_ids: Sequence[int], model: str | None = None) -> str:
        return self._call("detokenize", {"token_ids": list(token_ids), "model": model})["text"]

    def abort(self, request_id: RequestId) -> bool:
        """Abort a request of this client; False if it is not in flight (finished or unknown)."""
        try:
            self._call("abort", {"target": request_id})
        except NotFoundError:
            return False
        return True

    def health(self) -> dict:
        """{"status": "ready"} once the daemon serves; "draining" while it shuts down."""
        return self._call("health", {})

    def info(self, model: str | None = None) -> dict:
        """The model's (the daemon's only one, without a name), the daemon's limits and its `models`."""
        return self._call("info", {"model": model})

    def list_models(self) -> list[dict]:
        """The models the daemon serves, each {"name", "loaded", "max_model_len", "info"}."""
        return self._call("list_models", {})["models"]

    def load(self, model: str, keep_alive: float | str | None = None) -> dict:
        """Load `model` (answered once it is loaded); `keep_alive`: how long it then stays loaded idle (seconds
        or "5m"; negative: for good)."""
        return self._call("load", {"model": model, "keep_alive": keep_alive})

    def unload(self, model: str) -> bool:
        """Unload `model` now if nothing is in flight for it (True), else as soon as nothing is (False)."""
        return self._call("unload", {"model": model})["unloaded"]

    def stats(self, model: str | None = None) -> dict:
        return self._call("stats", {"model": model})

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _complete(self, op: str, fields: dict[str, Any]) -> Completion:
        rid = self._start(op, fields)
        try:
            return to_completion(self._next(rid))
        except DaemonError:
            raise  # an error reply ends the request in the daemon too
        except BaseException:
            # Timed out or interrupted: do not leave the daemon generating for nobody.
            self._abort_quietly(rid)
            raise
        finally:
            self._finish(rid)

    def _call(self, op: str, fields: dict[str, Any]) -> dict:
        return to_result(self._call_reply(op, fields))

    def _call_reply(self, op: str, fields: dict[str, Any]) -> dict:
        rid = self._start(op, fields)
        try:
            return self._next(rid)
        finally:
            self._finish(rid)

    def _start(self, op: str, fields: dict[str, Any]) -> RequestId:
        self._check_open()
        self.endpoint.check_listening("Client(endpoint=...)")
        rid = next(self._ids)
        self._inbox[rid] = deque()
        try:
            self._send(pack_request(op, rid, fields))
        except BaseException:
            self._finish(rid)
            raise
        return rid

    def _next(self, rid: RequestId) -> dict:
        """The next reply for `rid`, reading (and routing) whatever else arrives meanwhile."""
        inbox = self._inbox[rid]
        started = time.monotonic()
        while not inbox:
            quiet = time.monotonic() - max(started, self._last_heard)
            if quiet >= self.timeout:
                raise self._timeout_error()
            if self._socket.poll((self.timeout - quiet) * 1000, zmq.POLLIN):
                self._receive_ready()
        return inbox.popleft()

    def _receive_ready(self) -> None:
        # EVENTS instead of recv until zmq.Again: an exception per wake-up costs more than the query.
        while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            data = self._socket.recv(zmq.NOBLOCK)
            self._last_heard = time.monotonic()
            reply = unpack_reply(data)
            inbox = self._inbox.get(reply.get("id"))
            if inbox is not None and reply["type"] != "heartbeat":
                inbox.append(reply)
            # Else a heartbeat, or a late reply for a request abandoned here: nothing waits for it.

    def _send(self, data: bytes) -> None:
        try:
            self._socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            # The outgoing queue is full: the daemon has not been reading (or never connected).
            if not self._socket.poll(self.timeout * 1000, zmq.POLLOUT):
                raise self._timeout_error() from None
            self._socket.send(data, zmq.NOBLOCK)

    def _abort_quietly(self, rid: RequestId) -> None:
        if self._socket.closed or os.getpid() != self._pid:
            return
        # Best effort: a daemon that cannot take the abort cannot take anything else either.
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send(pack_request("abort", next(self._ids), {"target": rid}), zmq.NOBLOCK)

    def _finish(self, rid: RequestId) -> None:
        self._inbox.pop(rid, None)

    def _check_open(self) -> None:
        if self._socket.closed:
            raise ClosedError("this Client is closed; create a new one")
        if os.getpid() != self._pid:
            raise ClosedError(
                "this Client was created in another process (before fork); create one per process"
            )

    def _timeout_error(self) -> KvdTimeoutError:
        return KvdTimeoutError(
            f"no reply from the kvd daemon at {self.endpoint} within {self.timeout:g} s: is `kvd serve` "
            "running there? (choose the endpoint with Client(endpoint=...) or $KVD_ENDPOINT)"
        )


class Stream:
    """Chunks of one streamed generation, in order; the last one carries finish_reason and usage."""

    def __init__(self, client: Client, request_id: RequestId) -> None:
        self.client = client
        self.id = request_id
        self.done = False

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if self.done:
            raise StopIteration
        try:
            chunk = to_chunk(self.client._next(self.id))
        except DaemonError:
            self.done = True
            self.client._finish(self.id)
            raise
        except BaseException:
            self.close()
            raise
        if chunk.finished:
            self.done = True
            self.client._finish(self.id)
        return chunk

    def close(self) -> None:
        """Stop reading; an unfinished generation is aborted in the daemon."""
        if not self.done:
            self.done = True
            self.client._abort_quietly(self.id)
            self.client._finish(self.id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The wire format on the client side: request maps out, typed results back (see docs/protocol.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvd_client.errors import BadRequestError, ProtocolMismatchError, error_from_reply

PROTOCOL_VERSION = 1

RequestId = int | str
# {"role", "content"}; content may be None, with "tool_calls", "tool_call_id" and "name" where they apply.
Message = dict[str, Any]


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    # Speculative decoding: tokens drafted for the request, and those its own tokens confirmed (0 without).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    reasoning_tokens: int = 0  # a reasoning model's chat: of completion_tokens, those of its thinking section


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # the most likely alternatives at this position, best first


@dataclass
class ToolCall:
    """A function call the model made; `arguments` is JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry, for the next turn's history."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Embeddings:
    """The reply to `embed`: one L2-normalised vector per input, in order."""

    embeddings: list[list[float]]
    dimensions: int
    pooling: str  # "mean" or "last"
    prompt_tokens: int  # all inputs together


@dataclass
class Chunk:
    """One streamed increment. The last chunk of a stream has `finish_reason` and `usage` set."""

    id: RequestId
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "tool_calls" or "abort" on the last chunk
    usage: Usage | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # the last chunk's, with tools
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the last chunk's, with prompt_logprobs
    stop_string: str | None = (
        None  # the last chunk's: the request's stop string that ended the text, if one did
    )
    reasoning: str = ""  # a reasoning model's chat: this increment of its thinking section (not in `text`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A whole generation: the reply to a non-streaming `generate` or `chat`."""

    id: RequestId
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with prompt_logprobs; the first is None
    stop_string: str | None = None  # the request's stop string that ended the text, if one did
    reasoning: str = ""  # a reasoning model's chat: its thinking section (not in `text`)


def pack_request(op: str, request_id: RequestId, fields: dict[str, Any]) -> bytes:
    """One request map; fields set to None are left out, so the daemon applies its defaults. A value msgpack
    cannot carry raises BadRequestError naming its field, as the daemon would for a value out of range."""
    message = {"v": PROTOCOL_VERSION, "id": request_id, "op": op}
    message.update((k, v) for k, v in fields.items() if v is not None)
    if isinstance(message.get("logit_bias"), dict):  # token ids go over the wire as decimal strings
        message["logit_bias"] = {_token_key(k): v for k, v in message["logit_bias"].items()}
    try:
        return msgpack.packb(message)
    except (TypeError, ValueError, OverflowError) as e:  # UnicodeEncodeError is a ValueError
        field, reason = _unpackable(message, "") or (None, f"cannot be sent ({e})")
        raise BadRequestError(reason, field, request_id) from None


def _token_key(key: object) -> object:
    return str(key) if isinstance(key, int) and not isinstance(key, bool) else key


def _unpackable(value: object, path: str) -> tuple[str, str] | None:
    """The first value in a request that msgpack cannot carry: (its field path, why)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, f"is not valid text: {value[e.start]!r} at {e.start} is a lone surrogate"
    elif isinstance(value, bool | float | bytes) or value is None:
        pass
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            return path, f"{value} is beyond the 64-bit integers a request can carry"
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            fault = _unpackable(key, where) or _unpackable(item, where)
            if fault is not None:
                return fault
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            fault = _unpackable(item, f"{path}[{i}]")
            if fault is not None:
                return fault
    else:
        return path, f"a {type(value).__name__} cannot be sent"
    return None


def prompt_fields(prompt: str | Sequence[int], params: dict[str, Any]) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt, **params}
    return {"prompt_token_ids": list(prompt), **params}


def chat_fields(messages: Sequence[Message], params: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [dict(m) for m in messages], **params}


def tokenize_fields(
    text: str | None,
    messages: Sequence[Message] | None,
    tools: Sequence[dict] | None,
    think: bool | None,
    reasoning_effort: str | None,
) -> dict[str, Any]:
    """`tokenize`'s fields: a text, or a chat's messages with what chat would render beside them."""
    return {
        "text": text,
        "messages": None if messages is None else chat_fields(messages, {})["messages"],
        "tools": None if tools is None else list(tools),
        "think": think,
        "reasoning_effort": reasoning_effort,
    }


def embed_fields(
    input: str | Sequence[str] | Sequence[Sequence[int]], dimensions: int | None, cache_salt: str | None
) -> dict[str, Any]:
    return {"input": embed_input(input), "dimensions": dimensions, "cache_salt": cache_salt}


def embed_input(input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> str | list:
    """`embed`'s input as msgpack takes it: a text, one token id list, or a list of texts or of token id lists."""
    if isinstance(input, str):
        return input
    if input and isinstance(input[0], int):
        return list(input)
    return [x if isinstance(x, str) else list(x) for x in input]


def unpack_reply(data: bytes) -> dict:
    try:
        reply = msgpack.unpackb(data, raw=False)
    except Exception as e:
        raise ProtocolMismatchError(f"the daemon sent a reply that is not msgpack: {e}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("type"), str):
        raise ProtocolMismatchError(f"the daemon sent a reply without a type: {reply!r:.200}")
    return reply


def check_error(reply: dict) -> dict:
    """Raise the typed exception for an error reply; return any other reply unchanged."""
    if reply["type"] == "error":
        raise error_from_reply(reply)
    return reply


def to_result(reply: dict) -> dict:
    """The payload of a `result` reply (everything but `id` and `type`)."""
    reply = check_error(reply)
    if reply["type"] != "result":
        raise ProtocolMismatchError(f"expected a result reply, got {reply['type']!r}")
    return {k: v for k, v in reply.items() if k not in ("id", "type")}


def to_chunk(reply: dict) -> Chunk:
    reply = check_error(reply)
    if reply["type"] not in ("chunk", "final"):
        raise ProtocolMismatchError(f"expected a chunk or final reply, got {reply['type']!r}")
    final = reply["type"] == "final"
    return Chunk(
        id=reply["id"],
        text=reply["text"],
        token_ids=reply["token_ids"],
        logprobs=_logprobs(reply.get("logprobs")),
        finish_reason=reply["finish_reason"] if final else None,
        usage=_usage(reply["usage"]) if final else None,
        tool_calls=_tool_calls(reply.get("tool_calls")),
        prompt_logprobs=_prompt_logprobs(reply.get("prompt_logprobs")),
        stop_string=reply.get("stop_string"),
        reasoning=reply.get("reasoning", ""),
    )


def to_completion(reply: dict) -> Completion:
    reply = check_error(reply)
    if reply["type"] != "final":
        raise ProtocolMismatchError(f"expected a final reply, got {reply['type']!r}")
    return Completion(
        id=reply["id"],
        text=reply["text"],
        token_ids=reply["token_ids"],
        finish_reason=reply["finish_reason"],
        usage=_usage(reply["usage"]),
        logprobs=_logprobs(reply.get("logprobs")),
        tool_calls=_tool_calls(reply.get("tool_calls")),
        prompt_logprobs=_prompt_logprobs(reply.get("prompt_logprobs")),
        stop_string=reply.get("stop_string"),
        reasoning=reply.get("reasoning", ""),
    )


def _usage(fields: dict) -> Usage:
    """A final reply's usage; counts this client does not know yet (a newer daemon's) are left out."""
    known = {f.name for f in dataclasses.fields(Usage)}
    return Usage(**{k: v for k, v in fields.items() if k in known})


def to_embeddings(reply: dict) -> Embeddings:
    result = to_result(reply)
    return Embeddings(
        embeddings=result["embeddings"],
        dimensions=result["dimensions"],
        pooling=result["pooling"],
        prompt_tokens=result["usage"]["prompt_tokens"],
    )


def _logprobs(items: list[dict] | None) -> list[TokenLogprob] | None:
    if items is None:
        return None
    return [_logprob(i) for i in items]


def _prompt_logprobs(items: list[dict | None] | None) -> list[TokenLogprob | None] | None:
    if items is None:
        return None
    return [None if i is None else _logprob(i) for i in items]


def _logprob(item: dict) -> TokenLogprob:
    return TokenLogprob(item["token_id"], item["logprob"], [(t, lp) for t, lp in item["top_logprobs"]])


def _tool_calls(items: list[dict] | None) -> list[ToolCall]:
    return [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in items or []]

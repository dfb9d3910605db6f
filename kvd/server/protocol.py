"""The wire protocol: decoding with limits, validating requests, building replies. Spec: docs/protocol.md."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvd.request.reasoning import ReasoningError, ReasoningRequest, parse_reasoning
from kvd.request.sampling_params import STRUCTURED_FIELDS, SamplingParams, SamplingParamsError
from kvd.request.tool_validate import (
    Tool,
    ToolChoice,
    ToolError,
    check_history,
    parse_tool_choice,
    parse_tools,
)

# The shared request surface: SamplingParams defines the sampling fields' ranges for the offline API and the wire
# alike, and needs only the standard library.
from kvd.settings import parse_duration

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)

BAD_REQUEST = "bad_request"
UNSUPPORTED_VERSION = "unsupported_version"
TOO_LARGE = "too_large"
OVERLOADED = "overloaded"
NOT_FOUND = "not_found"
MODEL_NOT_FOUND = "model_not_found"
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal"
CLIENT_TIMEOUT = "client_timeout"
ERROR_CODES = (
    BAD_REQUEST,
    UNSUPPORTED_VERSION,
    TOO_LARGE,
    OVERLOADED,
    NOT_FOUND,
    MODEL_NOT_FOUND,
    SHUTTING_DOWN,
    INTERNAL,
    CLIENT_TIMEOUT,
)

MAX_ID = 2**63 - 1
MAX_ID_CHARS = 128
MAX_TOKEN_ID = 2**31 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 256
MAX_ROLE_CHARS = 64
MAX_EMBED_INPUTS = 256
MAX_MODEL_NAME_CHARS = 256
# No request needs more keys in one map (logit_bias has at most 512); a bound keeps hostile maps cheap to reject.
MAX_MAP_LEN = 512
# Elements a malformed frame's fault search visits at most before the reply falls back to the plain message.
FAULT_WALK_BUDGET = 20_000
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")

RequestId = int | str

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "prompt_logprobs",
    *STRUCTURED_FIELDS,
    "speculative",
)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
REASONING_FIELDS = ("think", "reasoning_effort", "reasoning_budget")
_COMMON_FIELDS = ("v", "id", "op")
OP_FIELDS: dict[str, tuple[str, ...]] = {
    "generate": (
        "model",
        "keep_alive",
        "prompt",
        "prompt_token_ids",
        "stream",
        "cache_salt",
        *SAMPLING_FIELDS,
    ),
    "chat": (
        "model",
        "keep_alive",
        "messages",
        "stream",
        "cache_salt",
        *SAMPLING_FIELDS,
        *TOOL_FIELDS,
        *REASONING_FIELDS,
    ),
    "embed": ("model", "keep_alive", "input", "dimensions", "cache_salt"),
    "tokenize": ("model", "text", "messages", "tools", "think", "reasoning_effort"),
    "detokenize": ("model", "token_ids"),
    "abort": ("target",),
    "health": (),
    "info": ("model",),
    "stats": ("model",),
    "list_models": (),
    "load": ("model", "keep_alive"),
    "unload": ("model",),
}


class ProtocolError(Exception):
    """A request the daemon answers with an error reply; `field` names the request field at fault."""

    def __init__(
        self, code: str, message: str, field: str | None = None, request_id: RequestId | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.request_id = request_id


@dataclass
class Message:
    """One validated request map from a client: `health`, `info` or `stats` (the other ops have subclasses)."""

    id: RequestId
    op: str
    # The model the request is for, by its name (list_models); None: the daemon's only model.
    model: str | None = field(default=None, kw_only=True)
    # Seconds the model stays loaded once idle after this request (inf: for good); None: the daemon's setting.
    keep_alive: float | None = field(default=None, kw_only=True)


@dataclass
class GenerateMessage(Message):
    """`generate` (prompt or prompt_token_ids set) or `chat` (messages set)."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    stream: bool
    cache_salt: str | None
    tools: list[Tool] | None = None  # chat: the functions the model may call
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    reasoning: ReasoningRequest = field(default_factory=ReasoningRequest)  # chat: the thinking section


@dataclass
class EmbedMessage(Message):
    inputs: list[str | list[int]]
    dimensions: int | None
    cache_salt: str | None


@dataclass
class TokenizeMessage(Message):
    text: str | None  # exactly one of text and messages is set
    messages: list[dict[str, str]] | None
    tools: list[Tool] | None = None  # with messages: the tools chat would list in the prompt
    reasoning: ReasoningRequest = field(default_factory=ReasoningRequest)  # with messages: as chat's


@dataclass
class DetokenizeMessage(Message):
    token_ids: list[int]


@dataclass
class AbortMessage(Message):
    target: RequestId


def decode(frame: bytes, max_message_bytes: int) -> dict:
    """Unpack one request frame into a map, or raise ProtocolError (too_large, bad_request)."""
    if len(frame) > max_message_bytes:
        raise ProtocolError(
            TOO_LARGE,
            f"the message has {len(frame)} bytes; this daemon accepts at most {max_message_bytes}",
            request_id=_peek_id(frame),
        )
    msg = _unpack(frame)
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_REQUEST, f"a request is a msgpack map, got {_type_name(msg)}")
    return msg


def _unpack(frame: bytes) -> Any:
    try:
        # Every length is also bounded by the frame size; ext types (timestamps included) are not part of it.
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise _undecodable(frame, e) from None


def _undecodable(frame: bytes, e: Exception) -> ProtocolError:
    """The error for a frame that is no request map of text keys and UTF-8 strings: where the frame is msgpack
    all the same (read leniently, strings as bytes), it names the request id and the field at fault, so the
    reply reaches the call that sent it."""
    error = ProtocolError(BAD_REQUEST, f"the message is not valid msgpack ({type(e).__name__}: {e})")
    try:
        # No map bound here: the frame's size bounds the work, and a map over the bound is named below.
        msg = msgpack.unpackb(frame, raw=True, strict_map_key=False, use_list=False, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException):
        return error
    if not isinstance(msg, dict):
        return error
    request_id = msg.get(b"id")
    with contextlib.suppress(ProtocolError, UnicodeDecodeError):  # an id that is no UTF-8 is no id of a call
        error.request_id = _as_id(request_id.decode() if isinstance(request_id, bytes) else request_id, "id")
    fault = _fault(msg)
    if fault is not None:
        error.field, error.message = fault
    return error


def _fault(msg: Any) -> tuple[str, str] | None:
    """The first place in a leniently read message that strict reading refuses: a map key that is not text, a
    map of more than MAX_MAP_LEN entries, or a string that is not UTF-8. Iterative, depth first in order, and
    bounded: past FAULT_WALK_BUDGET elements it gives up (None), so a malformed frame costs the loop little."""
    stack: list[tuple[Any, str]] = [(msg, "")]
    for _ in range(FAULT_WALK_BUDGET):
        if not stack:
            return None
        value, path = stack.pop()
        if isinstance(value, bytes):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return path, "is not valid UTF-8 text"
        elif isinstance(value, dict):
            if len(value) > MAX_MAP_LEN:
                return path, f"has {len(value)} entries; a map in a request holds at most {MAX_MAP_LEN}"
            children = []
            for key, item in value.items():
                if not isinstance(key, bytes):
                    return path, f"map keys must be strings, got {_type_name(key)} {key!r:.40}"
                name = key.decode("utf-8", "replace")
                where = f"{path}.{name}" if path else name
                children += [(key, where), (item, where)]
            stack.extend(reversed(children))
        elif isinstance(value, tuple):
            shown = min(len(value), FAULT_WALK_BUDGET)  # what the budget can visit of it
            stack.extend((value[i], f"{path}[{i}]") for i in reversed(range(shown)))
    return None


def _peek_id(frame: bytes) -> RequestId | None:
    """The id of an oversized request, so that its too_large error reaches the right call."""
    try:
        msg = _unpack(frame)
        return _request_id(msg) if isinstance(msg, dict) else None
    except ProtocolError as e:  # the id, where a lenient reading found one
        return e.request_id


def parse_message(msg: dict) -> Message:
    """Validate a decoded map against the op's schema; errors carry the request id once it is known."""
    request_id = _request_id(msg)
    try:
        return _parse(msg, request_id)
    except ProtocolError as e:
        e.request_id = request_id
        raise


def _request_id(msg: dict) -> RequestId:
    return _as_id(msg.get("id"), "id")


def _as_id(value: Any, name: str) -> RequestId:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ID:
        return value
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    raise ProtocolError(
        BAD_REQUEST,
        f"{name} must be an integer in [0, 2^63) or a string of 1 to {MAX_ID_CHARS} characters",
        name,
    )


def _parse(msg: dict, request_id: RequestId) -> Message:
    message = _parse_op(msg, request_id)
    model = msg.get("model")
    if model is not None:
        _check_str(model, "model", MAX_MODEL_NAME_CHARS)
        message.model = model
    if msg.get("keep_alive") is not None:
        try:
            message.keep_alive = parse_duration(msg["keep_alive"])
        except ValueError as e:
            raise ProtocolError(BAD_REQUEST, f"keep_alive: {e}", "keep_alive") from None
    return message


def _parse_op(msg: dict, request_id: RequestId) -> Message:
    version = msg.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        got = "is required" if version is None else f"must be an integer, got {_type_name(version)}"
        raise ProtocolError(
            BAD_REQUEST, f"v (the protocol version) {got}; this daemon speaks {PROTOCOL_VERSION}", "v"
        )
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported; supported: {list(SUPPORTED_VERSIONS)}",
            "v",
        )
    op = msg.get("op")
    if not isinstance(op, str) or op not in OP_FIELDS:
        raise ProtocolError(BAD_REQUEST, f"op must be one of {sorted(OP_FIELDS)}", "op")
    allowed = (*_COMMON_FIELDS, *OP_FIELDS[op])
    for key in msg:
        if key not in allowed:
            shown = key if isinstance(key, str) else repr(key)
            raise ProtocolError(
                BAD_REQUEST, f"unknown field for op {op!r}; allowed: {', '.join(allowed)}", shown
            )
    # nil is the same as leaving a field out.
    fields = {k: v for k, v in msg.items() if v is not None and k not in _COMMON_FIELDS}
    if op in ("generate", "chat"):
        return _generate(request_id, op, fields)
    if op == "embed":
        return _embed(request_id, op, fields)
    if op == "tokenize":
        text, messages = _one_prompt(fields, ("text", "messages"))
        if messages is not None:  # tokenize shows the prompt chat would see: it refuses what chat refuses
            _check_history(messages)
        if fields.get("tools") is not None and messages is None:
            raise ProtocolError(
                BAD_REQUEST, "tools go with messages (a chat's prompt), not with text", "tools"
            )
        given = [name for name in ("think", "reasoning_effort") if name in fields]
        if given and messages is None:
            raise ProtocolError(
                BAD_REQUEST, f"{given[0]} goes with messages (a chat's prompt), not text", given[0]
            )
        try:
            tools = parse_tools(fields["tools"]) if fields.get("tools") is not None else []
        except ToolError as e:
            raise ProtocolError(BAD_REQUEST, str(e), e.field) from None
        return TokenizeMessage(request_id, op, text, messages, tools or None, _reasoning(fields))
    if op == "detokenize":
        return DetokenizeMessage(request_id, op, _token_ids(fields, "token_ids", allow_empty=True))
    if op == "abort":
        if "target" not in fields:
            raise ProtocolError(BAD_REQUEST, "target (the id of the request to abort) is required", "target")
        return AbortMessage(request_id, op, _as_id(fields["target"], "target"))
    return Message(request_id, op)


def _generate(request_id: RequestId, op: str, fields: dict) -> GenerateMessage:
    prompt = prompt_token_ids = messages = None
    if op == "chat":
        if "messages" not in fields:
            raise ProtocolError(BAD_REQUEST, "messages is required for chat", "messages")
        messages = _messages(fields["messages"])
    else:
        prompt, prompt_token_ids = _one_prompt(fields, ("prompt", "prompt_token_ids"))
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError(BAD_REQUEST, f"stream must be a boolean, got {_type_name(stream)}", "stream")
    message = GenerateMessage(
        request_id,
        op,
        prompt,
        prompt_token_ids,
        messages,
        _sampling_params(fields),
        stream,
        _cache_salt(fields),
    )
    if op == "chat":
        _tool_fields(message, fields)
        message.reasoning = _reasoning(fields)
    return message


def _reasoning(fields: dict) -> ReasoningRequest:
    try:
        return parse_reasoning(
            fields.get("think"), fields.get("reasoning_effort"), fields.get("reasoning_budget")
        )
    except ReasoningError as e:
        raise ProtocolError(BAD_REQUEST, str(e), e.field) from None


def _cache_salt(fields: dict) -> str | None:
    cache_salt = fields.get("cache_salt")
    if cache_salt is not None:
        _check_str(cache_salt, "cache_salt", MAX_CACHE_SALT_CHARS)
    return cache_salt


def _check_history(messages: list) -> None:
    """The conversation's turns as chat takes them (nil content only in an assistant turn with tool calls, a
    tool result only for a call), or the error naming the field."""
    try:
        check_history(messages)
    except ToolError as e:
        raise ProtocolError(BAD_REQUEST, str(e), e.field) from None


def _tool_fields(message: GenerateMessage, fields: dict) -> None:
    _check_history(message.messages)
    try:
        tools = parse_tools(fields["tools"]) if "tools" in fields else []
        message.tool_choice = parse_tool_choice(fields.get("tool_choice"), tools)
    except ToolError as e:
        raise ProtocolError(BAD_REQUEST, str(e), e.field) from None
    message.tools = tools or None
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ProtocolError(BAD_REQUEST, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    message.parallel_tool_calls = parallel
    if message.tool_choice.mode in ("required", "named") and message.params.structured is not None:
        raise ProtocolError(
            BAD_REQUEST,
            f"tool_choice {message.tool_choice.mode!r} constrains the output already; drop "
            f"{message.params.structured[0]} or use tool_choice auto",
            "tool_choice",
        )


def _embed(request_id: RequestId, op: str, fields: dict) -> EmbedMessage:
    value = fields.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        value = [value]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_EMBED_INPUTS:
        raise ProtocolError(
            BAD_REQUEST,
            f"input must be a string, or an array of 1 to {MAX_EMBED_INPUTS} strings or token-id arrays",
            "input",
        )
    for i, item in enumerate(value):
        if isinstance(item, list):
            _token_ids({"ids": item}, "ids", allow_empty=False, shown=f"input[{i}]")
        else:
            _check_str(item, f"input[{i}]", None)
    dimensions = fields.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise ProtocolError(BAD_REQUEST, "dimensions must be a positive integer", "dimensions")
    return EmbedMessage(request_id, op, value, dimensions, _cache_salt(fields))


def _one_prompt(fields: dict, names: tuple[str, str]) -> tuple[Any, Any]:
    """Exactly one of a text field and a second form (token ids or messages)."""
    text_name, other = names
    present = [n for n in names if n in fields]
    if len(present) != 1:
        raise ProtocolError(BAD_REQUEST, f"give exactly one of {text_name} and {other}", text_name)
    if text_name in fields:
        _check_str(fields[text_name], text_name, None)
        return fields[text_name], None
    if other == "messages":
        return None, _messages(fields[other])
    return None, _token_ids(fields, other, allow_empty=False)


def _sampling_params(fields: dict) -> SamplingParams:
    values = {k: fields[k] for k in SAMPLING_FIELDS if k in fields}
    stop = values.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
            raise ProtocolError(
                BAD_REQUEST,
                f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings",
                "stop",
            )
        for s in stops:
            _check_str(s, "stop", MAX_STOP_CHARS)
    if "stop_token_ids" in values:
        values["stop_token_ids"] = _token_ids(
            values, "stop_token_ids", allow_empty=True, limit=MAX_STOP_TOKEN_IDS
        )
    if "logit_bias" in values:
        values["logit_bias"] = _logit_bias(values["logit_bias"])
    try:
        return SamplingParams(**values)
    except SamplingParamsError as e:
        raise ProtocolError(BAD_REQUEST, str(e), e.field) from None


_DECIMAL = re.compile(r"0|[1-9][0-9]*")  # ASCII only: str.isdigit() and int() take every script's digits


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's form, token ids as decimal strings (msgpack maps here have string keys), to ints."""
    if not isinstance(value, dict):
        raise ProtocolError(
            BAD_REQUEST, "logit_bias must be a map of token id (a string) to a number", "logit_bias"
        )
    bias = {}
    for key, v in value.items():
        if not isinstance(key, str) or not _DECIMAL.fullmatch(key) or int(key) > MAX_TOKEN_ID:
            raise ProtocolError(
                BAD_REQUEST, f"logit_bias keys are token ids in decimal, got {key!r:.40}", "logit_bias"
            )
        bias[int(key)] = v
    return bias


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ProtocolError(
            BAD_REQUEST, "messages must be a non-empty list of {role, content} maps", "messages"
        )
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise ProtocolError(
                BAD_REQUEST,
                f"each message is a map with role and content, and optionally {', '.join(MESSAGE_FIELDS[2:])}",
                where,
            )
        for key in m:
            if key not in MESSAGE_FIELDS:
                raise ProtocolError(
                    BAD_REQUEST,
                    f"not a message field (one of: {', '.join(MESSAGE_FIELDS)})",
                    f"{where}.{key}",
                )
        _check_str(m["role"], f"{where}.role", MAX_ROLE_CHARS)
        if m["content"] is not None:
            _check_str(m["content"], f"{where}.content", None, allow_empty=True)
        for name in ("tool_call_id", "name"):
            if name in m:
                _check_str(m[name], f"{where}.{name}", MAX_ID_CHARS)
    return value


def _token_ids(
    fields: dict, name: str, allow_empty: bool, limit: int | None = None, shown: str | None = None
) -> list[int]:
    """fields[name] as a list of token ids; errors name the field `shown` (default: `name`)."""
    shown = shown or name
    ids = fields.get(name)
    if not isinstance(ids, list) or (not ids and not allow_empty):
        raise ProtocolError(
            BAD_REQUEST, f"{shown} must be a {'' if allow_empty else 'non-empty '}list of integers", shown
        )
    if limit is not None and len(ids) > limit:
        raise ProtocolError(BAD_REQUEST, f"{shown} holds {len(ids)} entries; at most {limit}", shown)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ProtocolError(
                BAD_REQUEST, f"{shown} must hold integers in [0, {MAX_TOKEN_ID}], got {t!r:.40}", shown
            )
    return ids


def _check_str(value: Any, name: str, max_chars: int | None, allow_empty: bool = False) -> None:
    if not isinstance(value, str):
        raise ProtocolError(BAD_REQUEST, f"{name} must be a string, got {_type_name(value)}", name)
    if not value and not allow_empty:
        raise ProtocolError(BAD_REQUEST, f"{name} must not be empty", name)
    if max_chars is not None and len(value) > max_chars:
        raise ProtocolError(BAD_REQUEST, f"{name} is longer than {max_chars} characters", name)


def _type_name(value: Any) -> str:
    return {bytes: "binary", dict: "map", list: "array", type(None): "nil"}.get(
        type(value), type(value).__name__
    )


# Replies: one map each, always with `id` (nil when the request's id could not be read) and `type`.


def chunk_reply(
    request_id: RequestId,
    text: str,
    token_ids: list[int],
    logprobs: list[dict] | None,
    reasoning: str = "",
) -> dict:
    """A stream's increment: `text` is the answer's, `reasoning` the thinking section's (sent when there is
    some)."""
    reply = {"id": request_id, "type": "chunk", "text": text, "token_ids": token_ids}
    if reasoning:
        reply["reasoning"] = reasoning
    if logprobs is not None:
        reply["logprobs"] = logprobs
    return reply


def final_reply(
    request_id: RequestId,
    text: str,
    token_ids: list[int],
    logprobs: list[dict] | None,
    finish_reason: str,
    usage: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> dict:
    """The last reply of a generation; `extra`: reasoning, tool_calls, prompt_logprobs where they apply."""
    reply = chunk_reply(request_id, text, token_ids, logprobs)
    reply.update(type="final", finish_reason=finish_reason, usage=usage, **(extra or {}))
    return reply


def result_reply(request_id: RequestId, fields: dict[str, Any]) -> dict:
    return {"id": request_id, "type": "result", **fields}


def error_reply(request_id: RequestId | None, code: str, message: str, field: str | None = None) -> dict:
    reply = {"id": request_id, "type": "error", "code": code, "message": message}
    if field is not None:
        reply["field"] = field
    return reply


def heartbeat_reply() -> dict:
    return {"id": None, "type": "heartbeat"}


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    draft_tokens: int = 0,
    accepted_tokens: int = 0,
) -> dict[str, int]:
    """A final reply's usage; a request that speculative decoding drafted for adds its drafted tokens and those
    its own tokens confirmed (accepted)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }
    if draft_tokens:
        out |= {"draft_tokens": draft_tokens, "accepted_draft_tokens": accepted_tokens}
    return out


def logprobs_payload(tokens: list[Any]) -> list[dict | None]:
    """Sampled tokens (token_id, logprob, top_logprobs) as protocol maps; None stays nil."""
    return [
        None
        if t is None
        else {
            "token_id": t.token_id,
            "logprob": t.logprob,
            "top_logprobs": [[i, lp] for i, lp in t.top_logprobs or []],
        }
        for t in tokens
    ]


def tool_calls_payload(calls: list[Any]) -> list[dict]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def encode(reply: dict) -> bytes:
    return msgpack.packb(reply)

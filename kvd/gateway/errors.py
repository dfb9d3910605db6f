"""Errors with their HTTP status: OpenAI's shape, {"error": {"message", "type", "param", "code"}}, on /v1,
Anthropic's, {"type": "error", "error": {"type", "message"}}, on /v1/messages, and Ollama's, {"error": message},
on /api."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvd_client import DaemonError, KvdError

# kvd error code -> (HTTP status, OpenAI error type)
_DAEMON_CODES = {
    "bad_request": (400, "invalid_request_error"),
    "unsupported_version": (500, "server_error"),
    "too_large": (400, "invalid_request_error"),
    "overloaded": (429, "rate_limit_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "shutting_down": (503, "server_error"),
    "internal": (500, "server_error"),
}
# kvd_client says how to choose another endpoint by its constructor's argument; whoever runs a gateway chooses
# with the gateway's flag.
_CLIENT_ENDPOINT_HINT = "AsyncClient(endpoint=...)"
_GATEWAY_ENDPOINT_HINT = "`kvd gateway --endpoint`"
# pydantic's names for the members of a union in an error's location: str, list[int], function-after[...],
# literal['a','b'], or a model's class name.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|dict|list)$|^[a-z-]+\[|^[A-Z]")


class ApiError(Exception):
    """An error reply of the gateway; `param` names the request field at fault."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def generation_cut() -> ApiError:
    """The daemon stopped (a drain, a restart) before the generation finished."""
    message = "the kvd daemon stopped before the generation finished; retry once it is back"
    return ApiError(503, message, "server_error", code="generation_cut")


def invalid_fields(problems: Sequence[tuple[str, str]]) -> ApiError:
    """One 400 for every field at fault: `param` is the first, the message lists them all."""
    message = "; ".join(f"{param}: {reason}" for param, reason in problems)
    return ApiError(400, message, "invalid_request_error", problems[0][0])


def from_kvd_error(e: KvdError, param_names: Mapping[str, str] | None = None) -> ApiError:
    """The daemon's typed errors keep their code, the field renamed as the request named it; a daemon that
    does not answer is a 503."""
    if isinstance(e, DaemonError):
        status, type_ = _DAEMON_CODES.get(e.code, (500, "server_error"))
        param = _rename(e.field, param_names or {})
        message = e.message
        if param and param != e.field:  # the request's name for the field, in place of the daemon's
            message = f"{param}: {message.removeprefix(f'{e.field}: ')}"
        return ApiError(status, message, type_, param, e.code)
    message = f"the kvd daemon is not available: {unavailable_reason(e)}"
    return ApiError(503, message, "server_error", code="daemon_unavailable")


def unavailable_reason(e: Exception) -> str:
    """Why the daemon did not answer, with the gateway's way to point at another."""
    return str(e).replace(_CLIENT_ENDPOINT_HINT, _GATEWAY_ENDPOINT_HINT)


def _rename(field: str | None, names: Mapping[str, str]) -> str | None:
    if not field:
        return field
    head = re.match(r"[^.\[]*", field).group()
    return names.get(head, head) + field[len(head) :]


def field_path(loc: Sequence[str | int]) -> str:
    """("body", "messages", 3, "tool_call_id") -> "messages[3].tool_call_id"."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_MEMBER.match(part):
            path += f".{part}" if path else part
    return path


def _validation_problems(e: RequestValidationError) -> list[tuple[str, str]]:
    problems: dict[str, str] = {}
    for error in e.errors():
        path = "body" if error["type"] == "json_invalid" else field_path(error["loc"])
        if error["type"] == "extra_forbidden":
            reason = "not a supported field"
        elif error["type"] == "none_required":  # a field typed None: accepted only as null
            reason = "not supported by kvd (only null)"
        else:
            reason = error["msg"]
        if path not in problems:  # a union reports each member's failure: the first says enough
            problems[path] = reason
    return list(problems.items())


def is_ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def is_anthropic(request: Request) -> bool:
    return request.url.path == "/v1/messages" or request.url.path.startswith("/v1/messages/")


# HTTP status -> Anthropic's error type (its API answers an overloaded service with 529; kvd's daemon says 429).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(error: ApiError) -> dict:
    """The error's body in Anthropic's shape (the field at fault is named in the message, as Anthropic does)."""
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# Seconds a client is asked to wait before retrying a 429 or 503: the daemon's queues drain within a few steps.
RETRY_AFTER_S = 1


def error_response(request: Request, error: ApiError) -> JSONResponse:
    if is_ollama(request):
        body = {"error": error.message}
    else:
        body = anthropic_error(error) if is_anthropic(request) else error.body()
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    return JSONResponse(body, status_code=error.status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(request, e)

    @app.exception_handler(KvdError)
    async def _kvd_error(request: Request, e: KvdError) -> JSONResponse:
        return error_response(request, from_kvd_error(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 (FastAPI's default is 422), naming the fields at fault.
        problems = _validation_problems(e) or [("", "invalid request body")]
        error = invalid_fields([(p or "body", reason) for p, reason in problems])
        return error_response(request, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        # A bug of the gateway's: answered in the API's error shape rather than as plain text (the server still
        # logs the traceback: Starlette re-raises after this reply).
        error = ApiError(500, f"internal error of the gateway: {type(e).__name__}", "server_error")
        return error_response(request, error)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(request, ApiError(e.status_code, str(e.detail), type_))

"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the matching HTTP status."""

from __future__ import annotations

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
    "shutting_down": (503, "server_error"),
    "internal": (500, "server_error"),
}


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


def from_kvd_error(e: KvdError) -> ApiError:
    """The daemon's typed errors keep their code; a daemon that does not answer is a 503."""
    if isinstance(e, DaemonError):
        status, type_ = _DAEMON_CODES.get(e.code, (500, "server_error"))
        return ApiError(status, e.message, type_, e.field, e.code)
    return ApiError(503, f"the kvd daemon is not available: {e}", "server_error", code="daemon_unavailable")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(KvdError)
    async def _kvd_error(_: Request, e: KvdError) -> JSONResponse:
        error = from_kvd_error(e)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 (FastAPI's default is 422), naming the first field at fault.
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(ApiError(400, message, "invalid_request_error", param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), type_).body(), status_code=e.status_code)

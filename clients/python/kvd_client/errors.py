"""Exceptions of the client: local failures (endpoint, timeout) and the daemon's typed error replies."""

from __future__ import annotations


class KvdError(Exception):
    """Base class of every error this package raises."""


class EndpointError(KvdError, ValueError):
    """An endpoint string is malformed; the message shows the accepted forms."""


class KvdTimeoutError(KvdError, TimeoutError):
    """The daemon said nothing for `timeout` seconds: it is not running, not reachable, or stuck."""


class NoDaemonError(KvdError, ConnectionError):
    """No daemon can be listening at the endpoint: its ipc socket file does not exist."""


class ClosedError(KvdError):
    """The client was closed, or is used in a process other than the one that created it."""


class ProtocolMismatchError(KvdError):
    """The daemon sent a reply this client cannot read (a newer or foreign protocol)."""


class DaemonError(KvdError):
    """An error reply from the daemon. `code` is the protocol's error code; `field` names the request field at
    fault when there is one."""

    code = "internal"

    def __init__(self, message: str, field: str | None = None, request_id: object = None) -> None:
        super().__init__(f"{message} (field {field!r})" if field else message)
        self.message = message
        self.field = field
        self.request_id = request_id


class BadRequestError(DaemonError):
    """A request field the daemon refuses; also raised before sending for a value no request can carry (an
    integer beyond 64 bits, text with a lone surrogate)."""

    code = "bad_request"


class UnsupportedVersionError(DaemonError):
    code = "unsupported_version"


class TooLargeError(DaemonError):
    code = "too_large"


class OverloadedError(DaemonError):
    code = "overloaded"


class NotFoundError(DaemonError):
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    """The request named a model the daemon does not serve (list_models says which it does)."""

    code = "model_not_found"


class ShuttingDownError(DaemonError):
    code = "shutting_down"


class InternalError(DaemonError):
    code = "internal"


class ClientTimeoutError(DaemonError):
    """The daemon aborted the request because this client read no reply for its client timeout."""

    code = "client_timeout"


_BY_CODE = {
    cls.code: cls
    for cls in (
        BadRequestError,
        UnsupportedVersionError,
        TooLargeError,
        OverloadedError,
        NotFoundError,
        ModelNotFoundError,
        ShuttingDownError,
        InternalError,
        ClientTimeoutError,
    )
}


def error_from_reply(reply: dict) -> DaemonError:
    """The exception for an error reply; an unknown code (a newer daemon) becomes a plain DaemonError."""
    code = reply.get("code")
    cls = _BY_CODE.get(code, DaemonError)
    error = cls(str(reply.get("message", "")), reply.get("field"), reply.get("id"))
    if cls is DaemonError:
        error.code = str(code)
    return error

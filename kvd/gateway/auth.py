"""Who may use the gateway: the Host-header check (against DNS rebinding) and the API keys, as ASGI middleware
that also records each request's caller, the identity its prefix-cache salt and daemon connection follow.

DNS rebinding: a web page's script may reach a loopback port through a host name of the attacker's that
resolves to 127.0.0.1; the browser then sends that name as Host. So a request over TCP is served only when its
Host is a loopback name or address or one the operator allowed (`--allowed-host`). A unix socket is out of a
browser's reach: its requests are served whatever their Host."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvd.gateway.errors import ApiError, error_response
from kvd.gateway.keys import ApiKeys, Models
from kvd.gateway.server import GatewayConfigError

CALLER = "kvd.caller"  # the scope's key for the caller's identity
MODELS = "kvd.models"  # and for the models its key may use
ANY_HOST = "*"
OPEN_PATHS = frozenset({"/health"})  # served without a key: a probe learns only whether the daemon is ready
UNIX_CALLER = "unix socket"  # without keys, every caller on the unix socket is one identity


@dataclass(frozen=True)
class Access:
    """The gateway's access settings (from `kvd gateway`'s flags); the default: loopback Hosts, no keys."""

    keys: ApiKeys | None = None
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)  # lower case, no port; "*": any

    @classmethod
    def of(cls, keys: ApiKeys | None, allowed_hosts: Iterable[str], bound_host: str | None) -> Access:
        """`bound_host`, the --http address, is allowed as Host when it is one specific address: only that
        address reaches the gateway (an address is no name, so no rebinding)."""
        hosts = {_allowed_host(h) for h in allowed_hosts}
        if bound_host is not None and _is_specific_address(bound_host):
            hosts.add(normal_host(bound_host))
        return cls(keys, frozenset(hosts))

    def allows_host(self, host: str | None) -> bool:
        if host is None:
            return False
        return ANY_HOST in self.allowed_hosts or is_loopback_name(host) or host in self.allowed_hosts


def _allowed_host(text: str) -> str:
    host = normal_host(text)
    if host == ANY_HOST:
        return host
    if not host or any(c.isspace() or c in "/[]" for c in host) or (":" in host and not _is_address(host)):
        raise GatewayConfigError(f"--allowed-host {text!r}: expected a host name or address, without a port")
    return host


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def normal_host(text: str) -> str:
    """A host as compared: lower case, without IPv6 brackets or a final dot."""
    return text.strip().lower().removeprefix("[").removesuffix("]").removesuffix(".")


def host_of(header: str) -> str | None:
    """The host of a Host header ("name", "name:port", "[v6]" or "[v6]:port"); None when it is malformed."""
    if header.startswith("["):
        end = header.find("]")
        port = header[end + 1 :]
        if end < 0 or (port and not _is_port(port)):
            return None
        return normal_host(header[: end + 1]) or None
    name, sep, port = header.rpartition(":")
    if not sep:
        name = header
    elif not _is_port(sep + port):
        return None
    return normal_host(name) or None


def _is_port(text: str) -> bool:
    return text.startswith(":") and text[1:].isdigit() and len(text) <= 6


def is_loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_specific_address(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a name: its address may change


def caller_of(request: Request) -> str:
    """The identity Guard recorded: a key's name, else the peer's address (or the unix socket)."""
    return request.scope[CALLER]  # a KeyError is a route that Guard did not check: a bug, a 500


def models_of(request: Request) -> Models:
    """The models the caller's key may use (None: every model)."""
    return request.scope.get(MODELS)


class Guard:
    """ASGI middleware (as CountRequests: not BaseHTTPMiddleware, which would buffer streams): the Host check,
    then the key, answered in the route's error shape (errors.error_response)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # names are lower case in ASGI; a repeated header keeps its last
        # A unix socket's server address has no port (uvicorn); it is the transport's, no header can change it.
        over_unix = (scope.get("server") or ("", 0))[1] is None
        if not over_unix:
            header = headers.get(b"host", b"").decode("latin-1")
            if not self.access.allows_host(host_of(header)):
                await _refuse(scope, receive, send, _host_error(header))
                return
        keys = self.access.keys
        if keys is None:
            client = scope.get("client")
            scope[CALLER] = UNIX_CALLER if over_unix else f"address {client[0] if client else '?'}"
        elif scope["path"] not in OPEN_PATHS:
            found = _key(keys, headers)
            if found is None:
                error = ApiError(401, _key_message(headers), "invalid_request_error", code="invalid_api_key")
                await _refuse(scope, receive, send, error, {"WWW-Authenticate": "Bearer"})
                return
            scope[CALLER], scope[MODELS] = f"key {found[0]}", found[1]
        await self.app(scope, receive, send)


def _key(keys: ApiKeys, headers: dict[bytes, bytes]) -> tuple[str, Models] | None:
    """The name and models of the key sent as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
    (Anthropic's); either may be the right one."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    candidates = [token.strip()] if scheme.lower() == b"bearer" else []
    if b"x-api-key" in headers:
        candidates.append(headers[b"x-api-key"].strip())
    found = [keys.find(c) for c in candidates]
    return next((f for f in found if f is not None), None)


def _key_message(headers: dict[bytes, bytes]) -> str:
    if b"authorization" in headers or b"x-api-key" in headers:
        return "invalid API key"
    return "this gateway needs an API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"


def _host_error(header: str) -> ApiError:
    shown = header[:100] or "(none)"
    message = (
        f"Host {shown!r} is not allowed: the gateway answers loopback names only, so that web pages cannot "
        "reach it through DNS rebinding; start it with --allowed-host NAME for a name it is reached by"
    )
    return ApiError(403, message, "permission_error", code="host_not_allowed")


async def _refuse(
    scope: Scope, receive: Receive, send: Send, error: ApiError, headers: dict[str, str] | None = None
) -> None:
    response = error_response(Request(scope), error)
    response.headers.update(headers or {})
    await response(scope, receive, send)

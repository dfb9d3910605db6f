"""Every HTTP request counted by route and status code, errors and unknown paths included."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvd.gateway.metrics import GatewayMetrics

UNMATCHED = "unmatched"  # every path no route serves: one label, so that scanners cannot grow the series


class CountRequests:
    """ASGI middleware (not BaseHTTPMiddleware, which would buffer streams and hide disconnects)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # unless a response starts: an exception escaped every handler

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.http_request(_route(scope), status)


def _route(scope: Scope) -> str:
    """The path template of the route the router chose (it records it in the scope); a known path with the
    wrong method (405) keeps its route."""
    route = scope.get("route")
    return getattr(route, "path", None) or UNMATCHED

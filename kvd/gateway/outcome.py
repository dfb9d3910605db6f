"""A generation's HTTP answer and its outcome in /metrics, shared by the OpenAI and the Ollama routes."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping

from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvd.gateway.choices import ClientDisconnected
from kvd.gateway.errors import ApiError, from_kvd_error
from kvd.gateway.metrics import GatewayMetrics
from kvd_client import KvdError


async def answer(
    metrics: GatewayMetrics,
    endpoint: str,
    param_names: Mapping[str, str],
    reply: Awaitable[dict | StreamingResponse],
) -> Response:
    """Await `reply` and count its outcome. A whole reply (a JSON body) is a success; a stream counts its own
    outcome when it ends. A client that went away gets a 499; API and daemon errors are raised as HTTP errors
    (the daemon's fields named by `param_names`), client or server errors by their status; anything else is a
    server error, answered by the app's handler."""
    try:
        result = await reply
    except ClientDisconnected:
        metrics.request_done(endpoint, "disconnected")
        return Response(status_code=499)
    except (ApiError, KvdError) as e:
        error = e if isinstance(e, ApiError) else from_kvd_error(e, param_names)
        metrics.request_done(endpoint, "client_error" if error.status < 500 else "server_error")
        raise error from None
    except Exception:
        metrics.request_done(endpoint, "server_error")
        raise
    if isinstance(result, StreamingResponse):
        return result
    metrics.request_done(endpoint, "success")
    return JSONResponse(result)

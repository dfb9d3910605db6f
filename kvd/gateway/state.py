"""What the routes share: the connections to the daemon, the metrics, the daemon's `info`."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from kvd.gateway.callers import CallerClients, caller_of
from kvd.gateway.errors import ApiError
from kvd.gateway.logprobs import TokenTexts
from kvd.gateway.metrics import GatewayMetrics
from kvd_client import AsyncClient


@dataclass
class Gateway:
    client: AsyncClient  # the gateway's own: info, stats, health, tokenize
    callers: CallerClients  # each caller's, for its generations and embeddings
    metrics: GatewayMetrics
    texts: TokenTexts
    served_model_name: str | None
    info: dict | None = None
    started: int = 0

    def client_for(self, request: Request, user: str | None = None) -> AsyncClient:
        """The connection that runs `request`'s generations: its caller's (see kvd.gateway.callers)."""
        return self.callers.get(caller_of(request, user))

    async def model_info(self) -> dict:
        if self.info is None:  # asked lazily: the gateway may start before the daemon
            self.info = await self.client.info()
        return self.info

    async def model_name(self) -> str:
        return self.served_model_name or (await self.model_info())["model"]

    async def check_model(self, model: str, also: tuple[str, ...] = ()) -> str:
        """The served name, if `model` (or `model` without one of the suffixes `also`) names it; else 404."""
        name = await self.model_name()
        if model != name and not any(model == name + suffix for suffix in also):
            raise ApiError(
                404,
                f"model {model!r} is not served here; it serves {name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return name


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway

"""What the routes share: the connections to the daemon, the callers' cache salts, the metrics, the daemon's
`info`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from kvd.gateway.auth import caller_of
from kvd.gateway.callers import CallerClients, connection_of
from kvd.gateway.choices import Job, open_streams
from kvd.gateway.errors import ApiError
from kvd.gateway.logprobs import TokenTexts
from kvd.gateway.metrics import GatewayMetrics
from kvd.gateway.response_store import ResponseStore
from kvd.gateway.salts import CacheSalts
from kvd_client import AsyncClient, AsyncStream, Embeddings


@dataclass
class Gateway:
    client: AsyncClient  # the gateway's own: info, stats, health, tokenize
    callers: CallerClients  # each caller's, for its generations and embeddings
    metrics: GatewayMetrics
    texts: TokenTexts
    served_model_name: str | None
    info: dict | None = None
    started: int = 0
    salts: CacheSalts = field(default_factory=CacheSalts)
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses

    # Every generation and embedding goes to the daemon through these two, which salt it with its caller's
    # namespace (kvd.gateway.salts) and run it on its caller's connection (kvd.gateway.callers).

    def streams(
        self, request: Request, op: str, jobs: Sequence[Job], user: str | None = None
    ) -> list[AsyncStream]:
        caller = caller_of(request)
        salted = [(p, {**f, "cache_salt": self.salts.salt(caller, f.get("cache_salt"))}) for p, f in jobs]
        return open_streams(self._client_for(request, user), op, salted)

    async def embed(
        self, request: Request, input: str | list, dimensions: int | None = None, user: str | None = None
    ) -> Embeddings:
        salt = self.salts.salt(caller_of(request))
        return await self._client_for(request, user).embed(input, dimensions, cache_salt=salt)

    def _client_for(self, request: Request, user: str | None) -> AsyncClient:
        return self.callers.get(connection_of(request, user))

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

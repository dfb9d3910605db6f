"""What the routes share: the connections to the daemon, the callers' cache salts, the metrics, the daemon's
`info`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from kvd.gateway.auth import caller_of, models_of
from kvd.gateway.callers import CallerClients, connection_of
from kvd.gateway.choices import Job, open_streams
from kvd.gateway.errors import ApiError
from kvd.gateway.logprobs import TokenTexts
from kvd.gateway.metrics import GatewayMetrics
from kvd.gateway.response_store import ResponseStore
from kvd.gateway.salts import CacheSalts
from kvd_client import AsyncClient, AsyncStream, Embeddings

# How long the daemon's list of models stands: a request asks again after it (loads and unloads show then).
LIST_TTL_S = 1.0
# max_tokens for "to the end of the context" where the context is not known yet (a model not loaded): the
# daemon ends the output when the context is full.
UNTIL_FULL = 2**31 - 1


@dataclass
class ServedModel:
    """A model of the daemon as the gateway's routes use it."""

    name: str  # the daemon's name for it: every request for it carries it
    shown: str  # the name clients give (--served-model-name renames the daemon's first model)
    info: dict  # the daemon's info on it; empty while it is not loaded
    texts: TokenTexts  # its tokens' texts, for log-probabilities

    @property
    def context_tokens(self) -> int:
        """max_tokens for a reply that may run to the end of the context."""
        return self.info.get("max_model_len") or UNTIL_FULL


@dataclass
class Gateway:
    client: AsyncClient  # the gateway's own: info, stats, health, tokenize
    callers: CallerClients  # each caller's, for its generations and embeddings
    metrics: GatewayMetrics
    served_model_name: str | None
    started: int = 0
    salts: CacheSalts = field(default_factory=CacheSalts)
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses
    texts: dict[str, TokenTexts] = field(default_factory=dict)  # each model's, by the daemon's name
    listed: tuple[float, list[dict]] | None = None  # when the daemon last listed its models, and the list

    # Every generation and embedding goes to the daemon through these two, which salt it with its caller's
    # namespace (kvd.gateway.salts) and run it on its caller's connection (kvd.gateway.callers).

    def streams(
        self, request: Request, model: ServedModel, op: str, jobs: Sequence[Job], user: str | None = None
    ) -> list[AsyncStream]:
        caller = caller_of(request)
        salted = [
            (p, {**f, "model": model.name, "cache_salt": self.salts.salt(caller, f.get("cache_salt"))})
            for p, f in jobs
        ]
        return open_streams(self._client_for(request, user), op, salted)

    async def embed(
        self,
        request: Request,
        model: ServedModel,
        input: str | list,
        dimensions: int | None = None,
        user: str | None = None,
    ) -> Embeddings:
        salt = self.salts.salt(caller_of(request))
        return await self._client_for(request, user).embed(
            input, dimensions, cache_salt=salt, model=model.name
        )

    def _client_for(self, request: Request, user: str | None) -> AsyncClient:
        return self.callers.get(connection_of(request, user))

    async def models(self, request: Request) -> list[ServedModel]:
        """The daemon's models as it listed them within the last LIST_TTL_S (which are loaded changes as they
        load and unload; a name not in the list asks again)."""
        now = time.monotonic()
        if self.listed is None or now - self.listed[0] > LIST_TTL_S:
            self.listed = (now, await self.client.list_models())
        models = []
        for i, entry in enumerate(self.listed[1]):
            name = entry["name"]
            shown = self.served_model_name if i == 0 and self.served_model_name else name
            texts = self.texts.setdefault(name, TokenTexts(self.client, name))
            models.append(ServedModel(name, shown, entry.get("info", {}), texts))
        allowed = models_of(request)  # a key that names its models sees those alone
        return [m for m in models if allowed is None or m.shown in allowed]

    async def check_model(self, request: Request, model: str, also: tuple[str, ...] = ()) -> ServedModel:
        """The model `model` (or `model` without one of the suffixes `also`) names; else 404."""
        names = (model, *(model.removesuffix(suffix) for suffix in also if model.endswith(suffix)))
        for fresh in (False, True):
            if fresh:
                self.listed = None  # a daemon restarted with other models, say
            served = {m.shown: m for m in await self.models(request)}
            for name in names:
                if name in served:
                    return served[name]
        raise ApiError(
            404,
            f"model {model!r} is not served here; it serves {', '.join(map(repr, served))}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway

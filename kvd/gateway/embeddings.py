"""/v1/embeddings: the daemon's `embed` in OpenAI's shape, as floats or base64 little-endian float32."""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from kvd.gateway.errors import from_kvd_error, invalid_fields
from kvd.gateway.schemas import Strict
from kvd.gateway.state import gateway_of
from kvd_client import KvdError

router = APIRouter()


class EmbeddingRequest(Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # the caller, for the daemon's fair share (kvd.gateway.callers)

    def inputs(self) -> str | list[str] | list[list[int]]:
        """The daemon's input: one list of token ids becomes a list of one."""
        if isinstance(self.input, list) and self.input and isinstance(self.input[0], int):
            return [self.input]
        return self.input


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    gateway = gateway_of(request)
    model = await gateway.check_model(request, body.model)
    if body.input == []:
        raise invalid_fields([("input", "at least one input")])
    try:
        out = await gateway.embed(request, model, body.inputs(), body.dimensions, body.user)
    except KvdError as e:
        raise from_kvd_error(e) from None
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
        for i, v in enumerate(out.embeddings)
    ]
    usage = {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}
    return {"object": "list", "data": data, "model": model.shown, "usage": usage}

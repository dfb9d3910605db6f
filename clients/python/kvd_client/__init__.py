"""Client library for the kvd daemon: msgpack over ZeroMQ, with no torch dependency."""

from kvd_client.aio import AsyncClient, AsyncStream
from kvd_client.client import Client, Stream
from kvd_client.endpoint import Endpoint, default_endpoint, resolve_endpoint
from kvd_client.errors import (
    BadRequestError,
    ClientTimeoutError,
    ClosedError,
    DaemonError,
    EndpointError,
    InternalError,
    KvdError,
    KvdTimeoutError,
    NoDaemonError,
    NotFoundError,
    OverloadedError,
    ProtocolMismatchError,
    ShuttingDownError,
    TooLargeError,
    UnsupportedVersionError,
)
from kvd_client.messages import (
    PROTOCOL_VERSION,
    Chunk,
    Completion,
    Embeddings,
    TokenLogprob,
    ToolCall,
    Usage,
)

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncClient",
    "AsyncStream",
    "BadRequestError",
    "Chunk",
    "Client",
    "ClientTimeoutError",
    "ClosedError",
    "Completion",
    "DaemonError",
    "Embeddings",
    "Endpoint",
    "EndpointError",
    "InternalError",
    "KvdError",
    "KvdTimeoutError",
    "NoDaemonError",
    "NotFoundError",
    "OverloadedError",
    "ProtocolMismatchError",
    "ShuttingDownError",
    "Stream",
    "TokenLogprob",
    "TooLargeError",
    "ToolCall",
    "UnsupportedVersionError",
    "Usage",
    "default_endpoint",
    "resolve_endpoint",
]

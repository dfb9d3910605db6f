"""The daemon's own settings (the engine's are EngineArgs): where it listens and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass

# How often a client with requests in flight hears from the daemon at least (see docs/protocol.md, liveness).
HEARTBEAT_INTERVAL_S = 1.0


class ServerConfigError(ValueError):
    """A daemon setting is invalid; the message names the flag."""


@dataclass
class ServerConfig:
    listen: str | None = None  # None: the per-user default endpoint (kvd_client.endpoint)
    socket_group: str | None = None  # ipc only: socket mode 0660 with this group instead of 0600
    events: str | None = None  # where to publish the event stream (ipc:// or tcp://); None: no events
    allow_remote: bool = False  # permit a tcp (or --http) address that is not loopback
    http: str | None = None  # HOST:PORT of an OpenAI-compatible gateway run beside the daemon; None: none
    shared_prefix_cache: bool = False  # let different users share cached prompt blocks (single-tenant hosts)
    drain_timeout: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    client_timeout: float = 10.0  # seconds a client may leave replies unread (or a tcp peer stay silent)
    max_message_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: the model's max_model_len - 1
    max_queued_per_client: int = 256  # generate/chat requests in flight per client
    max_queued: int = 4096  # in flight over all clients
    max_running_per_client: int | None = None  # requests per client in the engine at once; None: no cap
    max_blocks_per_client: int | None = (
        None  # KV blocks a client's requests may hold before more are admitted
    )

    def __post_init__(self) -> None:
        for name in ("drain_timeout", "client_timeout"):
            if not getattr(self, name) > 0:
                raise ServerConfigError(
                    f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}"
                )
        for name in (
            "max_message_bytes",
            "max_prompt_tokens",
            "max_queued_per_client",
            "max_queued",
            "max_running_per_client",
            "max_blocks_per_client",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ServerConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_message_bytes < 1024:
            raise ServerConfigError(f"--max-message-bytes must be >= 1024, got {self.max_message_bytes}")

    @property
    def socket_max_message_bytes(self) -> int:
        """ZMQ_MAXMSGSIZE: messages between the limit and this get a too_large reply; larger ones are dropped
        by libzmq (it disconnects the sender) before they cost any memory."""
        return 2 * self.max_message_bytes + 65536

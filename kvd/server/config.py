"""The daemon's own settings (the engine's are EngineArgs): where it listens and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.engine.engine_args import parse_size
from kvd.gateway.server import DEFAULT_HTTP
from kvd.settings import parse_duration, setting

# How often a client with requests in flight hears from the daemon at least (see docs/protocol.md, liveness).
HEARTBEAT_INTERVAL_S = 1.0

MAX_TIMEOUT_S = 86400.0


class ServerConfigError(ValueError):
    """A daemon setting is invalid; the message names the flag."""


@dataclass
class ServerConfig:
    """The daemon's settings; each field's help is its `kvd serve` flag's (kvd.settings)."""

    listen: str | None = setting(
        None, "ipc://PATH, tcp://127.0.0.1:PORT or tcp://[::1]:PORT (default: $KVD_ENDPOINT or per-user)"
    )
    socket_group: str | None = setting(None, "make the ipc socket 0660 with this group (default: 0600)")
    events: str | None = setting(
        None, "publish queued/scheduled/preempted/finished events on this endpoint (default: off)"
    )
    allow_remote: bool = setting(False, "permit a non-loopback tcp or --http address")
    http: str | None = setting(
        None,
        f"also run the OpenAI-compatible HTTP gateway (kvd gateway) there, e.g. {DEFAULT_HTTP} (default: off)",
        metavar="HOST:PORT",
    )
    models_dir: str | None = setting(
        None, "also serve every GGUF file and model folder in this folder (named by file stem or folder name)"
    )
    max_loaded_models: int | None = setting(
        3, "models loaded at once; to load another the least recently used idle one is unloaded (%(default)s)"
    )
    keep_alive: float = setting(
        300.0,
        "how long a model loaded on demand stays loaded once idle: seconds or 30s, 5m, 1h; -1 forever (5m)",
        type=parse_duration,
    )
    pin: tuple[str, ...] = setting(
        (), "keep this model loaded from start to stop (repeatable; the first model is)"
    )
    shared_prefix_cache: bool = setting(
        False, "let different users share cached prompt prefixes (trusted single-tenant hosts only)"
    )
    drain_timeout: float = setting(30.0, "seconds to finish on SIGTERM (%(default)s)")
    # Also how long a tcp peer may stay silent.
    client_timeout: float = setting(10.0, "seconds a client may leave replies unread (%(default)s)")
    max_message_bytes: int = setting(1 << 20, "request size limit (%(default)s)", type=parse_size)
    max_prompt_tokens: int | None = setting(None, "prompt length limit (default: max_model_len - 1)")
    max_queued_per_client: int = setting(256, "requests in flight per client (%(default)s)")
    max_queued: int = setting(4096, "requests in flight in total (%(default)s)")
    # Per user (uid), across its connections: opening more connections buys no more of the daemon.
    max_queued_per_tenant: int = setting(1024, "requests in flight per user, all its clients (%(default)s)")
    max_clients_per_tenant: int = setting(64, "clients with requests in flight per user (%(default)s)")
    max_running_per_client: int | None = setting(
        None, "requests per client in the engine at once; the rest wait their turn (default: no cap)"
    )
    max_blocks_per_client: int | None = setting(
        None, "KV blocks one client's requests may hold; more of them wait (default: no cap)"
    )

    def __post_init__(self) -> None:
        for name in ("drain_timeout", "client_timeout"):
            # At most a day: ZeroMQ takes the client timeout in int milliseconds, and inf is no timeout.
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:
                raise ServerConfigError(
                    f"--{name.replace('_', '-')} must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, "
                    f"got {getattr(self, name)}"
                )
        for name in (
            "max_message_bytes",
            "max_prompt_tokens",
            "max_queued_per_client",
            "max_queued",
            "max_queued_per_tenant",
            "max_clients_per_tenant",
            "max_running_per_client",
            "max_blocks_per_client",
            "max_loaded_models",
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

"""The HTTP gateway's settings that `kvd gateway` and `kvd serve --http` share: declared once, each a flag of both
commands (kvd.settings), and handed by `kvd serve` to the gateway it starts as those same flags."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.settings import setting


@dataclass(frozen=True)
class GatewaySettings:
    served_model_name: str | None = setting(
        None, "the model id clients use (default: the daemon's model name)"
    )
    api_key_file: str | None = setting(
        None,
        "require an API key on every route but /health: one KEY or NAME:KEY a line, a file only you may read; "
        "also (or instead) $KVD_API_KEY",
        metavar="FILE",
    )
    allowed_host: tuple[str, ...] = setting(
        (),
        "serve requests whose Host is NAME, besides loopback ones (repeatable; '*' allows any: unsafe, web pages "
        "may then reach the gateway through DNS rebinding)",
        metavar="NAME",
    )
    uds: str | None = setting(
        None,
        "also serve HTTP on this unix socket, mode 0660 (kvd gateway: alone without --http); for local callers",
        metavar="PATH",
    )

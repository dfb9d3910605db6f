"""Who a peer is (its tenant), and the prefix-cache salt that keeps tenants from sharing cached blocks.

A shared prefix cache is a timing side channel: a fast first token tells a client that someone else sent the
same prompt prefix recently. So by default each tenant's prompts hash into its own cache namespace."""

from __future__ import annotations

import os
import re

# libzmq reports an ipc peer as "localhost:UID:GID:PID" (SO_PEERCRED, read when the peer connected).
_IPC_PEER = re.compile(r"^localhost:(\d+):(\d+):(\d+)$")
# Peers without OS credentials (tcp, or ipc where the OS reports none) are one tenant between them.
ANONYMOUS_TENANT = "tcp"


def peer_tenant(peer_address: str | None) -> str:
    """The tenant of a message's Peer-Address property: "uid:N" for a local process, else "tcp"."""
    match = _IPC_PEER.match(peer_address or "")
    return f"uid:{match.group(1)}" if match else ANONYMOUS_TENANT


def cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The engine's salt: the tenant (None with --shared-prefix-cache) and the client's own salt on top.

    The separator cannot occur in a tenant name, so no client salt can impersonate another tenant."""
    if tenant is None:
        return client_salt
    return tenant if client_salt is None else f"{tenant}\0{client_salt}"


def owner_tenant() -> str:
    """The daemon's own user, who sees every tenant's activity (stats) and the whole `info`."""
    return f"uid:{os.getuid()}"


def visible_info(info: dict, tenant: str) -> dict:
    """A model's `info` as `tenant` may see it: where tensor-parallel ranks meet is the owner's business (the
    rendezvous is no door for other users)."""
    if tenant != owner_tenant() and info.get("tensor_parallel"):
        info = info | {"tensor_parallel": {k: v for k, v in info["tensor_parallel"].items() if k != "init"}}
    return info

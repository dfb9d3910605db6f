"""Each HTTP caller's prefix-cache namespace, as the `cache_salt` of its requests to the daemon.

The daemon keeps one namespace per OS user, and the gateway's connections are all its own user's: without a
salt every HTTP caller would share one prefix cache, and a caller could tell from `cached_tokens` (or from a
quick first token) which prompt prefixes another sent recently. So the gateway salts every request with an
HMAC of a secret and the caller's identity (kvd.gateway.auth), which no caller can compute or choose."""

from __future__ import annotations

import hashlib
import hmac
import secrets


class CacheSalts:
    def __init__(self, secret: bytes | None = None) -> None:
        # New at each start of the gateway: a restart changes every namespace, which costs only cache hits.
        self.secret = secret if secret is not None else secrets.token_bytes(32)

    def salt(self, caller: str, client_salt: str | None = None) -> str:
        """The caller's salt; with the client's own `cache_salt`, a namespace inside the caller's.

        The client's salt is an HMAC message under the caller's key rather than text beside it, so no salt a
        client sends reaches another caller's namespace, and the result stays 64 characters (the daemon takes
        salts up to 256)."""
        caller_key = hmac.new(self.secret, caller.encode(), hashlib.sha256).digest()
        if client_salt is None:
            return caller_key.hex()
        return hmac.new(caller_key, client_salt.encode(), hashlib.sha256).hexdigest()

"""The gateway's API keys: read from `--api-key-file` and `$KVD_API_KEY` at start, and matched in constant time.

A key is never a flag's value, since flags show in `ps`. Each key has a name, the caller's identity: the name
keys its prefix-cache namespace (kvd.gateway.salts), so two keys with one name share a namespace. A key may name
the models it may use (`NAME:KEY models=a,b`); without a list, every model."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kvd.gateway.server import GatewayConfigError

ENV_KEY = "KVD_API_KEY"
MIN_KEY_CHARS = 16  # the gateway does not limit attempts: a short key could be guessed
# A name of the file's: no "$" or "#", so it never equals the names given below to the other keys.
_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


# A key's models: the names it may use, or None for every model.
Models = frozenset[str] | None


@dataclass
class ApiKeys:
    keys: list[tuple[bytes, str, Models]] = field(
        default_factory=list
    )  # (key, its caller's name, its models)

    def find(self, candidate: bytes) -> tuple[str, Models] | None:
        """The name and models of the key `candidate` is, else None. Every key is compared in full
        (hmac.compare_digest), so the time taken does not tell how much of a key was right, nor which was close."""
        found = None
        for key, name, models in self.keys:
            if hmac.compare_digest(candidate, key) and found is None:
                found = (name, models)
        return found

    def add(self, key: str, name: str, where: str, models: Models = None) -> None:
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise GatewayConfigError(
                f"{where}: a key must be at least {MIN_KEY_CHARS} characters without spaces "
                "(make one with `openssl rand -hex 32`)"
            )
        encoded = key.encode()
        if any(hmac.compare_digest(encoded, k) for k, _, _ in self.keys):
            raise GatewayConfigError(f"{where}: this key is given twice; each caller needs a key of its own")
        self.keys.append((encoded, name, models))


def load_api_keys(key_file: str | None, env_key: str | None) -> ApiKeys | None:
    """The keys of `key_file` and of `env_key` (the value of $KVD_API_KEY); None when neither gives one."""
    keys = ApiKeys()
    if key_file is not None:
        for number, line in enumerate(_read_private(Path(key_file)).splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            where = f"--api-key-file {key_file}, line {number}"
            line, models = _models(line, where)
            name, sep, key = line.partition(":")
            if not sep:
                name, key = _unnamed(line), line
            elif not _NAME.match(name):
                raise GatewayConfigError(
                    f"{where}: a name is 1 to 64 letters, digits and . _ @ - (the line is NAME:KEY or KEY)"
                )
            keys.add(key, name, where, models)
        if not keys.keys:
            raise GatewayConfigError(
                f"--api-key-file {key_file} holds no key; write one key (or NAME:KEY) a line"
            )
    if env_key:
        keys.add(env_key, f"${ENV_KEY}", f"${ENV_KEY}")
    return keys if keys.keys else None


def _models(line: str, where: str) -> tuple[str, Models]:
    """The line without its `models=a,b` part, and those models (None without one)."""
    key, *rest = line.split()
    if not rest:
        return key, None
    listed = rest[0].removeprefix("models=")
    names = frozenset(n for n in listed.split(",") if n)
    if len(rest) > 1 or not rest[0].startswith("models=") or not names:
        raise GatewayConfigError(f"{where}: a line is NAME:KEY or KEY, then optionally models=NAME,NAME")
    return key, names


def _unnamed(key: str) -> str:
    # Named by a digest, so that the name (and the caller's cache namespace) stays when lines move.
    return "#" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _read_private(path: Path) -> str:
    """The file's text, if only this user may read or change it: a key file others can read gives the keys away."""
    try:
        # Non-blocking: a FIFO in its place is refused below rather than waited on.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), encoding="utf-8") as f:
            st = os.fstat(f.fileno())  # of the file opened, not of whatever the path names a moment later
            if not stat.S_ISREG(st.st_mode):
                raise GatewayConfigError(f"--api-key-file {path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise GatewayConfigError(
                    f"--api-key-file {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                    f"run `chown {os.geteuid()} {path} && chmod 600 {path}` or use a file of your own"
                )
            if st.st_mode & 0o077:
                raise GatewayConfigError(
                    f"--api-key-file {path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                    f"run `chmod 600 {path}`"
                )
            return f.read()
    except OSError as e:
        raise GatewayConfigError(f"--api-key-file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise GatewayConfigError(f"--api-key-file {path} is not UTF-8 text") from None

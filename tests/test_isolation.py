"""Prefix-cache isolation: different users (uids on the ipc socket) never hit each other's cached blocks."""

from __future__ import annotations

import grp
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import NOBODY, DaemonProcess, run_as_nobody, start_daemon

from kvd.server.isolation import ANONYMOUS_TENANT, cache_salt, peer_tenant
from kvd_client import Client

OTHER_UID = NOBODY  # its primary group (nogroup) may use the socket
OTHER_GROUP = grp.getgrgid(OTHER_UID).gr_name
IS_ROOT = os.geteuid() == 0
# A prompt of several KV blocks (block size 16), so that a hit shows as dozens of cached tokens.
BODY = " ".join(f"word{i}" for i in range(60))


def _cached_tokens(endpoint: str, prompt: str, salt: str | None) -> int:
    with Client(endpoint, timeout=30) as client:
        return client.generate(prompt, max_tokens=1, temperature=0.0, cache_salt=salt).usage.cached_tokens


def cached_tokens(
    daemon: DaemonProcess, prompt: str, salt: str | None = None, other_user: bool = False
) -> int:
    """usage.cached_tokens of a one-token generation; `other_user`: from a child process running as nobody."""
    if not other_user:
        return _cached_tokens(daemon.endpoint, prompt, salt)
    return int(run_as_nobody(lambda: str(_cached_tokens(daemon.endpoint, prompt, salt)).encode()))


def _open_dir() -> Path:
    """A directory every user can traverse: the socket's own mode (0660, group nogroup) is the gate."""
    folder = Path(tempfile.mkdtemp(prefix="kvd-isolation-"))
    folder.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def daemons(tiny_daemon_model: Path) -> Iterator[dict[str, DaemonProcess]]:
    """The default (per-user cache) and a --shared-prefix-cache daemon, both open to group nogroup."""
    group = ("--socket-group", OTHER_GROUP) if IS_ROOT else ()
    isolated = start_daemon(_open_dir(), *group, model=tiny_daemon_model)
    try:
        shared = start_daemon(_open_dir(), *group, "--shared-prefix-cache", model=tiny_daemon_model)
    except BaseException:
        isolated.stop()
        raise
    yield {"isolated": isolated, "shared": shared}
    for daemon in (isolated, shared):
        assert daemon.stop() == 0, daemon.log()
        shutil.rmtree(Path(daemon.log_path).parent)


def test_the_same_user_hits_its_own_cache_and_a_client_salt_separates(daemons):
    daemon = daemons["isolated"]
    prompt = "salt test: " + BODY
    assert cached_tokens(daemon, prompt) == 0
    assert cached_tokens(daemon, prompt) >= 48
    assert cached_tokens(daemon, prompt, salt="tenant-a") == 0
    assert cached_tokens(daemon, prompt, salt="tenant-a") >= 48
    assert cached_tokens(daemon, prompt, salt="tenant-b") == 0


@pytest.mark.skipif(not IS_ROOT, reason="switching to another uid needs root; peer_tenant is tested below")
def test_two_users_do_not_share_cached_blocks_by_default(daemons):
    daemon = daemons["isolated"]
    prompt = "uid test: " + BODY
    assert cached_tokens(daemon, prompt) == 0
    assert cached_tokens(daemon, prompt, other_user=True) == 0
    assert cached_tokens(daemon, prompt, other_user=True) >= 48
    assert cached_tokens(daemon, prompt) >= 48


@pytest.mark.skipif(not IS_ROOT, reason="switching to another uid needs root; peer_tenant is tested below")
def test_shared_prefix_cache_lets_users_share(daemons):
    daemon = daemons["shared"]
    prompt = "shared test: " + BODY
    assert cached_tokens(daemon, prompt) == 0
    assert cached_tokens(daemon, prompt, other_user=True) >= 48
    # A client salt still separates on a shared daemon.
    assert cached_tokens(daemon, prompt, salt="mine", other_user=True) == 0


def test_the_tenant_comes_from_the_peers_uid():
    assert peer_tenant("localhost:1000:1000:4242") == "uid:1000"
    assert peer_tenant("localhost:1000:100:7") == peer_tenant("localhost:1000:5:8")  # one user, any process
    assert peer_tenant("127.0.0.1") == peer_tenant("::1") == peer_tenant(None) == ANONYMOUS_TENANT


def test_the_cache_salt_combines_tenant_and_client_salt():
    assert cache_salt("uid:1", None) != cache_salt("uid:2", None)
    assert cache_salt("uid:1", "x") not in (cache_salt("uid:1", None), cache_salt("uid:2", "x"), "x")
    assert cache_salt(None, None) is None and cache_salt(None, "x") == "x"
    # A client cannot pick a salt that lands in another tenant's namespace.
    assert cache_salt("uid:1", "uid:2") != cache_salt("uid:2", None)

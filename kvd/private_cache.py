"""kvd's cache folders: found the same way for every cache (native kernels, torch.compile, Triton), and used
only when no other user can change them.

What lies in these folders is code this process runs (a shared object, generated Python and kernels), so a
folder is taken only if it is ours, not a symlink, and writable by no one else; otherwise kvd warns and uses a
fresh private folder. torch.compile and Triton default to `/tmp/torchinductor_$USER` and `~/.triton`, which
they never check: another user could create the first in advance and plant code there.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# The compilers' own settings for their cache folders, and kvd's sub-folder for each.
COMPILER_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def private(path: Path) -> bool:
    """Whether only this user (or root) can change `path`: not a symlink, owned by us, no group/other write bit."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
        return False
    return not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def refuse(path: Path, what: str) -> None:
    """Warn that `path` is not private, and why."""
    try:
        st = os.lstat(path)
        why = f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
    except OSError as e:
        why = e.strerror
    log.warning(
        "refusing %s %s for kvd's caches (%s): it must be owned by uid %d and writable by no one else",
        what,
        path,
        why,
        os.getuid(),
    )


def _roots() -> list[Path]:
    """Cache roots in order: $KVD_CACHE_DIR, systemd's $CACHE_DIRECTORY, $XDG_CACHE_HOME/kvd, ~/.cache/kvd."""
    roots = [
        os.environ.get("KVD_CACHE_DIR"),
        os.environ.get("CACHE_DIRECTORY", "").split(":")[0] or None,
        os.environ.get("XDG_CACHE_HOME") and str(Path(os.environ["XDG_CACHE_HOME"]) / "kvd"),
        str(Path.home() / ".cache" / "kvd"),
    ]
    return [Path(root) for root in roots if root]


def private_dir(name: str) -> Path:
    """The first private, writable `<root>/<name>`, else `<tmp>/kvd-<name>-<uid>` if private, else a fresh
    folder for this process."""
    for path in [
        *(root / name for root in _roots()),
        Path(tempfile.gettempdir()) / f"kvd-{name}-{os.getuid()}",
    ]:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if not private(path):
            refuse(path, "the cache folder")
        elif os.access(path, os.W_OK):
            return path
    fresh = Path(tempfile.mkdtemp(prefix=f"kvd-{name}-"))
    log.warning("using %s for kvd's %s cache, for this process only", fresh, name)
    return fresh


@cache
def pin_compiler_caches() -> None:
    """Point torch.compile's and Triton's caches at vetted folders before torch reads its settings; a folder
    the operator set is kept if it is private, and replaced (with a warning) if not. Called where kvd's
    torch-importing packages are first imported, so every entry point (daemon, `kvd.LLM`, tensor-parallel
    workers, benchmarks) has it; child processes inherit the environment."""
    for variable, name in COMPILER_CACHES.items():
        chosen = os.environ.get(variable)
        if chosen and private(Path(chosen)):
            continue
        if chosen:
            refuse(Path(chosen), f"${variable}")
        os.environ[variable] = str(private_dir(name))

"""Builds kvd's native CPU kernels (the C files beside this module) on this host, caches the library safely,
and loads it.

The C files are compiled (side by side, one per core) and linked into one library, once per source, compiler, flags and CPU (-march=native, so
AVX2/AVX-512 are used where the CPU has them), into a cache folder, then opened with cffi, whose declarations are
read from cpu_kernels.h: the ABI is written once. A shared object runs code in this process, so one is loaded
only from a folder and a file that no other user can change (owned by this user, not writable by group or
others, not a symlink); otherwise the cache is refused, with a warning, and the kernels are built into a fresh
private folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from cffi import FFI

from kvd.private_cache import private, private_dir, refuse

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent
# Every C file here is a part of the one library (a file per concern: the linears, attention, the layer loop);
# the headers are its ABI (cpu_kernels.h) and what its files share (cpu_internal.h). Found in the folder, not
# listed, so that a file added is built and a header added is in the cache key.
SOURCES = sorted(KERNELS.glob("*.c"))
HEADERS = sorted(KERNELS.glob("*.h"))
HEADER = KERNELS / "cpu_kernels.h"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def declarations() -> str:
    """The header's declarations between its cffi markers (no preprocessor lines: cffi takes plain C)."""
    text = HEADER.read_text()
    return text.split("// cffi: begin", 1)[1].split("// cffi: end", 1)[0]


ffi = FFI()
ffi.cdef(declarations())


def extra_flags() -> list[str]:
    """$KVD_NATIVE_CFLAGS: flags after kvd's own, e.g. `-mno-avx2` to build and test the portable C paths."""
    return shlex.split(os.environ.get("KVD_NATIVE_CFLAGS", ""))


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def compile_sources(compiler: str, sources: list[Path], target: Path, extra: list[str]) -> None:
    """Builds the C files `sources` into the shared library `target` with kvd's flags and then `extra`; OSError
    on failure. Each file is compiled on its own, as many at once as there are cores, then linked: the same
    objects as one compiler call makes, in a fraction of its time."""
    flags = [*FLAGS, *extra]
    with tempfile.TemporaryDirectory() as folder:
        objects = [Path(folder) / f"{source.stem}.o" for source in sources]
        commands = [
            [compiler, *flags, "-c", str(s), "-o", str(o)] for s, o in zip(sources, objects, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            failed = [r for r in pool.map(_run, commands) if r.returncode != 0]
        if not failed:
            link = _run([compiler, *flags, *map(str, objects), "-o", str(target), "-lm"])
            failed = [link] if link.returncode != 0 else []
    if failed:
        raise OSError("\n".join(r.stderr.strip() for r in failed)[-2000:])


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def source_text(files: list[Path]) -> str:
    """The files' names and texts, for the cache key: any change to a source or a header (an edit, a file added,
    removed or renamed) makes a new key, so a library built from other text is never loaded."""
    return "\0".join(f"{path.name}\0{path.read_text()}" for path in files)


def _compile(compiler: str) -> Path:
    flags = [*FLAGS, *extra_flags()]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = source_text([*SOURCES, *HEADERS])
    key = hashlib.sha256("\0".join([sources, version, _cpu_flags(), *flags]).encode()).hexdigest()[:16]
    folder = private_dir("native")
    target = folder / f"kvd_cpu_{key}.so"
    if target.exists():
        if private(target) and stat.S_ISREG(os.lstat(target).st_mode):
            return target
        refuse(target, "the cached library")
    log.info("building kvd's native CPU kernels for this host (once): %s", target)
    # Build beside the target and rename: another process may be building the same file at the same time.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        compile_sources(compiler, SOURCES, Path(tmp), extra_flags())
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@cache
def library_path() -> Path | None:
    """The built library for this host, or None (and a logged reason) when it cannot be built or the kernels
    are switched off (KVD_NATIVE=0)."""
    if os.environ.get("KVD_NATIVE", "1") == "0":
        log.info("native CPU kernels switched off (KVD_NATIVE=0): plain torch paths run")
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning(
            "no C compiler found: kvd runs its slower plain-torch CPU paths; install gcc (or set $CC) for its "
            "native CPU kernels"
        )
        return None
    try:
        return _compile(compiler)
    except OSError as exc:
        log.warning("building kvd's native CPU kernels failed, plain-torch CPU paths run instead:\n%s", exc)
        return None


@cache
def library() -> object | None:
    """The loaded kernels (a cffi library), or None when library_path() has none."""
    path = library_path()
    if path is None:
        return None
    try:
        lib = ffi.dlopen(str(path))
    except OSError as exc:
        log.warning("loading kvd's native CPU kernels failed, plain-torch CPU paths run instead: %s", exc)
        return None
    log.info("native CPU kernels loaded (%s SIMD paths): %s", isa(lib), path)
    return lib


def isa(lib: object) -> str:
    """The SIMD paths the loaded library was built with (kvd_isa)."""
    return ffi.string(lib.kvd_isa()).decode()


def native_isa() -> str | None:
    """The SIMD paths of the loaded kernels (see isa), or None where they cannot be built or are switched off."""
    lib = library()
    return None if lib is None else isa(lib)

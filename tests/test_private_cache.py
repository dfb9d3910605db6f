"""torch.compile's and Triton's caches hold code the daemon runs: kvd points them at folders no other user can
change, in every entry point, before torch reads where they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvd.private_cache import private, private_dir

# What torch and triton themselves report after kvd's engine package is imported.
REPORT = """
import json, kvd.engine
from torch._inductor.runtime.cache_dir_utils import cache_dir
from triton import knobs
print(json.dumps({"inductor": cache_dir(), "triton": knobs.cache.dir}))
"""


def compiler_caches(env: dict[str, str]) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    out = subprocess.run(
        [sys.executable, "-c", REPORT],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_compilers_caches_are_in_kvds_private_cache(tmp_path: Path):
    caches = compiler_caches({"KVD_CACHE_DIR": str(tmp_path)})
    assert Path(caches["inductor"]) == tmp_path / "inductor"
    assert Path(caches["triton"]) == tmp_path / "triton"
    assert all(private(Path(path)) for path in caches.values())


def test_a_cache_folder_others_can_write_is_replaced(tmp_path: Path):
    planted = tmp_path / "planted"
    planted.mkdir()
    planted.chmod(0o777)
    caches = compiler_caches(
        {"KVD_CACHE_DIR": str(tmp_path / "kvd"), "TORCHINDUCTOR_CACHE_DIR": str(planted)}
    )
    assert Path(caches["inductor"]) == tmp_path / "kvd" / "inductor"
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert compiler_caches({"TORCHINDUCTOR_CACHE_DIR": str(mine)})["inductor"] == str(mine)


def test_a_shared_root_falls_back_to_a_private_folder(tmp_path: Path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "triton").mkdir(mode=0o777)
    (shared / "triton").chmod(0o777)
    monkeypatch.setenv("KVD_CACHE_DIR", str(shared))
    chosen = private_dir("triton")
    assert chosen != shared / "triton" and private(chosen)

"""systemd/: the unit passes systemd-analyze, the sysusers file makes user and group kvd, the example config
names every `kvd serve` flag with a value that flag accepts."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_fixtures import REPO

from kvd.cli import build_parser

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "kvd.service"
INSTALLED_KVD = "/usr/local/bin/kvd"


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this environment's kvd: verify checks that the binary exists."""
    kvd = Path(sys.executable).parent / "kvd"
    assert kvd.exists(), f"{kvd} is missing: install kvd into this environment (make install)"
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_KVD} serve " in text
    copy = tmp_path / "kvd.service"
    copy.write_text(text.replace(INSTALLED_KVD, str(kvd)))
    return copy


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60)


def complaints(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines of systemd-analyze's output about kvd.service (it may also talk about the host's units)."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "kvd.service" in line]


def test_the_unit_verifies_without_errors_or_warnings(unit_copy: Path):
    proc = analyze("verify", str(unit_copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert complaints(proc) == []
    # The check sees defects: a misspelt key is only a warning, which the assertion above must catch.
    unit_copy.write_text(unit_copy.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict"))
    assert any("ProtectSytem" in line for line in complaints(analyze("verify", str(unit_copy))))


def test_the_sandbox_is_tight_and_leaves_cuda_working(unit_copy: Path):
    proc = analyze("security", "--offline=yes", str(unit_copy))
    match = re.search(r"Overall exposure level for kvd\.service: (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) <= 4.0, proc.stdout
    settings = dict(re.findall(r"^(\w+)=(.*)$", UNIT.read_text(), re.M))
    # CUDA needs /dev/nvidia*; torch and Triton JIT-compile kernels into executable memory.
    assert "PrivateDevices" not in settings and "MemoryDenyWriteExecute" not in settings
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"


@pytest.mark.parametrize("name", ["kvd.service", "kvd-gateway.service"])
def test_a_configuration_error_is_not_restarted_forever(tmp_path: Path, name: str):
    """Exit status 2 (a bad flag, config or model path) would fail again on every restart."""
    kvd = Path(sys.executable).parent / "kvd"
    for unit in ("kvd.service", name):  # the gateway's unit requires the daemon's
        (tmp_path / unit).write_text((SYSTEMD / unit).read_text().replace(INSTALLED_KVD, str(kvd)))
    copy = tmp_path / name
    proc = analyze("verify", str(copy))
    assert proc.returncode == 0 and complaints(proc) == [], proc.stdout + proc.stderr
    settings = dict(re.findall(r"^(\w+)=(.*)$", copy.read_text(), re.M))
    assert settings["Restart"] == "on-failure" and settings["RestartPreventExitStatus"] == "2"


def test_sysusers_creates_the_user_and_group_kvd(tmp_path: Path):
    (tmp_path / "etc").mkdir()
    subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "kvd.sysusers")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    users = {
        line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {
        line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    assert users["kvd"][3] == groups["kvd"][2], "kvd's primary group is kvd"
    assert users["kvd"][6] == "/usr/sbin/nologin"


def serve_flags() -> dict[str, argparse.Action]:
    """`kvd serve`'s options by their first name without the dashes (not aliases such as --threads);
    --config names the file itself."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = {}
    for action in serve._actions:
        names = [s for s in action.option_strings if s.startswith("--")]
        if names:
            flags[names[0][2:]] = action
    flags.pop("help")
    flags.pop("config", None)
    return flags


def test_the_example_config_sets_every_serve_flag_with_a_value_it_accepts():
    import tomllib

    example = (SYSTEMD / "kvd.toml.example").read_text()
    settings = tomllib.loads("\n".join(re.findall(r"^# ([a-z][a-z0-9-]* = .*)$", example, re.M)))
    flags = serve_flags()
    assert sorted(settings) == sorted(flags)
    for name, value in settings.items():
        action = flags[name]
        if isinstance(action, argparse._StoreTrueAction):
            assert isinstance(value, bool), name
        else:
            assert not isinstance(value, bool), name
            converted = action.type(str(value)) if action.type else str(value)
            assert action.choices is None or converted in action.choices, name

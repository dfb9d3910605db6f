"""systemd/: the units pass systemd-analyze and keep their limits and filters, the sysusers file makes the users
kvd and kvd-gateway and group kvd, the example config names every `kvd serve` flag with a value that flag
accepts."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_fixtures import REPO

from kvd.cli import build_parser
from kvd.server.config import ServerConfig
from kvd.server.serve import STOP_MARGIN_S

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "kvd.service"
GATEWAY_UNIT = SYSTEMD / "kvd-gateway.service"
INSTALLED_KVD = "/usr/local/bin/kvd"


def directives(path: Path) -> dict[str, list[str]]:
    """Every `Key=value` line of a unit, by key, in order (Environment= and DeviceAllow= may repeat)."""
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"^(\w+)=(.*)$", path.read_text(), re.M):
        found.setdefault(key, []).append(value)
    return found


def exposure(unit: Path) -> float:
    proc = analyze("security", "--offline=yes", str(unit))
    match = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    return float(match.group(1))


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
    # 3.3 before the resource limits and the device, system call and IP filters; 1.7 with systemd 252.
    assert exposure(unit_copy) <= 2.0
    settings = dict(re.findall(r"^(\w+)=(.*)$", UNIT.read_text(), re.M))
    # CUDA needs /dev/nvidia*; torch and Triton JIT-compile kernels into executable memory.
    assert "PrivateDevices" not in settings and "MemoryDenyWriteExecute" not in settings
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"


def test_the_stop_timeout_bounds_a_silent_daemon_with_the_default_drain():
    """A daemon that reports asks for --drain-timeout + STOP_MARGIN_S when it stops (tests/test_systemd_notify.py);
    TimeoutStopSec is what a daemon that never reports gets: the same rule at the default drain-timeout."""
    (timeout,) = directives(UNIT)["TimeoutStopSec"]
    assert float(timeout) == ServerConfig().drain_timeout + STOP_MARGIN_S
    comment = re.search(r"((?:^#.*\n)+)TimeoutStopSec=", UNIT.read_text(), re.M).group(1)
    assert "EXTEND_TIMEOUT_USEC" in comment and "drain-timeout" in comment  # the rule, where operators look


def test_the_daemon_has_resource_limits_and_device_syscall_and_ip_filters():
    found = directives(UNIT)
    expected = {
        "MemoryMax": ["90%"],
        "TasksMax": ["512"],
        "LimitNOFILE": ["65536"],
        "DevicePolicy": ["closed"],
        "SystemCallFilter": ["@system-service"],
        "SystemCallErrorNumber": ["EPERM"],
        "SystemCallArchitectures": ["native"],
        "IPAddressDeny": ["any"],
        "IPAddressAllow": ["localhost"],
    }
    assert {key: found.get(key) for key in expected} == expected
    # A CPU daemon opens only the pseudo devices that DevicePolicy=closed allows; GPUs come in a drop-in.
    assert "DeviceAllow" not in found
    # The tensor-parallel ranks' gloo and NCCL sockets stay on the loopback that IPAddressAllow= lets through.
    environment = " ".join(found["Environment"]).split()
    assert "GLOO_SOCKET_IFNAME=lo" in environment and "NCCL_SOCKET_IFNAME=lo" in environment


def drop_in_examples(unit: Path) -> list[str]:
    """The drop-ins that the unit's comments show, each as a file's text: runs of `#   ` lines."""
    examples, current = [], []
    for line in [*unit.read_text().splitlines(), ""]:
        if line.startswith("#   "):
            current.append(line[4:])
        elif current:
            text = "\n".join(current) + "\n"
            examples.append(text if text.startswith("[") else "[Service]\n" + text)
            current = []
    return examples


def test_the_drop_ins_the_unit_suggests_verify(unit_copy: Path):
    """The NVIDIA devices and the multi-host network, as an operator would paste them into `systemctl edit`."""
    examples = drop_in_examples(UNIT)
    assert any("DeviceAllow=char-nvidia* rw" in text and "modprobe@nvidia-uvm" in text for text in examples)
    assert any("IPAddressAllow=" in text for text in examples)
    drop_ins = unit_copy.parent / "kvd.service.d"
    drop_ins.mkdir()
    for i, text in enumerate(examples):
        (drop_ins / f"{i}.conf").write_text(text)
    proc = analyze("verify", str(unit_copy))
    assert proc.returncode == 0 and complaints(proc) == [], proc.stdout + proc.stderr
    # Verify reads them: a misspelt key in one is reported.
    (drop_ins / "0.conf").write_text("[Service]\nDeviceAlow=char-nvidia* rw\n")
    assert any("DeviceAlow" in line for line in complaints(analyze("verify", str(unit_copy))))


def test_the_gateway_runs_as_its_own_user_with_limits_and_filters(tmp_path: Path):
    daemon, gateway = directives(UNIT), directives(GATEWAY_UNIT)
    assert gateway["User"] == ["kvd-gateway"] != daemon["User"]
    assert gateway["Group"] == ["kvd-gateway"] != daemon["Group"]
    assert gateway["SupplementaryGroups"] == ["kvd"]  # the daemon's socket is 0660, group kvd
    expected = {
        "MemoryMax": ["2G"],
        "TasksMax": ["128"],
        "LimitNOFILE": ["65536"],
        "SystemCallFilter": ["@system-service"],
        "SystemCallErrorNumber": ["EPERM"],
        "SystemCallArchitectures": ["native"],
        "IPAddressDeny": ["any"],
        "IPAddressAllow": ["localhost"],
        "PrivateDevices": ["yes"],
        "MemoryDenyWriteExecute": ["yes"],
        "RemoveIPC": ["yes"],
    }
    assert {key: gateway.get(key) for key in expected} == expected
    kvd = Path(sys.executable).parent / "kvd"
    for unit in ("kvd.service", "kvd-gateway.service"):
        (tmp_path / unit).write_text((SYSTEMD / unit).read_text().replace(INSTALLED_KVD, str(kvd)))
    assert exposure(tmp_path / "kvd-gateway.service") <= 1.7  # 1.7 before; 1.5 with systemd 252


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


def test_sysusers_creates_the_users_and_group_kvd(tmp_path: Path):
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
    # The gateway's user: its own primary group, a member of kvd (to reach the socket), no login.
    assert users["kvd-gateway"][2] != users["kvd"][2]
    assert users["kvd-gateway"][3] == groups["kvd-gateway"][2] != groups["kvd"][2]
    assert "kvd-gateway" in groups["kvd"][3].split(",")
    assert users["kvd-gateway"][6] == "/usr/sbin/nologin"


def serve_flags() -> dict[str, argparse.Action]:
    """`kvd serve`'s options by their first name without the dashes (not aliases such as --threads, nor a
    boolean's opposite such as --no-enforce-eager); --config names the file itself."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = {}
    for action in serve._actions:
        names = [s for s in action.option_strings if s.startswith("--")]
        if names and not isinstance(action, argparse._StoreFalseAction):  # a boolean's opposite: one setting
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
    # The [[models]] example: a table of a model's own settings.
    from kvd.server.model_specs import MODEL_SETTINGS

    table = tomllib.loads("\n".join(re.findall(r"^#   ([a-z_]+ = .*)$", example, re.M)))
    assert "# [[models]]" in example and {"name", "path"} <= set(table) <= {
        "name",
        "path",
        "pinned",
        *MODEL_SETTINGS,
    }

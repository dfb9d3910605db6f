"""`kvd serve` under a service manager: sd_notify messages in order, and settings from a TOML config file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_fixtures import REPO, daemon_env, start_daemon

from kvd.cli import build_parser, main
from kvd.server.config_file import ConfigFileError, apply_config_file
from kvd.server.serve import STOP_MARGIN_S
from kvd.server.systemd import Notifier


def _serve_parser():
    parser = build_parser()
    return parser, next(a for a in parser._actions if a.dest == "command").choices["serve"]


def receive_all(sock: socket.socket, until: str, timeout: float) -> list[str]:
    """Datagrams until one contains `until` (or `timeout` seconds of silence)."""
    sock.settimeout(timeout)
    messages = []
    while not messages or until not in messages[-1]:
        messages.append(sock.recv(4096).decode())
    return messages


def test_a_daemon_notifies_ready_watchdog_and_stopping_in_order(tiny_daemon_model: Path, tmp_path: Path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"@kvd-test-{os.getpid()}"  # abstract, as systemd may hand out
    notify.bind(b"\0" + name[1:].encode())
    config = tmp_path / "kvd.toml"
    # The file sets the client timeout; the command line's --drain-timeout wins over the file's. It is longer than
    # the unit's TimeoutStopSec (60): the stop timeout must follow it.
    config.write_text('client-timeout = 4.5\ndrain-timeout = 99.0\nlog-level = "debug"\n')
    env = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1000000"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        daemon = start_daemon(
            tmp_path, "--config", str(config), "--drain-timeout", "90", model=tiny_daemon_model
        )
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        with daemon.client() as client:
            limits = client.info()["limits"]
            assert limits["client_timeout_s"] == 4.5
        before_stop = receive_all(notify, "WATCHDOG=1", timeout=5)
        before_stop += receive_all(notify, "WATCHDOG=1", timeout=5)  # it keeps coming while idle
        assert daemon.stop(signal.SIGTERM) == 0, daemon.log()
        after = receive_all(notify, "STOPPING=1", timeout=5)
    finally:
        notify.close()
        daemon.stop(signal.SIGKILL)
    messages = before_stop + after
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    watchdogs = [i for i, m in enumerate(messages) if m == "WATCHDOG=1"]
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m)
    assert ready < watchdogs[0] and len(watchdogs) >= 2 and watchdogs[-1] < stopping, messages
    assert "STATUS=ready on ipc://" in messages[ready] and "0 running, 0 waiting" in messages[ready]
    assert "STATUS=draining" in messages[stopping]
    # systemd waits for the whole drain and the flush after it, whatever TimeoutStopSec says.
    fields = dict(line.split("=", 1) for line in messages[stopping].splitlines())
    assert int(fields["EXTEND_TIMEOUT_USEC"]) == (90 + STOP_MARGIN_S) * 1e6, messages[stopping]
    assert "drain" in daemon.log() and "90 s" in daemon.log()


def test_the_watchdog_is_off_for_another_pid_and_without_watchdog_usec():
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000"}).watchdog_interval == 2.0
    assert (
        Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}).watchdog_interval
        is None
    )
    assert Notifier({"NOTIFY_SOCKET": "/x"}).watchdog_interval is None
    assert not Notifier({}).enabled
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled
    Notifier({}).ready("nothing is sent")  # no socket: a no-op, not an error


def test_config_file_settings_become_defaults_that_flags_override(tmp_path: Path):
    config = tmp_path / "kvd.toml"
    config.write_text(
        'kv-cache-memory = "2G"\nmax-num-seqs = 7\nno-prefix-caching = true\nlisten = "ipc:///x"\n'
    )
    parser, serve = _serve_parser()
    apply_config_file(serve, config)
    args = parser.parse_args(["serve", "--max-num-seqs", "9"])
    assert (args.kv_cache_memory, args.max_num_seqs, args.no_prefix_caching) == (2 << 30, 9, True)
    assert args.listen == "ipc:///x"


def test_a_config_file_names_one_model_or_several_and_flags_replace_them(tmp_path: Path):
    config = tmp_path / "kvd.toml"
    parser, serve = _serve_parser()
    config.write_text('model = "a=/m/a"\n')
    apply_config_file(serve, config)
    assert parser.parse_args(["serve"]).model == ["a=/m/a"]
    assert parser.parse_args(["serve", "--model", "b=/m/b", "--model", "c"]).model == ["b=/m/b", "c"]
    parser, serve = _serve_parser()
    config.write_text('model = ["a=/m/a", "b=/m/b"]\n')
    apply_config_file(serve, config)
    assert parser.parse_args(["serve"]).model == ["a=/m/a", "b=/m/b"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-sequences = 3", "unknown setting 'max-num-sequences'"),
        ("max-num-seqs = true", "takes a single number or string"),
        ("no-prefix-caching = 1", "must be true or false"),
        ('log-level = "loud"', "must be one of debug"),
        ('kv-cache-memory = "lots"', "is not a size"),
        ("max-num-seqs = [", "not valid TOML"),
    ],
)
def test_config_file_mistakes_are_refused_with_the_key(tmp_path: Path, text: str, message: str):
    config = tmp_path / "kvd.toml"
    config.write_text(text + "\n")
    with pytest.raises(ConfigFileError, match=message):
        apply_config_file(_serve_parser()[1], config)


def test_kvd_serve_with_a_bad_config_exits_2_before_loading_anything(tmp_path: Path, capsys):
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read the config file" in capsys.readouterr().err
    config = tmp_path / "kvd.toml"
    config.write_text("drain-timeout = -1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=daemon_env(),
        timeout=60,
    )
    assert proc.returncode == 2 and "--drain-timeout must be > 0" in proc.stderr

"""Real daemons for end-to-end tests: a tiny random Llama with SmolLM2's tokenizer, `kvd serve` processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from kvd_client import Client, KvdError

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534  # the other user of the cross-user tests
TINY_KV_MEMORY = "64M"  # 8 KiB blocks for the tiny model: thousands of blocks, none of them scarce


def save_tiny_daemon_model(folder: Path) -> Path:
    """A 2-layer random Llama whose vocabulary is SmolLM2's real tokenizer (and chat template), in float32."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvd.model.gguf_loader import GGUFFile, load_gguf_tokenizer
    from kvd.model.hub import default_model_path

    tokenizer = load_gguf_tokenizer(GGUFFile(default_model_path()))
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # Peaked logits, so greedy choices do not hinge on the last bits of a batched matmul.
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_daemon_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_daemon_model(tmp_path_factory.mktemp("tiny_daemon_model"))


class DaemonProcess:
    """A `kvd serve` subprocess listening on `endpoint`; its log goes to a file."""

    def __init__(self, endpoint: str, proc: subprocess.Popen, log_path: Path) -> None:
        self.endpoint = endpoint
        self.proc = proc
        self.log_path = log_path

    def client(self, timeout: float = 30.0) -> Client:
        return Client(self.endpoint, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"the daemon ignored signal {sig} for {timeout} s; log:\n{self.log()}"
            ) from None


def daemon_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVD_ENDPOINT"}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_demo(*args: str) -> tuple[str, list[str], list[int]]:
    """`python -m kvd.demo ARGS` to its end, which must be a clean one: (its output, the assistant's replies, how
    many prompt tokens of each turn the prefix cache served)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvd.demo", *args],
        cwd=REPO,
        env=daemon_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    replies = re.findall(r"^assistant: (.+)$", out, flags=re.MULTILINE)
    cached = [int(n) for n in re.findall(r"(\d+) of them from the prefix cache", out)]
    return out, replies, cached


def start_daemon(
    workdir: Path,
    *args: str,
    model: Path | None = None,
    kv_cache_memory: str | None = TINY_KV_MEMORY,
    default_endpoint: bool = False,
    ready_timeout: float = 180.0,
    listen: str | None = None,
) -> DaemonProcess:
    """Start `kvd serve` on `model` (None: the bundled SmolLM2) and wait until it answers health ready.

    It listens on `listen`, else on ipc://WORKDIR/kvd.sock: through --listen, or with `default_endpoint`
    through the default resolution ($XDG_RUNTIME_DIR set to WORKDIR, no --listen)."""
    endpoint = listen or f"ipc://{workdir}/kvd.sock"
    env = daemon_env()
    # One torch thread: on a small shared machine more threads only contend (and in-process references use one).
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--dtype", "float32", "--threads", "1"]
    cmd += [*(["--kv-cache-memory", kv_cache_memory] if kv_cache_memory else []), *args]
    if default_endpoint:
        env["XDG_RUNTIME_DIR"] = str(workdir)
    else:
        cmd += ["--listen", endpoint]
    if model is not None:
        cmd += ["--model", str(model)]
    log_path = workdir / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    daemon = DaemonProcess(endpoint, proc, log_path)
    wait_ready(daemon, ready_timeout)
    return daemon


def wait_ready(daemon: DaemonProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with Client(daemon.endpoint, timeout=0.5) as client:
        while time.monotonic() < deadline:
            if daemon.proc.poll() is not None:
                raise AssertionError(f"the daemon exited with {daemon.proc.returncode}; log:\n{daemon.log()}")
            try:
                if client.health()["status"] == "ready":
                    return
            except KvdError:
                time.sleep(0.1)  # still loading (no socket file yet: that fails at once, so do not spin)
    daemon.stop(signal.SIGKILL)
    raise AssertionError(f"the daemon was not ready within {timeout} s; log:\n{daemon.log()}")


def free_tcp_port(host: str) -> int:
    """A port free on `host` just now: a bracketed IPv6 address ("[::1]") or an IPv4 one or name."""
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def ipv6_loopback_or_refusal() -> None:
    """Return on a host with an IPv6 loopback (the test goes on to serve over it). On one without (some
    containers), check instead that kvd serve refuses tcp://[::1] in one line before loading anything, and end
    the test there."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return
    except OSError:
        pass
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--listen", "tcp://[::1]:5555"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=60)
    assert result.returncode == 2 and "[::1]" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    pytest.skip("no IPv6 loopback on this host: kvd serve refuses tcp://[::1] in one line (checked)")


@contextlib.contextmanager
def tcp_daemon(workdir: Path, model: Path, host: str, *args: str) -> Iterator[DaemonProcess]:
    """A daemon on the tiny `model` listening on tcp://HOST:PORT (a free port); it must exit 0 on SIGTERM."""
    daemon = start_daemon(workdir, *args, model=model, listen=f"tcp://{host}:{free_tcp_port(host)}")
    try:
        yield daemon
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()


@pytest.fixture(scope="module")
def tiny_daemon(tiny_daemon_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One daemon on the tiny model per test module; it must exit 0 on SIGTERM at the end."""
    daemon = start_daemon(tmp_path_factory.mktemp("daemon"), "--client-timeout", "3", model=tiny_daemon_model)
    yield daemon
    code = daemon.stop()
    assert code == 0, daemon.log()


def raw_socket(endpoint: str) -> zmq.Socket:
    """A bare DEALER socket, for messages the client library would never send."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def recv_reply(sock: zmq.Socket, timeout: float = 10.0) -> dict | None:
    """The next reply that is not a heartbeat, or None after `timeout` seconds of silence."""
    while sock.poll(timeout * 1000):
        reply = msgpack.unpackb(sock.recv())
        if reply["type"] != "heartbeat":
            return reply
    return None


def run_as_nobody(work: Callable[[], bytes]) -> bytes:
    """`work()` in a forked child running as nobody (uid 65534), its bytes handed back through a pipe.

    A fork, not a new interpreter: nobody cannot read this environment's Python, and the daemon reads the
    peer's uid when it connects, so the child must drop root before it creates its socket."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(writer, work())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as result:
        output = result.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and output, "the work running as nobody failed"
    return output

"""How the ranks meet: torch.distributed's TCPStore for the startup exchange, then the process group.

Before any collective, every rank announces its world size on the store and, once loaded, the model it holds,
so a wrong --world-size, a duplicate --rank or another model is one clear line on each side rather than a
collective that times out. Rank 0 hosts the store at --distributed-init.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from kvd.distributed.cpu_binding import bind_process, format_cpulist
from kvd.distributed.shard import Shard

logger = logging.getLogger("kvd.distributed")

STARTUP_TIMEOUT_S = (
    600.0  # how long a rank waits for the others to start and load (a large model loads slowly)
)
_POLL_S = 0.05
_PG_PREFIX = "kvd-tp"


class DistributedStartupError(ValueError):
    """The ranks cannot form a group: a port taken, rank 0 unreachable, a mismatch between ranks; one line."""


def parse_init(init: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (HOST, PORT)."""
    url = urlsplit(init)
    if url.scheme != "tcp" or not url.hostname or url.port is None or url.path not in ("", "/"):
        raise DistributedStartupError(f"--distributed-init {init!r} is not tcp://HOST:PORT")
    return url.hostname, url.port


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_store(init: str, rank: int) -> dist.TCPStore:
    """Rank 0 listens at init; the other ranks connect to it, retrying until STARTUP_TIMEOUT_S."""
    host, port = parse_init(init)
    timeout = timedelta(seconds=STARTUP_TIMEOUT_S)
    try:
        return dist.TCPStore(host, port, None, rank == 0, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if rank == 0:
            raise DistributedStartupError(
                f"rank 0 cannot listen on {init} ({_first_line(e)}): the port is taken or the host is not "
                "this machine's; pass another --distributed-init"
            ) from None
        raise DistributedStartupError(
            f"rank {rank} cannot reach rank 0 at {init}: {_first_line(e)}"
        ) from None


def put(store: dist.TCPStore, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def get(store: dist.TCPStore, key: str, alive: Callable[[], None] = lambda: None) -> dict:
    """Wait for key (calling `alive` between looks, which raises if a rank it watches died)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check([key]):
        alive()
        if time.monotonic() > deadline:
            raise DistributedStartupError(f"no rank set {key!r} within {STARTUP_TIMEOUT_S:g} s")
        time.sleep(_POLL_S)
    return json.loads(store.get(key))


def claim_rank(store: dist.TCPStore, rank: int) -> None:
    if store.add(f"claim/{rank}", 1) > 1:
        raise DistributedStartupError(f"rank {rank} has joined already: give each process its own --rank")


def place_rank(cpus: list[int] | None, num_threads: int | None) -> str | None:
    """Bind this process to its cores (None: leave it) and size torch's thread pool to them; the cores."""
    if cpus is not None:
        bind_process(cpus)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif cpus is not None:
        torch.set_num_threads(len(cpus))
    return None if cpus is None else format_cpulist(cpus)


def rank_device(device: str, local_index: int) -> torch.device:
    """One GPU per rank on a host: cuda -> cuda:i for the host's i-th rank (cuda:k -> cuda:k+i)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + local_index)


def init_group(store: dist.TCPStore, shard: Shard, device: torch.device, timeout_s: float) -> None:
    """The process group every collective runs in: gloo on CPU, NCCL on CUDA; `timeout_s` bounds each one."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(_PG_PREFIX, store),
        rank=shard.rank,
        world_size=shard.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def fingerprint(model: torch.nn.Module, dtype: torch.dtype, quantization: str, full_config: object) -> str:
    """What every rank must agree on, readable: the model's shape and run mode, and a hash of its config."""
    digest = hashlib.sha256(json.dumps(vars(full_config), sort_keys=True, default=str).encode()).hexdigest()
    c = full_config
    return (
        f"{c.model_type} {c.num_hidden_layers} layers x {c.hidden_size}, vocab {c.vocab_size}, "
        f"{str(dtype).removeprefix('torch.')}, quantization {quantization}, "
        f"{model.attention_backend.name} attention, config {digest[:12]}"
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this rank holds (parameters and quantized buffers; not the rotary table)."""
    tensors = itertools.chain(
        (t for n, t in model.named_parameters()), (t for n, t in model.named_buffers() if "rotary" not in n)
    )
    return sum(t.numel() * t.element_size() for t in tensors)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

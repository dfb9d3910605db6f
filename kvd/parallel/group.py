"""How the ranks meet: kvd's rendezvous store (kvd.parallel.store) for the startup exchange, then the
process group.

Every connection to the store first proves the group's secret both ways (kvd.parallel.handshake). Then, before
any collective, every rank announces its world size on the store and, once loaded, the model it holds, so a
wrong --world-size, a duplicate --rank or another model is one clear line on each side rather than a
collective that times out. Rank 0 hosts the store at --distributed-init, bound to that address alone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kvd.distributed.shard import Shard
from kvd.parallel.address import parse_init, pin_interfaces
from kvd.parallel.cpu_binding import bind_process, format_cpulist
from kvd.parallel.errors import DistributedStartupError
from kvd.parallel.handshake import HandshakeError
from kvd.parallel.store import RemoteStore, RendezvousStore, StoreServer

logger = logging.getLogger("kvd.parallel")

STARTUP_TIMEOUT_S = (
    600.0  # how long a rank waits for the others to start and load (a large model loads slowly)
)
_POLL_S = 0.05
_PG_PREFIX = "kvd-tp"


def host_store(init: str, secret: bytes) -> StoreServer:
    """Rank 0: serve the rendezvous store on init's address, and only there."""
    rendezvous = parse_init(init)
    try:
        return StoreServer.start(rendezvous.address(), rendezvous.port, secret)
    except OSError as e:
        raise DistributedStartupError(
            f"rank 0 cannot listen on {init} ({e.strerror or e}): the port is taken or the host is not this "
            "machine's; pass another --distributed-init"
        ) from None


def join_store(init: str, secret: bytes, rank: int) -> RemoteStore:
    """Ranks 1..N-1: connect to rank 0's store (retrying until STARTUP_TIMEOUT_S) and prove the secret."""
    rendezvous = parse_init(init)
    try:
        return RemoteStore.connect(rendezvous.address(), rendezvous.port, secret, STARTUP_TIMEOUT_S)
    except HandshakeError as e:
        raise DistributedStartupError(f"rank {rank}: the rendezvous at {init} failed: {e}") from None
    except OSError as e:
        raise DistributedStartupError(
            f"rank {rank} cannot reach rank 0 at {init}: {e.strerror or e}"
        ) from None


def put(store: RendezvousStore, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def get(store: RendezvousStore, key: str, alive: Callable[[], None] = lambda: None) -> dict:
    """Wait for key (calling `alive` between looks, which raises if a rank it watches died)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check([key]):
        alive()
        if time.monotonic() > deadline:
            raise DistributedStartupError(f"no rank set {key!r} within {STARTUP_TIMEOUT_S:g} s")
        time.sleep(_POLL_S)
    return json.loads(store.get(key))


def claim_rank(store: RendezvousStore, rank: int) -> None:
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


def init_group(store: RendezvousStore, shard: Shard, device: torch.device, timeout_s: float) -> None:
    """The process group every collective runs in: gloo on CPU, NCCL on CUDA; `timeout_s` bounds each one.

    Its sockets are pinned to the interface this rank met the others on: left to themselves, gloo binds the
    address the host name resolves to (a LAN address even when every rank is local) and NCCL picks one."""
    pin_interfaces(store.local_address)
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

"""Rank 0's side of the group: host the rendezvous, start the local workers, meet every rank, hold the step
channel, stop them."""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from kvd.distributed import shm
from kvd.distributed.errors import TensorParallelError
from kvd.distributed.shard import Shard
from kvd.distributed.step import StepChannel
from kvd.parallel import group
from kvd.parallel.address import free_loopback_port, parse_init
from kvd.parallel.cpu_binding import bind_process, rank_cpus
from kvd.parallel.errors import DistributedStartupError
from kvd.parallel.secret import new_secret, pipe_to_child, read_secret_file
from kvd.parallel.store import RendezvousStore, StoreServer

logger = logging.getLogger("kvd.parallel")

WORKER_MODULE = "kvd.worker"  # a worker rank's program (`python -m`): a process, so no import of it here

STOP_WAIT_S = 10.0  # how long a worker gets to leave after STOP before it is killed


def _die_with_parent() -> None:
    """In a spawned worker: SIGKILL when the daemon dies, whatever killed it (Linux prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)


@dataclass
class TensorParallel:
    """The group as rank 0 holds it. Started before rank 0 loads its shard, so every rank loads at once."""

    args: object  # the EngineArgs every rank runs with
    store: RendezvousStore
    server: StoreServer  # the rendezvous; it stops listening once every rank has joined
    cpus: str | None
    affinity: set[int]  # this process's cores before rank 0 was bound: given back by close()
    workers: dict[int, subprocess.Popen] = field(default_factory=dict)  # rank -> process, when started here
    channel: StepChannel | None = None
    ranks: list[dict] = field(default_factory=list)  # what each rank reported: cores, threads, weight bytes

    @property
    def shard(self) -> Shard:
        return Shard(0, self.args.tensor_parallel_size)

    @classmethod
    def start(cls, args: object) -> TensorParallel:
        """Without --distributed-init, rank 0 picks a loopback port and starts ranks 1..N-1 here; with it, the
        other ranks are started by hand (other hosts), and join at that address.

        The ranks prove a shared secret to each other before anything else: one made here for the workers
        started here, or --distributed-secret-file's on every rank started by hand."""
        world = args.tensor_parallel_size
        spawn = args.distributed_init is None
        secret = new_secret() if spawn else read_secret_file(args.distributed_secret_file)
        init = args.distributed_init or f"tcp://127.0.0.1:{free_loopback_port()}"
        # Every local rank's cores are chosen here, before rank 0 binds itself (its workers inherit that).
        affinity = os.sched_getaffinity(0)
        placement = [
            rank_cpus(args.cpu_binding, i, world if spawn else 1) for i in range(world if spawn else 1)
        ]
        cpus = group.place_rank(placement[0], args.num_threads)
        server = group.host_store(init, secret)
        store = server.local_store(group.STARTUP_TIMEOUT_S)
        tp = cls(dataclasses.replace(args, distributed_init=init), store, server, cpus, affinity)
        try:
            if spawn:
                for rank in range(1, world):
                    tp.workers[rank] = _spawn(tp.args, rank, placement[rank], secret)
            tp._meet()
        except BaseException:
            tp.close()
            raise
        atexit.register(
            tp.close
        )  # an embedding application that never closes its engine still stops its ranks
        return tp

    def _meet(self) -> None:
        world = self.shard.world_size
        group.put(self.store, "hello/0", {"world_size": world})
        for rank in range(1, world):
            hello = group.get(self.store, f"hello/{rank}", self._check_started)
            if hello["world_size"] != world:
                self.fail_startup(
                    f"rank {rank} was started with --world-size {hello['world_size']}, rank 0 with {world}"
                )
        logger.info("tensor parallel: %d ranks met at %s", world, self.args.distributed_init)

    def finish_startup(self, plan: dict, slot_bytes: int) -> None:
        """Give the workers the plan (KV pool, block size, the model's fingerprint), wait until each has
        loaded its shard and checked it, then form the process group.

        When every rank runs on this host's CPU, the plan names a shared file for the collectives
        (kvd.distributed.shm; `slot_bytes` per rank and buffer); it is unlinked once every rank has mapped it."""
        world = self.shard.world_size
        device = group.rank_device(self.args.device, 0)
        path = f"/dev/shm/kvd-tp-{os.getpid()}-{parse_init(self.args.distributed_init).port}"
        local = len(self.workers) == world - 1 and shm.supported(device)
        plan["shm"] = (
            {"path": path, "slot_bytes": slot_bytes}
            if local and shm.create(path, world, slot_bytes)
            else None
        )
        shared = None
        try:
            if plan["shm"]:
                shared = shm.SharedCollectives(
                    path, 0, world, slot_bytes, self.args.distributed_timeout, self.check
                )
            group.put(self.store, "plan", plan)
            for rank in range(1, world):
                ready = group.get(self.store, f"ready/{rank}", self._check_started)
                if "error" in ready:
                    self.fail_startup(ready["error"])
                self.ranks.append(ready)
        finally:
            if plan["shm"]:
                os.unlink(path)
        group.init_group(self.store, self.shard, device, self.args.distributed_timeout)
        self.server.stop_listening()  # every rank is in: nobody else has any business there
        shm.activate(shared)
        self.channel = StepChannel(device, self.args.distributed_timeout)

    def fail_startup(self, message: str) -> None:
        """Tell the workers the startup failed (they exit with the same line), then raise it here."""
        group.put(self.store, "plan", {"error": message})
        raise DistributedStartupError(message)

    def _check_started(self) -> None:
        for rank, proc in self.workers.items():
            if proc.poll() is not None:
                raise DistributedStartupError(
                    f"rank {rank} exited with code {proc.returncode} while starting; its error is above"
                )

    def check(self) -> None:
        """Raise TensorParallelError if a worker died or a collective (a step, a heartbeat) failed."""
        for rank, proc in self.workers.items():
            if proc.poll() is not None:
                raise TensorParallelError(f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
        if self.channel is not None:
            self.channel.check()

    def info(self, threads: int, weight_bytes: int) -> dict:
        """The group for `info`. "init" is the one field that says where the ranks meet (host and port): the
        owner's business, which a view for other users drops."""
        rank0 = {"rank": 0, "cpus": self.cpus, "threads": threads, "weight_bytes": weight_bytes}
        return {
            "size": self.shard.world_size,
            "backend": "nccl" if torch.device(self.args.device).type == "cuda" else "gloo",
            "init": self.args.distributed_init,
            "collectives": "shared memory" if shm.active() else "torch.distributed",
            "ranks": [rank0, *self.ranks],
        }

    def close(self) -> None:
        """Stop every rank: STOP through the channel, then SIGKILL for a worker still there after STOP_WAIT_S."""
        shm.activate(None)
        failed = self.channel is not None and self.channel.failure is not None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for proc in self.workers.values():
            if failed or proc.poll() is not None:
                # The group is broken: the survivors may wait in a collective that will never complete.
                proc.kill()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.workers.clear()
        if not failed:
            group.close_group()
        self.server.close()
        if self.cpus is not None:  # an embedding application keeps its cores after the engine is gone
            bind_process(sorted(self.affinity))


def _spawn(args: object, rank: int, cpus: list[int] | None, secret: bytes) -> subprocess.Popen:
    # The secret goes through an inherited pipe: the command line is visible to every user (`ps`).
    secret_fd = pipe_to_child(secret)
    spec = {
        "args": dataclasses.asdict(dataclasses.replace(args, rank=rank)),
        "local_index": rank,
        "cpus": cpus,
        "secret_fd": secret_fd,
    }
    cmd = [sys.executable, "-m", WORKER_MODULE, json.dumps(spec)]
    try:
        # stdout and stderr are the daemon's: the workers' lines land in its log, marked with their rank.
        return subprocess.Popen(
            cmd, preexec_fn=_die_with_parent, env=os.environ.copy(), pass_fds=(secret_fd,)
        )
    finally:
        os.close(secret_fd)

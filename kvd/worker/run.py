"""A worker rank: prove the group's secret, load this rank's shard, then run rank 0's commands until STOP or
until rank 0 is gone."""

from __future__ import annotations

import logging
import os
import socket

import torch

from kvd.distributed import shm
from kvd.distributed.errors import TensorParallelError
from kvd.distributed.shard import Shard
from kvd.distributed.step import Command, StepInputs, receive
from kvd.engine.engine_args import EngineArgs
from kvd.parallel import group
from kvd.parallel.cpu_binding import rank_cpus
from kvd.parallel.errors import DistributedStartupError
from kvd.parallel.secret import read_secret_file

logger = logging.getLogger("kvd.worker")


def run_worker(
    args: EngineArgs, local_index: int = 0, cpus: list[int] | None = None, secret: bytes | None = None
) -> int:
    """Serve as rank args.rank; 0 after STOP, 1 when the group failed, 2 when it could not form.

    `secret`: the one rank 0 handed a worker it started; None: --distributed-secret-file's (started by hand)."""
    try:
        if secret is None:
            secret = read_secret_file(args.distributed_secret_file)
        if cpus is None:  # started by hand: the only rank of this command, on its host
            cpus = rank_cpus(args.cpu_binding, 0, 1)
        runner, device = _join(args, local_index, cpus, secret)
    except DistributedStartupError as e:
        logger.error("rank %d: %s", args.rank, e)
        return 2
    try:
        _loop(runner, device)
    except TensorParallelError as e:
        logger.error("rank %d: %s; rank 0 is gone or failed, exiting", args.rank, e)
        return 1
    finally:
        group.close_group()
    return 0


def _join(args: EngineArgs, local_index: int, cpus: list[int] | None, secret: bytes):
    from kvd.engine.model_runner import ModelRunner
    from kvd.model.loader import load_model

    shard = Shard(args.rank, args.tensor_parallel_size)
    placed = group.place_rank(cpus, args.num_threads)
    device = group.rank_device(args.device, local_index)
    store = group.join_store(args.distributed_init, secret, shard.rank)
    group.claim_rank(store, shard.rank)
    group.put(store, f"hello/{shard.rank}", {"world_size": shard.world_size})
    hello = group.get(store, "hello/0")
    if hello["world_size"] != shard.world_size:
        raise DistributedStartupError(
            f"rank 0 runs with --world-size {hello['world_size']}, this rank with {shard.world_size}"
        )
    loaded = load_model(
        args.model,
        dtype=args.dtype,
        device=device,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
        batch_invariant=args.batch_invariant,
        shard=shard,
    )
    plan = group.get(store, "plan")
    if "error" in plan:
        raise DistributedStartupError(f"rank 0 gave up: {plan['error']}")
    mine = group.fingerprint(loaded.model, loaded.dtype, loaded.quantization, loaded.config)
    if mine != plan["fingerprint"]:
        message = (
            f"rank {shard.rank} loaded {mine}, but rank 0 loaded {plan['fingerprint']}: start every rank "
            "with the same --model, --dtype, --quantization and --attention-backend"
        )
        group.put(store, f"ready/{shard.rank}", {"error": message})
        raise DistributedStartupError(message)
    shared = None
    if plan["shm"]:  # mapped before ready: rank 0 unlinks the file once every rank is ready
        parent = os.getppid()
        shared = shm.SharedCollectives(
            plan["shm"]["path"], shard.rank, shard.world_size, plan["shm"]["slot_bytes"],
            args.distributed_timeout, lambda: _check_parent(parent),
        )  # fmt: skip
    runner = ModelRunner(
        loaded.model,
        loaded.model.config,
        plan["num_blocks"],
        plan["block_size"],
        getattr(torch, plan["kv_cache_dtype"]),  # rank 0's pool dtype (an int8 pool on every rank or none)
        device,
        max_num_seqs=plan["max_num_seqs"],
        max_model_len=plan["max_model_len"],
        enforce_eager=True,
    )
    ready = {
        "rank": shard.rank,
        "cpus": placed,
        "threads": torch.get_num_threads(),
        "weight_bytes": group.weight_bytes(loaded.model),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    group.put(store, f"ready/{shard.rank}", ready)
    group.init_group(store, shard, device, args.distributed_timeout)
    shm.activate(shared)
    logger.info(
        "rank %d of %d ready (cores %s, %d threads)", shard.rank, shard.world_size, placed, ready["threads"]
    )
    return runner, device


def _check_parent(parent: int) -> None:
    """A spawned worker's rank 0 is its parent: once that is gone, it is reparented."""
    if os.getppid() != parent:
        raise TensorParallelError("rank 0 exited")


def _loop(runner, device: torch.device) -> None:
    hidden = None
    while True:
        command, ints = receive(device)
        if command is Command.STEP:
            hidden = runner.execute(StepInputs.decode(ints))
        elif command is Command.LOGITS:
            runner.logits(hidden, ints)
        elif command is Command.STOP:
            return

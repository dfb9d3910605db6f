"""`kvd serve`: check the endpoint, load and warm up the model, listen, and run the daemon until a signal."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

import kvd
from kvd.engine.engine_args import EngineArgs
from kvd.gateway.server import check_port_free, parse_http_address, spawn_gateway, stop_gateway
from kvd.gateway.settings import GatewaySettings
from kvd.request.sampling_params import SamplingParams
from kvd.server.config import ServerConfig
from kvd.server.listener import ListenError, check_endpoint, close_socket, open_publisher, open_router
from kvd.server.model_specs import ModelSpec, model_specs
from kvd.server.systemd import Notifier
from kvd.settings import to_flags
from kvd_client.endpoint import Endpoint, parse_endpoint, resolve_endpoint

if TYPE_CHECKING:
    from kvd.engine.llm_engine import LLMEngine
    from kvd.server.models import ServedModel, ServedModels

logger = logging.getLogger("kvd.server")

# While the model loads, systemd is asked every EXTEND_EVERY_S for EXTEND_BY_S more than TimeoutStartSec.
EXTEND_EVERY_S = 10.0
EXTEND_BY_S = 30.0
# What stopping takes after the drain: held replies flushed, the gateway child stopped (up to 10 s), the sockets
# closed and the tensor-parallel ranks stopped. On SIGTERM systemd is asked for --drain-timeout plus this.
STOP_MARGIN_S = 30.0


@contextlib.contextmanager
def extending_start_timeout(notifier: Notifier) -> Iterator[None]:
    """EXTEND_TIMEOUT_USEC while the body runs, so that a large model may take longer than the unit's
    TimeoutStartSec, which then only bounds a daemon that stops making progress before its load starts."""
    if not notifier.enabled:
        yield
        return
    done = threading.Event()

    def extend() -> None:
        while True:
            notifier.send(f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY_S * 1e6)}")
            if done.wait(EXTEND_EVERY_S):
                return

    thread = threading.Thread(target=extend, name="kvd-extend-start", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def warm_up(engine: LLMEngine) -> float:
    """Run one token through the engine, so that the first client does not pay for lazy initialisation."""
    started = time.perf_counter()
    prompt = engine.encode("Hello")[:1] or [0]
    engine.add_request("warm-up", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


# The exit status of a daemon whose tensor-parallel group failed (a rank died or hung): not 0, so that
# systemd's Restart=on-failure starts it again.
EXIT_GROUP_FAILED = 3
EXIT_GATEWAY_FAILED = 4  # the `--http` gateway child exited on its own: likewise restarted


def serve(
    engine_args: EngineArgs,
    config: ServerConfig,
    http: GatewaySettings | None = None,
    models: Sequence[str] = (),
    model_tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Run the daemon; with config.http, its gateway too (`http`: that gateway's settings). `models`: the
    `--model` values (kvd.server.model_specs); none: engine_args.model alone. `model_tables`: a config file's
    settings of some of them (kvd.server.config_file)."""
    http = http or GatewaySettings()
    specs = (
        model_specs(models, config.models_dir, model_tables)
        if models or config.models_dir
        else [ModelSpec(None, engine_args.model)]
    )
    if len(specs) > 1 and (engine_args.tensor_parallel_size > 1 or engine_args.rank > 0):
        raise ValueError("a tensor-parallel daemon serves one model: give one --model")
    if engine_args.rank > 0:
        # Another host's rank: no socket, no engine; it runs rank 0's steps until rank 0 stops it.
        from kvd.worker.run import run_worker

        raise SystemExit(run_worker(specs[0].engine_args(engine_args)))
    endpoint = resolve_endpoint(config.listen)
    check_endpoint(endpoint, config)
    events_endpoint = parse_endpoint(config.events) if config.events else None
    if events_endpoint is not None:
        if events_endpoint.url == endpoint.url:
            raise ListenError(
                f"--events {events_endpoint} is --listen's endpoint too: give it one of its own"
            )
        check_endpoint(events_endpoint, config, "--events")
    if config.http is not None:
        check_port_free(*parse_http_address(config.http, config.allow_remote))
    elif http != GatewaySettings():
        given = " ".join(a for a in to_flags(http) if a.startswith("--"))
        raise ListenError(f"{given}: a setting of the HTTP gateway, which runs with --http HOST:PORT only")
    if config.allow_remote and not endpoint.is_loopback:
        logger.warning("listening beyond loopback: requests are neither authenticated nor encrypted")
    # Imported only now: a misconfigured daemon fails in a fraction of a second, before torch loads.
    from kvd.engine.llm_engine import LLMEngine
    from kvd.server.models import ServedModel, ServedModels

    notifier = Notifier(stop_timeout_s=config.drain_timeout + STOP_MARGIN_S)
    served: list[ServedModel] = []
    try:
        # One naming rule, decided before anything loads (so --pin is checked first): NAME= as given, else the
        # file's stem, the folder's name or the hub id; the bundled default (a daemon's only model) by its file.
        for i, spec in enumerate(specs):
            name = spec.name or spec.default_name()
            spec.engine_args(engine_args)  # its own settings checked before anything loads
            served.append(ServedModel(name, spec, pinned=i == 0 or name in config.pin or spec.pinned))
        _check_pins(config, served)
        # The first model and the pinned ones load now; the others on their first request.
        for model in served:
            if model.pinned:
                budget = engine_args.memory  # each takes its weights and pool from what the others left
                memory = None if budget is None else budget - sum(m.bytes for m in served if m.engine)
                if memory is not None and memory <= 0:
                    raise ValueError(
                        f"--memory {budget}: the models loaded before {model.name} hold all of it; raise it"
                    )
                with extending_start_timeout(notifier):
                    engine = LLMEngine(model.spec.engine_args(engine_args, memory=memory))
                if model.spec.source is None:
                    model.name = engine.model_name
                model.attach(engine, config)
        _preload_tokenizers([m for m in served if not m.pinned])
        models = ServedModels(served)
        _serve_models(models, engine_args, endpoint, events_endpoint, config, notifier, http)
    finally:
        for model in served:
            model.detach()  # stops the other tensor-parallel ranks


def _preload_tokenizers(models: list[ServedModel]) -> None:
    """Parse the tokenizers of the models loaded on demand now, while no stream waits on the interpreter's lock
    (a parse holds it); a model whose tokenizer does not parse says so when it loads."""
    from kvd.engine.llm_engine import read_tokenizer_ahead

    for model in models:
        try:
            read_tokenizer_ahead(model.spec.source)
        except Exception as e:  # its first request's load reports it, as for any model that does not load
            logger.warning("model %s: its tokenizer could not be read ahead: %s", model.name, e)


def _check_pins(config: ServerConfig, served: list[ServedModel]) -> None:
    names = [m.name for m in served]
    unknown = [name for name in config.pin if name not in names]
    if unknown:
        raise ValueError(f"--pin {unknown[0]}: no model has that name; served: {', '.join(names)}")
    pinned = sum(m.pinned for m in served)
    if config.max_loaded_models is not None and pinned > config.max_loaded_models:
        raise ValueError(
            f"{pinned} models are pinned (the first model and --pin), more than --max-loaded-models "
            f"{config.max_loaded_models}: every other model could never load"
        )


def _serve_models(
    models: ServedModels,
    engine_args: EngineArgs,
    endpoint: Endpoint,
    events_endpoint: Endpoint | None,
    config: ServerConfig,
    notifier: Notifier,
    http: GatewaySettings,
) -> None:
    from kvd.server.daemon import CLOSE_FLUSH_S, Daemon

    with extending_start_timeout(notifier):
        warm_up_s = sum(warm_up(m.engine) for m in models.loaded())
    # What the daemon holds for its life (model, tokenizer, pool, compiled grammars so far) leaves the cyclic
    # collector's scans, which walked it at every full collection: 2.6 % of a small model's decode step.
    gc.freeze()
    context = zmq.Context()
    sock = open_router(context, endpoint, config)
    try:
        event_sock = open_publisher(context, events_endpoint, config) if events_endpoint else None
    except BaseException:
        close_socket(sock, endpoint, linger_ms=0)
        raise
    for model in models.loaded():
        info = model.engine.info()
        logger.info(
            "model %s (%s, %s, %s): KV pool %d blocks x %d tokens, max_model_len %d",
            model.name,
            info["model"],
            info["dtype"],
            info["device"],
            info["num_blocks"],
            info["block_size"],
            info["max_model_len"],
        )
    logger.info(
        "kvd %s ready on %s: %d of %d models loaded, warm-up %.2f s",
        kvd.__version__,
        endpoint,
        len(models.loaded()),
        len(models),
        warm_up_s,
    )
    gateway = spawn_gateway(config.http, endpoint.url, config.allow_remote, http) if config.http else None
    daemon = Daemon(models, sock, config, engine_args, notifier, event_sock, gateway)
    # Only now: clients that systemd orders after kvd.service find the socket bound and the model warm.
    daemon.notifier.ready(f"ready on {endpoint}: {daemon.load_status()}")
    try:
        daemon.run()
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        close_socket(sock, endpoint, linger_ms=int(CLOSE_FLUSH_S * 1000))
        if event_sock is not None:
            close_socket(event_sock, events_endpoint, linger_ms=0)
        context.term()
    if daemon.failure is not None:
        logger.error(
            "exiting with %d: the tensor-parallel group failed (%s)", EXIT_GROUP_FAILED, daemon.failure
        )
        raise SystemExit(EXIT_GROUP_FAILED)
    if daemon.gateway_failed:
        logger.error("exiting with %d: the HTTP gateway failed", EXIT_GATEWAY_FAILED)
        raise SystemExit(EXIT_GATEWAY_FAILED)
    logger.info("stopped")

"""`kvd serve`: check the endpoint, load and warm up the model, listen, and run the daemon until a signal."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

import kvd
from kvd.engine.engine_args import EngineArgs
from kvd.engine.sampling_params import SamplingParams
from kvd.server.config import ServerConfig
from kvd.server.listener import check_endpoint, close_router, open_publisher, open_router
from kvd.server.systemd import Notifier
from kvd_client.endpoint import parse_endpoint, resolve_endpoint

if TYPE_CHECKING:
    from kvd.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvd.server")


def warm_up(engine: LLMEngine) -> float:
    """Run one token through the engine, so that the first client does not pay for lazy initialisation."""
    started = time.perf_counter()
    prompt = engine.encode("Hello")[:1] or [0]
    engine.add_request("warm-up", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def serve(engine_args: EngineArgs, config: ServerConfig) -> None:
    endpoint = resolve_endpoint(config.listen)
    check_endpoint(endpoint, config)
    events_endpoint = parse_endpoint(config.events) if config.events else None
    if events_endpoint is not None:
        check_endpoint(events_endpoint, config)
    if config.allow_remote and not endpoint.is_loopback:
        logger.warning("listening beyond loopback: requests are neither authenticated nor encrypted")
    # Imported only now: a misconfigured daemon fails in a fraction of a second, before torch loads.
    from kvd.engine.llm_engine import LLMEngine
    from kvd.server.daemon import CLOSE_FLUSH_S, Daemon

    engine = LLMEngine(engine_args)
    warm_up_s = warm_up(engine)
    context = zmq.Context()
    sock = open_router(context, endpoint, config)
    try:
        event_sock = open_publisher(context, events_endpoint, config) if events_endpoint else None
    except BaseException:
        close_router(sock, endpoint, linger_ms=0)
        raise
    info = engine.info()
    logger.info(
        "kvd %s ready on %s: model %s (%s, %s), KV pool %d blocks x %d tokens, max_model_len %d, "
        "warm-up %.2f s",
        kvd.__version__,
        endpoint,
        info["model"],
        info["dtype"],
        info["device"],
        info["num_blocks"],
        info["block_size"],
        info["max_model_len"],
        warm_up_s,
    )
    daemon = Daemon(engine, sock, config, Notifier(), event_sock)
    # Only now: clients that systemd orders after kvd.service find the socket bound and the model warm.
    daemon.notifier.ready(f"ready on {endpoint}: {daemon.load_status()}")
    try:
        daemon.run()
    finally:
        close_router(sock, endpoint, linger_ms=int(CLOSE_FLUSH_S * 1000))
        if event_sock is not None:
            close_router(event_sock, events_endpoint, linger_ms=0)
        context.term()
    logger.info("stopped")

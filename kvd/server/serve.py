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
from kvd.server.listener import check_endpoint, close_router, open_router
from kvd_client.endpoint import resolve_endpoint

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
    if config.allow_remote and not endpoint.is_loopback:
        logger.warning("listening beyond loopback: requests are neither authenticated nor encrypted")
    # Imported only now: a misconfigured daemon fails in a fraction of a second, before torch loads.
    from kvd.engine.llm_engine import LLMEngine
    from kvd.server.daemon import CLOSE_FLUSH_S, Daemon

    engine = LLMEngine(engine_args)
    warm_up_s = warm_up(engine)
    context = zmq.Context()
    sock = open_router(context, endpoint, config)
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
    try:
        Daemon(engine, sock, config).run()
    finally:
        close_router(sock, endpoint, linger_ms=int(CLOSE_FLUSH_S * 1000))
        context.term()
    logger.info("stopped")

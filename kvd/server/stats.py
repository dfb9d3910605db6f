"""Load figures for `stats` replies and the service manager's STATUS= line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.server.sessions import ClientSession
from kvd.server.state import ServerState

if TYPE_CHECKING:
    from kvd.engine.llm_engine import LLMEngine


def client_stats(engine: LLMEngine, session: ClientSession) -> dict:
    return {
        "client": session.name,
        "tenant": session.tenant,
        "requests": len(session.requests),
        "queued": len(session.pending),
        "in_engine": session.num_in_engine,
        "kv_blocks": sum(
            engine.num_blocks_allocated(engine_id)
            for g in session.requests.values()
            for engine_id in g.engine_ids
        ),
        "generated_tokens": sum(g.num_output_tokens for g in session.requests.values()),
        "preemptions": sum(g.num_preemptions for g in session.requests.values()),
    }


def load_status(state: ServerState) -> str:
    """One line of load (systemctl status shows it)."""
    engine = state.engine
    used = engine.kv_usage().used_blocks
    return (
        f"{engine.num_running} running, {engine.num_waiting} waiting, "
        f"KV {100 * used / engine.num_blocks:.0f}% used, {len(state.sessions)} clients"
    )

"""Load figures for `stats` replies and the service manager's STATUS= line."""

from __future__ import annotations

from kvd.server.sessions import ClientSession
from kvd.server.state import ServerState


def client_stats(session: ClientSession) -> dict:
    return {
        "client": session.name,
        "tenant": session.tenant,
        "requests": len(session.requests),
        "queued": len(session.pending),
        "in_engine": session.num_in_engine,
        "kv_blocks": sum(
            g.model.engine.num_blocks_allocated(engine_id)
            for g in session.requests.values()
            for engine_id in g.engine_ids
        ),
        "generated_tokens": sum(g.num_output_tokens for g in session.requests.values()),
        "preemptions": sum(g.num_preemptions for g in session.requests.values()),
    }


def load_status(state: ServerState) -> str:
    """One line of load (systemctl status shows it): every model's engine together."""
    engines = [m.engine for m in state.models.loaded()]
    used = sum(e.kv_usage().used_blocks for e in engines)
    total = sum(e.num_blocks for e in engines) or 1
    running, waiting = sum(e.num_running for e in engines), sum(e.num_waiting for e in engines)
    return f"{running} running, {waiting} waiting, KV {100 * used / total:.0f}% used, {len(state.sessions)} clients"

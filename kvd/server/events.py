"""The event stream (`--events ENDPOINT`): a PUB socket announcing each request's queued, scheduled,
preempted and finished, under the topic "TENANT/CLIENT" so that subscribers can filter by user."""

from __future__ import annotations

import contextlib
import time

import msgpack
import zmq

from kvd.server.protocol import RequestId
from kvd.server.sessions import ClientSession

QUEUED = "queued"  # accepted, waiting in its client's queue
SCHEDULED = "scheduled"  # handed to the engine (its turn came)
PREEMPTED = "preempted"  # its KV blocks were taken back under memory pressure; it will be recomputed
FINISHED = "finished"
# A model's lifecycle, under the topic "models/NAME": any subscriber sees them (a model's name is no secret).
MODEL_LOADING = "model_loading"
MODEL_LOADED = "model_loaded"
MODEL_UNLOADED = "model_unloaded"


class EventStream:
    """Publishes without ever blocking: a subscriber that does not keep up loses events (PUB drops them)."""

    def __init__(self, sock: zmq.Socket | None) -> None:
        self.socket = sock

    def publish(self, event: str, session: ClientSession, request_id: RequestId, **fields: object) -> None:
        body = {"event": event, "tenant": session.tenant, "client": session.name, "id": request_id}
        self._send(f"{session.tenant}/{session.name}", body, fields)

    def publish_model(self, event: str, model: str, **fields: object) -> None:
        self._send(f"models/{model}", {"event": event, "model": model}, fields)

    def _send(self, topic: str, body: dict, fields: dict) -> None:
        if self.socket is None:
            return
        body.update(fields, time=time.time())
        # A subscriber that cannot take it now misses it: events are best effort, serving comes first.
        with contextlib.suppress(zmq.Again):
            self.socket.send_multipart([topic.encode(), msgpack.packb(body)], zmq.NOBLOCK)

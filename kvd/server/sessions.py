"""Per-client bookkeeping: each client's generations in flight and the replies it has not yet accepted."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvd.request.harmony import HarmonyParser
from kvd.request.reasoning import ReasoningParser
from kvd.request.sampling_params import SamplingParams
from kvd.request.tool_parse import ToolCallParser
from kvd.server.protocol import RequestId

if TYPE_CHECKING:
    from kvd.server.models import ServedModel


@dataclass
class EmbedJob:
    """An embed request's inputs (one engine request each) and the vectors that came back so far."""

    inputs: list[list[int]]
    dimensions: int | None
    vectors: list[list[float] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)

    @property
    def done(self) -> bool:
        return all(v is not None for v in self.vectors)


@dataclass(eq=False)
class Generation:
    """A generate, chat or embed request, the daemon's one record of it from acceptance to its last reply."""

    id: RequestId  # the client's id, unique among its client's requests in flight
    stream: bool
    model: ServedModel | None = field(default=None, kw_only=True)  # the model it is for
    num_prompt_tokens: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafted for this request, and confirmed
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # Set once the prompt is tokenized; emptied at admission, where the engine takes its own copy.
    prompt_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    prompt_field: str = ""  # the request field the prompt came from, for an error reply at admission
    # Its opaque ids in the engine (one, or one per embed input), given at admission; empty while it is
    # tokenized or in its client's queue.
    engine_ids: list[int] = field(default_factory=list)
    matcher: Any = None  # the compiled grammar (structured output, forced tool calls), handed to the engine
    tool_parser: ToolCallParser | None = None  # chat with tools: splits the output into content and calls
    reasoning_parser: ReasoningParser | HarmonyParser | None = (
        None  # a reasoning model's chat: the thinking section apart
    )
    embed: EmbedJob | None = None
    prompt_logprobs: list[dict | None] | None = None
    # Non-streaming requests collect their output here for the single final reply.
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None


@dataclass
class ClientSession:
    """One client, known by the routing id the ROUTER socket gave its connection."""

    identity: bytes
    requests: dict[RequestId, Generation] = field(default_factory=dict)
    # Replies the socket refused because the client's queue was full; sent in order once it reads again.
    backlog: deque[bytes] = field(default_factory=deque)
    last_sent: float = 0.0
    stalled_since: float | None = None
    # After a client timeout: until when the `client_timeout` errors in the backlog wait for the client.
    notices_until: float | None = None
    # Accepted requests not yet in the engine, oldest first (see fairness.py).
    pending: deque[Generation] = field(default_factory=deque)
    # Other requests (load, tokenize, detokenize) waiting for a model to load: heartbeats go out meanwhile.
    num_waiting: int = 0
    has_turn: bool = False  # in its tenant's turn order (fairness.py)
    tenant: str = ""  # who the peer is (isolation.py); "" for sessions made without a message
    # What stats, events and logs call the connection. Never the routing id itself: libzmq numbers plain
    # connections from a counter, and a peer that knew the next value could take it as its own id (see
    # Sessions.label).
    name: str = ""

    @property
    def num_in_engine(self) -> int:
        return sum(1 for g in self.requests.values() if g.engine_ids)


class Sessions:
    """The clients that have requests in flight or replies pending; others need no state."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, ClientSession] = {}
        self._label_key = secrets.token_bytes(32)

    def label(self, identity: bytes) -> str:
        """A connection's public name: a keyed hash of its routing id, so that no figure the daemon shows lets
        a client predict the id libzmq gives the next connection (a peer that claimed it would make libzmq
        abort the daemon when that connection arrives)."""
        return hmac.new(self._label_key, identity, hashlib.sha256).hexdigest()[:16]

    def get(self, identity: bytes) -> ClientSession | None:
        return self._by_identity.get(identity)

    def open(self, identity: bytes, tenant: str = "") -> ClientSession:
        session = self._by_identity.get(identity)
        if session is None:
            session = ClientSession(
                identity, last_sent=time.monotonic(), tenant=tenant, name=self.label(identity)
            )
            self._by_identity[identity] = session
        return session

    def num_sessions_of(self, tenant: str) -> int:
        """The tenant's connections with work in flight or replies pending."""
        return sum(1 for s in self._by_identity.values() if s.tenant == tenant)

    def release_if_idle(self, session: ClientSession) -> None:
        if not session.requests and not session.backlog and not session.num_waiting:
            self._by_identity.pop(session.identity, None)

    def remove(self, session: ClientSession) -> None:
        self._by_identity.pop(session.identity, None)

    def num_requests_of(self, tenant: str) -> int:
        return sum(len(s.requests) for s in self._by_identity.values() if s.tenant == tenant)

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self._by_identity.values())

    def __iter__(self) -> Iterator[ClientSession]:
        # A copy: callers drop sessions while iterating.
        return iter(list(self._by_identity.values()))

    def __len__(self) -> int:
        return len(self._by_identity)

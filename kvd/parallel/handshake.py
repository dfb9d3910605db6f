"""Mutual proof of the group's secret, first thing on every connection to rank 0's rendezvous store.

Rank 0 sends a fresh random challenge; the joining rank answers with its own challenge and an HMAC-SHA256 of
both under the secret; rank 0 checks it and answers with the HMAC of both, in the other order and under another
label. Neither side sends anything of the group before the other has proven the secret: a stranger can neither
join (it cannot answer rank 0's challenge) nor pose as rank 0 (it cannot answer the rank's). Fresh challenges
on both sides make a recorded exchange useless, and the two labels keep one side's proof from serving as the
other's. The connection is not encrypted afterwards, nor is the process group's traffic: an attacker on the
path is out of this scope (docs/architecture.md, "Tensor parallel": non-loopback on a trusted network only).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from kvd.parallel.wire import recv_frame, send_frame

CHALLENGE_BYTES = 32
_PROOF_BYTES = hashlib.sha256().digest_size
_RANK_LABEL = b"kvd tensor-parallel rank\0"
_RANK0_LABEL = b"kvd tensor-parallel rank 0\0"
REFUSED = b"refused: no proof of the group's secret"


class HandshakeError(ConnectionError):
    """The peer did not prove the secret (or is no kvd rank): the connection is of no use."""


def _proof(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def accept(sock: socket.socket, secret: bytes) -> None:
    """Rank 0's side: raise HandshakeError (after telling the peer) unless it proves the secret; then prove it."""
    ours = secrets.token_bytes(CHALLENGE_BYTES)
    send_frame(sock, ours)
    answer = recv_frame(sock, CHALLENGE_BYTES + _PROOF_BYTES)
    theirs, proof = answer[:CHALLENGE_BYTES], answer[CHALLENGE_BYTES:]
    if len(answer) != CHALLENGE_BYTES + _PROOF_BYTES or not hmac.compare_digest(
        proof, _proof(secret, _RANK_LABEL, ours, theirs)
    ):
        send_frame(sock, REFUSED)
        raise HandshakeError("it did not prove the group's secret")
    send_frame(sock, _proof(secret, _RANK0_LABEL, theirs, ours))


def join(sock: socket.socket, secret: bytes) -> None:
    """A joining rank's side: prove the secret, then raise HandshakeError unless rank 0 proves it too."""
    challenge = recv_frame(sock, max(CHALLENGE_BYTES, len(REFUSED)))
    if len(challenge) != CHALLENGE_BYTES:
        raise HandshakeError("it does not speak kvd's rendezvous (no challenge)")
    ours = secrets.token_bytes(CHALLENGE_BYTES)
    send_frame(sock, ours + _proof(secret, _RANK_LABEL, challenge, ours))
    reply = recv_frame(sock, max(_PROOF_BYTES, len(REFUSED)))
    if reply == REFUSED:
        raise HandshakeError(
            "it refused this rank: the secrets differ (use rank 0's --distributed-secret-file)"
        )
    if not hmac.compare_digest(reply, _proof(secret, _RANK0_LABEL, ours, challenge)):
        raise HandshakeError("it did not prove the group's secret: it is not this group's rank 0")

"""Proving knowledge of the cluster's join token without sending it: a mutual HMAC challenge-response.

The exchange rides on the handshake's own messages (no new message types, the same order when no token is
set), and each side contributes a fresh random nonce, so a recorded exchange cannot be replayed::

    worker -> head   HELLO      auth = W                         W: the worker's 32-byte nonce
    head -> worker   HELLO_ACK  node_id = "", challenge = H || head_proof(W, H)
    worker -> head   HELLO      auth = worker_proof(H, W)        (the worker checks head_proof first)
    head -> worker   HELLO_ACK  node_id = ID, challenge = None   then ASSIGNMENT, as without a token

with head_proof = HMAC-SHA256(token, "tc-join/head" || 0 || W || H) and worker_proof = HMAC-SHA256(token,
"tc-join/worker" || 0 || H || W). The labels differ, so neither side can be used to compute the other's proof
(a reflection), and comparisons use hmac.compare_digest. What this does and does not protect is written in
docs/security.md: it authenticates peers when they connect; it does not encrypt or sign the frames after.

Workers passing hidden states straight to each other (tc.worker.peers) prove a link the same way, both sides:
the listening worker sends a fresh nonce, the one before answers HMAC-SHA256(key, "tc-peer" || 0 || nonce) with a
nonce of its own, and the listener answers HMAC-SHA256(key, "tc-peer-ack" || 0 || that nonce), where the key comes
from the head's ROUTE (`route_key`: bound to the join token when there is one).

Pure functions; the head and the worker each call them from their handshake.
"""
from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size  # 32
CHALLENGE_BYTES = NONCE_BYTES + PROOF_BYTES

_PEER_LABEL = b"tc-peer\x00"
_PEER_ACK_LABEL = b"tc-peer-ack\x00"
_ROUTE_LABEL = b"tc-route\x00"
_HEAD_LABEL = b"tc-join/head\x00"
_WORKER_LABEL = b"tc-join/worker\x00"


class AuthError(Exception):
    """A join-token proof is missing, malformed or wrong; the message says which side should change what."""


def token_key(token: str) -> bytes:
    """The HMAC key for a join token as written in the topology or the worker's token file."""
    if not token or token != token.strip():
        raise ValueError("a join token must be non-empty text without surrounding whitespace")
    return token.encode("utf-8")


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def head_proof(key: bytes, worker_nonce: bytes, head_nonce: bytes) -> bytes:
    return hmac.new(key, _HEAD_LABEL + worker_nonce + head_nonce, hashlib.sha256).digest()


def worker_proof(key: bytes, head_nonce: bytes, worker_nonce: bytes) -> bytes:
    return hmac.new(key, _WORKER_LABEL + head_nonce + worker_nonce, hashlib.sha256).digest()


def make_challenge(key: bytes, worker_nonce: bytes) -> tuple[bytes, bytes]:
    """The head's side of round one: (head nonce, HELLO_ACK.challenge bytes)."""
    check_nonce(worker_nonce)
    head_nonce = new_nonce()
    return head_nonce, head_nonce + head_proof(key, worker_nonce, head_nonce)


def check_nonce(nonce: bytes | None) -> bytes:
    if nonce is None or len(nonce) != NONCE_BYTES:
        got = "none" if nonce is None else f"{len(nonce)} bytes"
        raise AuthError(f"expected a {NONCE_BYTES}-byte nonce in HELLO.auth, got {got}")
    return nonce


def answer_challenge(key: bytes, worker_nonce: bytes, challenge: bytes | None) -> bytes:
    """The worker's side of round two: check the head's proof, return the worker's. Raises AuthError."""
    if challenge is None:
        raise AuthError("the head did not ask for the join token, so it cannot prove it knows it; give the "
                        "head's topology the same head.join_token, or start this worker without a token")
    if len(challenge) != CHALLENGE_BYTES:
        raise AuthError(f"the head's challenge is {len(challenge)} bytes, not {CHALLENGE_BYTES}; run the same tc "
                        "release on the head and the workers")
    head_nonce, proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    if not hmac.compare_digest(proof, head_proof(key, worker_nonce, head_nonce)):
        raise AuthError("the head could not prove it knows this worker's join token: most likely the two tokens "
                        "differ (check this worker's --join-token-file or TC_JOIN_TOKEN against the head's "
                        "head.join_token); else --join names another cluster's head")
    return worker_proof(key, head_nonce, worker_nonce)


def check_answer(key: bytes, head_nonce: bytes, worker_nonce: bytes, answer: bytes | None) -> None:
    """The head's side of round two. Raises AuthError when the worker does not know the token."""
    if answer is None or not hmac.compare_digest(answer, worker_proof(key, head_nonce, worker_nonce)):
        raise AuthError("the join token proof is wrong: this worker's token differs from the head's "
                        "head.join_token; give it the same token (--join-token-file or TC_JOIN_TOKEN)")


def route_key(join_key: bytes | None, material: bytes) -> bytes:
    """The key a peer link of a route is proven with, from the fresh `material` the head's ROUTE carries: as is
    in a cluster without a join token; bound to the token in one with, so that someone who watched the ROUTE go by
    cannot use it."""
    return material if join_key is None else hmac.new(join_key, _ROUTE_LABEL + material, hashlib.sha256).digest()


def peer_proof(route_key: bytes, nonce: bytes, listener: bool = False) -> bytes:
    """What a peer link is proven with: the route's key (from the head's ROUTE) over the other side's fresh nonce,
    so a recorded exchange cannot be replayed; the stage before and the listener use different labels, so that
    neither proof serves as the other."""
    return hmac.new(route_key, (_PEER_ACK_LABEL if listener else _PEER_LABEL) + nonce, hashlib.sha256).digest()


def check_peer_proof(route_key: bytes, nonce: bytes, proof: bytes, listener: bool = False) -> bool:
    return hmac.compare_digest(proof, peer_proof(route_key, nonce, listener))

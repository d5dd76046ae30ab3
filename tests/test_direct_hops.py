"""Direct hops: workers pass hidden states straight to the next worker (tc.worker.peers, tc.head.pipeline).

The peer link over real loopback sockets (its handshake, the proofs it refuses, what it carries), then real head
and worker processes on a tiny model: the text is the relayed pipeline's, and /v1/cluster says where each node's
output went, for every mix of workers that listen, do not, or cannot be reached.
"""
from __future__ import annotations

import errno
import logging
import queue
import socket
import struct
import threading
import time

import pytest
import torch

from cluster import Cluster, HandJoinedWorker, Request, worker_hello, write_topology
from tc.protocol.auth import peer_proof, token_key
from tc.protocol.connection import Connection, connect
from tc.protocol.errors import ConnectionClosed
from tc.protocol.messages import (PROTOCOL_VERSION, BatchEntry, Error, HiddenState, InferenceError, PeerAck,
                                  PeerChallenge, PeerHello, Ping, Route, RunBatch)
from tc.worker import peers
from tc.worker.peers import MAX_PEER_CONNECTIONS, Forwarder, PeerListener, Routes
from tiny_model import write_tiny_model

KEY = b"k" * 32


def batch(route: int, rows: int = 1, seed: int = 0) -> RunBatch:
    hidden = torch.randn(1, rows, 8, generator=torch.Generator().manual_seed(seed))
    return RunBatch(entries=(BatchEntry(sequence=1, position_start=0, length=rows, cache_capacity=max(16, rows)),),
                    hidden_state=hidden, route=route, released=(7,))


@pytest.fixture
def listener():
    """A peer listener on loopback whose route 3 takes KEY; what it delivers lands in `.got`."""
    routes = Routes()
    got: queue.Queue = queue.Queue()
    peer = PeerListener("127.0.0.1", 0, routes, got.put, 1 << 20)
    peer.got, peer.routes = got, routes
    routes.set(Route(route=3, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
    peer.start()  # as the worker does once a ROUTE gives it a link in
    yield peer
    peer.close()


def route_to(listener: PeerListener, route: int = 3, key: bytes = KEY) -> Route:
    """The route of the stage before `listener`: its output goes there, proven with `key`."""
    return Route(route=route, next_host="127.0.0.1", next_port=listener.port, next_key=key, inbound_key=None)


def test_a_proven_link_carries_batches_whole_and_in_order(listener):
    forwarder = Forwarder(1 << 20)
    try:
        for seq in (1, 2, 3):
            assert forwarder.send(route_to(listener), batch(3, rows=seq, seed=seq), "step-9", seq)
        for seq in (1, 2, 3):
            env = listener.got.get(timeout=5)
            assert (env.request_id, env.seq) == ("step-9", seq)
            assert env.message.hidden_state == batch(3, rows=seq, seed=seq).hidden_state
            assert env.message.route == 3 and env.message.released == (7,)
    finally:
        forwarder.close()


def test_a_wrong_key_is_refused_and_the_route_is_tried_again_after_a_backoff(listener, caplog, monkeypatch):
    forwarder = Forwarder(1 << 20)
    with caplog.at_level(logging.WARNING):
        assert not forwarder.send(route_to(listener, key=b"x" * 32), batch(3), "step-1", 1)
    assert "could not prove the head routed it here" in caplog.text
    assert "replying through the head for route 3, trying again in 30s" in caplog.text
    # cut until the backoff is over: no second try, even with a listener that would take it now
    assert not forwarder.send(route_to(listener), batch(3), "step-1", 2)
    assert listener.got.empty()
    monkeypatch.setattr(forwarder, "_retry_at", 0.0)  # the 30 s have passed
    assert forwarder.send(route_to(listener), batch(3), "step-1", 3)
    assert listener.got.get(timeout=5).seq == 3
    forwarder.close()
    # the listener still serves a proven link
    good = Forwarder(1 << 20)
    try:
        assert good.send(route_to(listener), batch(3), "step-2", 1)
        assert listener.got.get(timeout=5).request_id == "step-2"
    finally:
        good.close()


def test_a_route_the_head_never_sent_is_refused(listener, monkeypatch):
    monkeypatch.setattr(peers, "PEER_HANDSHAKE_TIMEOUT_S", 0.5)  # the wait for a ROUTE that never comes
    forwarder = Forwarder(1 << 20)
    started = time.monotonic()
    assert not forwarder.send(route_to(listener, route=4), batch(4), "step-1", 1)
    assert time.monotonic() - started < 5
    assert listener.got.empty()


def test_a_route_replaced_before_its_link_opened_is_refused_as_such(listener, caplog):
    """The head replaced the route (a step given up) before the stage before opened its link: the refusal says so,
    on both sides, rather than that the peer could not prove its right to the link."""
    listener.routes.set(Route(route=5, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
    forwarder = Forwarder(1 << 20)
    with caplog.at_level(logging.INFO):
        assert not forwarder.send(route_to(listener), batch(3), "step-1", 1)
    assert "came for route 3, which route 5 has replaced" in caplog.text
    assert "the next stage refused: route 3 was replaced by route 5" in caplog.text
    # (about this link: an earlier test's refused link may be logged late, from its listener's thread)
    assert "could not prove the head routed it here (route 3)" not in caplog.text
    assert listener.got.empty()


def test_a_newer_route_replaces_the_link(listener):
    """Routes only move forward; a link opened for the old route stops being fed once the next is in use."""
    forwarder = Forwarder(1 << 20)
    try:
        assert forwarder.send(route_to(listener), batch(3), "step-1", 1)
        listener.routes.set(Route(route=5, next_host=None, next_port=None, next_key=None, inbound_key=b"n" * 32))
        listener.routes.set(Route(route=4, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
        assert listener.routes.current.route == 5  # an older ROUTE arriving late changes nothing
        assert forwarder.send(route_to(listener, route=5, key=b"n" * 32), batch(5), "step-2", 1)
        assert [listener.got.get(timeout=5).message.route for _ in range(2)] == [3, 5]
    finally:
        forwarder.close()


def test_with_a_join_token_the_routes_key_alone_proves_nothing():
    """In a cluster with a join token, the key a link is proven with is bound to the token: the ROUTE's key, seen
    on the wire, is not enough."""
    routes = Routes()
    got: queue.Queue = queue.Queue()
    token = token_key("a-long-enough-join-token")
    peer = PeerListener("127.0.0.1", 0, routes, got.put, 1 << 20, join_key=token)
    peer.start()
    try:
        routes.set(Route(route=1, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
        assert not Forwarder(1 << 20).send(route_to(peer, route=1), batch(1), "step-1", 1)  # the key, no token
        assert not Forwarder(1 << 20, join_key=token_key("another-join-token-here")).send(
            route_to(peer, route=1), batch(1), "step-1", 1)
        with_token = Forwarder(1 << 20, join_key=token)
        assert with_token.send(route_to(peer, route=1), batch(1), "step-1", 2)
        assert got.get(timeout=5).seq == 2 and got.empty()
        with_token.close()
    finally:
        peer.close()


def test_a_listener_that_cannot_prove_the_key_gets_nothing(listener):
    """The stage before checks the listener's proof too: hidden states go only where the head routed them."""
    impostor = PeerListener("127.0.0.1", 0, Routes(), lambda env: None, 1 << 20)
    impostor._routes.set(Route(route=3, next_host=None, next_port=None, next_key=None, inbound_key=b"y" * 32))
    impostor.start()
    try:
        # the impostor takes any proof for its own key: give the connector the impostor's key, so the impostor
        # accepts it, and check the connector refuses an answer made with another key
        forwarder = Forwarder(1 << 20)
        route = Route(route=3, next_host="127.0.0.1", next_port=impostor.port, next_key=b"y" * 32, inbound_key=None)
        assert forwarder.send(route, batch(3), "step-1", 1)  # the right key both ways: accepted
        forwarder.close()
        sock = socket.create_server(("127.0.0.1", 0))  # a listener that answers with a proof made of another key

        def answer() -> None:
            peer, _ = sock.accept()
            conn = Connection(peer)
            conn.send(PeerChallenge(nonce=b"n" * 32))
            hello = conn.recv().message
            conn.send(PeerAck(route=hello.route, proof=peer_proof(b"z" * 32, hello.nonce, listener=True),
                              max_frame_bytes=1 << 20))
            time.sleep(1)
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        route = Route(route=3, next_host="127.0.0.1", next_port=sock.getsockname()[1], next_key=KEY,
                      inbound_key=None)
        assert not Forwarder(1 << 20).send(route, batch(3), "step-1", 2)
        sock.close()
    finally:
        impostor.close()


def test_a_peer_that_has_not_proven_the_key_may_send_only_small_frames(listener):
    conn = connect("127.0.0.1", listener.port, timeout=5)
    conn.settimeout(5)
    assert isinstance(conn.recv().message, PeerChallenge)
    conn._sock.sendall((1 << 20).to_bytes(8, "big"))  # a 1 MiB body announced before any proof
    with pytest.raises(ConnectionClosed):
        while True:
            conn.recv()
    conn.close()


class ListenerWarnings(logging.Handler):
    """The peer listener's warnings; `said` is set by the first, which comes after the connection it is about
    has closed (so after the other end hears of it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.said.set()

    def __enter__(self) -> "ListenerWarnings":
        logging.getLogger(peers.__name__).addHandler(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        logging.getLogger(peers.__name__).removeHandler(self)


def test_a_frame_over_the_handshakes_cap_is_told_for_what_it_is(listener):
    """The cap before the proof is fixed: the word is that the other end is no tc worker of this release, not to
    raise a frame limit (none raises it) or send a shorter prompt."""
    with connect("127.0.0.1", listener.port, timeout=5) as conn, ListenerWarnings() as warnings:
        conn.settimeout(5)
        assert isinstance(conn.recv().message, PeerChallenge)
        conn._sock.sendall((1 << 20).to_bytes(8, "big"))
        told = conn.recv().message
        with pytest.raises(ConnectionClosed):
            conn.recv()
        assert warnings.said.wait(5)
    for said in (told.message, warnings.lines[0]):
        assert "over the 4096-byte cap; a peer link's handshake frames are a few hundred bytes" in said
        assert "not a tc worker of this release" in said and "shorter prompt" not in said


def test_a_proven_link_names_the_workers_frame_limit(listener):
    """Past the proof the cap is the listener's --max-frame-mb (TC_MAX_FRAME_MB), which the word names."""
    with handshake_by_hand(listener) as conn, ListenerWarnings() as warnings:
        conn._sock.sendall(((1 << 20) + 1).to_bytes(8, "big"))
        told = conn.recv().message
        with pytest.raises(ConnectionClosed):
            conn.recv()
        assert warnings.said.wait(5)
    for said in (told.message, warnings.lines[0]):
        assert "over the 1048576-byte cap; that is this worker's --max-frame-mb (TC_MAX_FRAME_MB)" in said


def test_a_batch_over_the_next_stages_frame_limit_goes_through_the_head(listener):
    """The listener says the largest frame it reads; a larger batch is not sent (so not lost on the way) and the
    link stays up for the next one."""
    small = PeerListener("127.0.0.1", 0, listener.routes, listener.got.put, 64 * 1024)
    small.start()
    forwarder = Forwarder(1 << 20)
    try:
        route = route_to(small)
        assert not forwarder.send(route, batch(3, rows=4096), "step-1", 1)  # 128 KiB of fp32 rows
        assert forwarder.send(route, batch(3, rows=2), "step-1", 2)
        assert listener.got.get(timeout=5).seq == 2
    finally:
        forwarder.close()
        small.close()


def test_a_link_proven_for_a_newer_route_closes_the_older_ones(listener):
    old = handshake_by_hand(listener, route=3)
    listener.routes.set(Route(route=4, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
    new = handshake_by_hand(listener, route=4)
    with pytest.raises(ConnectionClosed):
        old.recv(timeout=5)
    new.send(batch(4), "step-2", 1)
    assert listener.got.get(timeout=5).message.route == 4
    old.close()
    new.close()


def test_nothing_listening_cuts_the_route_at_once():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarder = Forwarder(1 << 20)
    route = Route(route=1, next_host="127.0.0.1", next_port=port, next_key=KEY, inbound_key=None)
    started = time.monotonic()
    assert not forwarder.send(route, batch(1), "step-1", 1)
    assert time.monotonic() - started < peers.PEER_CONNECT_TIMEOUT_S


def test_a_link_that_gets_no_thread_for_its_handshake_goes_through_the_head(listener, caplog):
    """Opening the link to the next stage starts a thread (the handshake's deadline); without one to be had (a
    thread or memory limit, for a moment) the batch goes through the head and the link is tried again later, as
    for a next stage that cannot be reached: the compute thread, which sends, must not fail for it."""
    forwarder = Forwarder(1 << 20)
    try:
        usual = threading.stack_size(1 << 62)  # no thread can be started with a stack this size
        try:
            with caplog.at_level(logging.WARNING):
                assert not forwarder.send(route_to(listener), batch(3), "step-1", 1)
        finally:
            threading.stack_size(usual)
        assert "no thread to bound the handshake with" in caplog.text
        assert "replying through the head for route 3" in caplog.text
        assert listener.got.empty()
    finally:
        forwarder.close()


def test_connections_that_hold_every_place_give_way_to_the_stage_before(listener, caplog):
    """Idle connections to the peer port (no key needed to open one) fill every place; the stage before still gets
    its link, in place of the oldest of them, rather than passing through the head for as long as they come."""
    idle = []
    try:
        for _ in range(peers.MAX_PEER_CONNECTIONS):
            conn = connect("127.0.0.1", listener.port)
            assert isinstance(conn.recv(timeout=5).message, PeerChallenge)  # it holds a place now
            idle.append(conn)
        forwarder = Forwarder(1 << 20)
        try:
            with caplog.at_level(logging.WARNING):
                assert forwarder.send(route_to(listener), batch(3), "step-1", 1)
            assert listener.got.get(timeout=5).seq == 1
        finally:
            forwarder.close()
        with pytest.raises(ConnectionClosed):
            idle[0].recv(timeout=5)  # the oldest gave way
        assert "closed a peer connection still in its handshake" in caplog.text
    finally:
        for conn in idle:
            conn.close()


def test_a_connection_that_gets_no_thread_leaves_the_listener_accepting(listener):
    """A peer connection the listener cannot start a thread for (a thread or memory limit, for a moment) is turned
    away; the thread that accepts must go on, or the stage before could never pass hidden states here again."""
    usual = threading.stack_size(1 << 62)  # no thread can be started with a stack this size
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as turned_away:
            try:
                assert turned_away.recv(4096) == b""  # closed, no challenge sent
            except ConnectionResetError:
                pass
    finally:
        threading.stack_size(usual)
    forwarder = Forwarder(1 << 20)
    try:
        assert forwarder.send(route_to(listener), batch(3), "step-1", 1)
        assert listener.got.get(timeout=5).message.route == 3
    finally:
        forwarder.close()


class ResetBeforeAccepted(socket.socket):
    """A listening socket whose accepted sockets refuse TCP_NODELAY as macOS does where the peer reset the
    connection before it was accepted (EINVAL); Linux sets it on such a socket without a word."""

    def accept(self):
        sock, address = super().accept()
        return ResetSocket(fileno=sock.detach()), address


class ResetSocket(socket.socket):
    def setsockopt(self, level, option, value, *args):
        if (level, option) == (socket.IPPROTO_TCP, socket.TCP_NODELAY):
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().setsockopt(level, option, value, *args)


def test_a_connection_reset_before_it_was_accepted_leaves_the_listener_accepting():
    routes = Routes()
    got: queue.Queue = queue.Queue()
    listener = PeerListener("127.0.0.1", 0, routes, got.put, 1 << 20)
    listener._server = ResetBeforeAccepted(fileno=listener._server.detach())
    routes.set(Route(route=3, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
    forwarder = Forwarder(1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as reset:
            reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        listener.start()  # accepts the reset connection first, then the stage before's
        assert forwarder.send(route_to(listener), batch(3), "step-1", 1)
        assert got.get(timeout=5).seq == 1
    finally:
        forwarder.close()
        listener.close()


class AbortsFirstAccept(socket.socket):
    """A listening socket whose first accept fails as BSD and macOS fail one for a connection reset while it
    waited in the backlog (ECONNABORTED), or any system once the process has no file descriptor left (EMFILE)."""

    aborted = False

    def accept(self):
        if not self.aborted:
            self.aborted = True
            raise ConnectionAbortedError(errno.ECONNABORTED, "Software caused connection abort")
        return super().accept()


def test_an_accept_that_fails_leaves_the_listener_accepting():
    routes = Routes()
    got: queue.Queue = queue.Queue()
    listener = PeerListener("127.0.0.1", 0, routes, got.put, 1 << 20)
    listener._server = AbortsFirstAccept(fileno=listener._server.detach())
    routes.set(Route(route=3, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
    listener.start()
    forwarder = Forwarder(1 << 20)
    try:
        assert forwarder.send(route_to(listener), batch(3), "step-1", 1)
        assert got.get(timeout=5).seq == 1 and listener._server.aborted
    finally:
        forwarder.close()
        listener.close()


def test_a_listener_with_no_thread_to_accept_on_starts_at_the_next_route():
    """The reader of the head's link starts the listener when a ROUTE gives it a link in; with no thread to be had
    (a thread or memory limit, for a moment) that must not end the reader, and the next ROUTE starts it."""
    routes = Routes()
    got: queue.Queue = queue.Queue()
    listener = PeerListener("127.0.0.1", 0, routes, got.put, 1 << 20)
    routes.set(Route(route=3, next_host=None, next_port=None, next_key=None, inbound_key=KEY))
    forwarder = Forwarder(1 << 20)
    try:
        usual = threading.stack_size(1 << 62)  # no thread can be started with a stack this size
        try:
            listener.start()
        finally:
            threading.stack_size(usual)
        listener.start()
        assert forwarder.send(route_to(listener), batch(3), "step-1", 1)
        assert got.get(timeout=5).seq == 1
    finally:
        forwarder.close()
        listener.close()


def handshake_by_hand(listener: PeerListener, route: int = 3) -> Connection:
    conn = connect("127.0.0.1", listener.port, timeout=5)
    conn.settimeout(5)
    challenge = conn.recv().message
    assert isinstance(challenge, PeerChallenge)
    nonce = b"c" * 32
    conn.send(PeerHello(protocol_version=PROTOCOL_VERSION, route=route, proof=peer_proof(KEY, challenge.nonce),
                        nonce=nonce))
    ack = conn.recv().message
    assert isinstance(ack, PeerAck) and ack.proof == peer_proof(KEY, nonce, listener=True)
    return conn


def test_anything_but_the_routes_batches_closes_that_link_only(listener):
    for wrong in (Ping(nonce=1), batch(2)):
        conn = handshake_by_hand(listener)
        conn.send(wrong)
        reply = conn.recv().message
        assert isinstance(reply, Error) and "carries RUN_BATCH of that route" in reply.message
        with pytest.raises(ConnectionClosed):
            conn.recv()
        conn.close()
    conn = handshake_by_hand(listener)  # the listener serves on
    conn.send(batch(3), "step-3", 1)
    assert listener.got.get(timeout=5).request_id == "step-3"
    conn.close()


def test_a_proven_link_silent_past_the_senders_reopening_is_closed(listener, monkeypatch):
    """A link in was read without a timeout once proven: a sender whose machine vanished (no FIN) kept its place, its
    thread and its buffer for good. The sender opens a link anew after PEER_IDLE_REOPEN_S, so one silent for twice
    that is closed (shortened here), and a batch before then keeps it open."""
    from tc.worker import peers

    monkeypatch.setattr(peers, "PROVEN_IDLE_S", 2.0)
    conn = handshake_by_hand(listener)
    time.sleep(0.3)
    conn.send(batch(3), "step-1", 1)  # well within the bound: delivered, and the link stays
    assert listener.got.get(timeout=5).request_id == "step-1"
    time.sleep(0.3)
    conn.send(batch(3), "step-2", 1)
    assert listener.got.get(timeout=5).request_id == "step-2"
    deadline = time.monotonic() + 10
    while listener._open and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not listener._open, "the silent link still holds its place"
    with pytest.raises((ConnectionClosed, OSError)):
        conn.recv()
    conn.close()


def test_connections_waiting_for_a_route_give_way_with_their_threads(listener):
    """A PEER_HELLO for a route no ROUTE has named yet waits for it (the stage before may connect first), and anyone
    who can reach the port can send one. With the listener full, such a connection gave its place to a newer one
    but kept its threads until the handshake's deadline: connections made threads without bound. They now end
    with their place, and the stage before still gets in."""
    before = threading.active_count()
    waiting = []
    for _ in range(5 * MAX_PEER_CONNECTIONS):
        conn = connect("127.0.0.1", listener.port, timeout=5)
        conn.settimeout(5)
        conn.recv()  # the challenge
        conn.send(PeerHello(protocol_version=PROTOCOL_VERSION, route=2**40, proof=b"x" * 32, nonce=b"c" * 32))
        waiting.append(conn)
    most = before + 2 * MAX_PEER_CONNECTIONS + 2  # each open handshake: its thread and its deadline's
    deadline = time.monotonic() + 5
    while threading.active_count() > most and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= most, threading.active_count() - before
    conn = handshake_by_hand(listener)
    conn.send(batch(3), "step-4", 1)
    assert listener.got.get(timeout=5).request_id == "step-4"
    for each in [conn, *waiting]:
        each.close()


def test_a_replayed_proof_does_not_open_a_link(listener):
    """Each connection gets a fresh nonce, so a proof seen on the wire once is no use on another."""
    conn = connect("127.0.0.1", listener.port, timeout=5)
    conn.settimeout(5)
    old = conn.recv().message.nonce
    conn.close()
    again = connect("127.0.0.1", listener.port, timeout=5)
    again.settimeout(5)
    assert again.recv().message.nonce != old
    again.send(PeerHello(protocol_version=PROTOCOL_VERSION, route=3, proof=peer_proof(KEY, old), nonce=b"c" * 32))
    reply = again.recv().message
    assert isinstance(reply, Error) and "proof" in reply.message
    again.close()


def test_another_protocol_version_is_told_so(listener):
    conn = connect("127.0.0.1", listener.port, timeout=5)
    conn.settimeout(5)
    nonce = conn.recv().message.nonce
    conn.send(PeerHello(protocol_version=PROTOCOL_VERSION - 1, route=3, proof=peer_proof(KEY, nonce),
                        nonce=b"c" * 32))
    reply = conn.recv().message
    assert isinstance(reply, Error) and "same tc release" in reply.message
    conn.close()


# ---------------------------------------------------------------------------------------------------------------
# Real processes
# ---------------------------------------------------------------------------------------------------------------

PROMPTS = ["the quick brown fox", "a b c d e f g h i j k l m n o p", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=11, shards=2)


def greedy_texts(cluster: Cluster) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 10,
                                                        "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        texts.append(body["choices"][0]["text"])
    return texts


def passes_to(cluster: Cluster) -> dict[str, str | None]:
    status, body = cluster.get("/v1/cluster")
    assert status == 200
    return {node["id"]: node["passes_to"] for node in body["nodes"]}


def run_cluster(tmp_path, model_dir, nodes: list[str], direct_hops: bool = True,
                worker_args: dict[str, tuple[str, ...]] | None = None, micro_batches: int = 1):
    topology = write_topology(tmp_path / "topology.yaml", model_dir, [{"id": n, "device": "cpu"} for n in nodes],
                              head={"direct_hops": direct_hops, "micro_batches": micro_batches})
    cluster = Cluster(topology, tmp_path)
    try:
        cluster.start_head()
        cluster.wait_api()
        for node in nodes:
            cluster.start_worker(node, *(worker_args or {}).get(node, ()))
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def relayed_texts(model_dir, tmp_path_factory):
    """The texts with every hop through the head, as before direct hops: what each layout must give."""
    with run_cluster(tmp_path_factory.mktemp("relayed"), model_dir, ["a", "b"], direct_hops=False) as cluster:
        texts = greedy_texts(cluster)
        assert passes_to(cluster) == {"a": "head", "b": "head"}
    return texts


@pytest.mark.parametrize("layout, expected", [
    ("direct", {"a": "b", "b": "head"}),
    ("b takes its input from the head", {"a": "head", "b": "head"}),
])
def test_two_workers_give_the_relayed_text(tmp_path, model_dir, relayed_texts, layout, expected):
    args = {"b": ("--no-direct-hops",)} if layout != "direct" else {}
    with run_cluster(tmp_path, model_dir, ["a", "b"], worker_args=args) as cluster:
        assert greedy_texts(cluster) == relayed_texts
        assert passes_to(cluster) == expected
        head_log = cluster.head.output()
        if layout == "direct":
            assert "route 1: head -> a -> b -> head" in head_log
            assert "passing hidden states straight to the next stage" in cluster.workers["a"].output()
        else:
            assert "no worker after the first listens" in head_log


def test_an_unreachable_next_worker_gets_its_input_through_the_head(tmp_path, model_dir, relayed_texts):
    """Three workers: a passes straight to b; c says it is at an address where nothing listens, so b's attempt
    fails and the head carries b's output to c, for every step after too, and the text is unchanged."""
    with run_cluster(tmp_path, model_dir, ["a", "b", "c"], worker_args={"c": ("--peer-host", "127.0.0.2")}) as cluster:
        assert greedy_texts(cluster) == relayed_texts
        assert passes_to(cluster) == {"a": "b", "b": "head", "c": "head"}
        assert "replying through the head for route 1" in cluster.workers["b"].output()


def test_concurrent_requests_in_micro_batches_pass_along(tmp_path, model_dir, relayed_texts):
    """Several groups of a step in flight at once on each link: the first worker gets them all, each passes them
    on as it finishes; each request's text is its own."""
    with run_cluster(tmp_path, model_dir, ["a", "b"], micro_batches=2) as cluster:
        requests = [Request(cluster, {"model": "tiny-qwen", "prompt": p, "max_tokens": 10, "temperature": 0,
                                      "ignore_eos": True}) for p in PROMPTS * 2]
        texts = []
        for request in requests:
            status, body = request.wait(120)
            assert status == 200, body
            texts.append(body["choices"][0]["text"])
        assert texts == relayed_texts * 2
        assert passes_to(cluster) == {"a": "b", "b": "head"}


class SilentLastStage(HandJoinedWorker):
    """A last stage that takes its input straight from the worker before it (a real PeerListener) and never
    answers: a hung compute thread, while its reader answers every PING."""

    def __init__(self, port: int, node_id: str):
        self.routes, self.got = Routes(), queue.Queue()
        self.listener = PeerListener("127.0.0.1", 0, self.routes, self.got.put, 1 << 20)
        self.listener.start()
        super().__init__(port, worker_hello(node_id, peer_port=self.listener.port))

    def received(self, env) -> None:
        if isinstance(env.message, Route):
            self.routes.set(env.message)

    def ended(self) -> None:
        self.listener.close()


def test_a_step_passed_along_that_never_comes_back_drops_the_stages_that_owe_it(tmp_path, model_dir, relayed_texts):
    """No stage answers a step passed from worker to worker until the last one does, so its bound is theirs
    added up; past it, every worker that still owes the step an answer is dropped (which one hangs, the head
    cannot tell) and the request ends with the reason. The real worker rejoins at once and the head serves again."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"},
                                                              {"id": "b", "device": "cpu"}],
                              head={"heartbeat_s": 0.5, "heartbeat_timeout_s": 120, "step_timeout_s": 0.5,
                                    "step_timeout_factor": 2, "resume": False})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        b = SilentLastStage(cluster.listen_port, "b")
        cluster.wait_ready()
        started = time.monotonic()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": "hello", "max_tokens": 4})
        waited = time.monotonic() - started
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert "passed from worker to worker (a, b)" in body["error"]["message"], body
        assert 1.5 < waited < 15, waited  # a's and b's first-step bounds (2 x 0.5 s each), added up
        assert b.got.get(timeout=1).message.route == 1  # a did pass it on
        assert b.closed.wait(5)
        cluster.start_worker("b")
        cluster.wait_ready()
        assert greedy_texts(cluster) == relayed_texts
        assert passes_to(cluster) == {"a": "b", "b": "head"}


class ScriptedFirstStage(HandJoinedWorker):
    """A first stage joined by hand whose steps the test answers: each RUN_BATCH from the head lands in `got`,
    and the test passes it on to the next stage (a real worker, through a real Forwarder) or answers the head. Its
    layers are the identity: the rows it passes on are those it was given."""

    def __init__(self, port: int, node_id: str):
        self.routes, self.got = Routes(), queue.Queue()
        self.forwarder = Forwarder(1 << 20)
        super().__init__(port, worker_hello(node_id))

    def received(self, env) -> None:
        if isinstance(env.message, Route):
            self.routes.set(env.message)
        elif isinstance(env.message, RunBatch):
            self.got.put(env)

    def pass_on(self, env, route: Route | None = None) -> None:
        message = env.message
        assert self.forwarder.send(route or self.routes.current, message.passed_on(message.hidden_state, 0.0),
                                   env.request_id, env.seq)

    def answer(self, env, reply) -> None:
        self.conn.send(reply, env.request_id, env.seq)

    def serve(self, done: threading.Event, relay: bool) -> None:
        """Until `done`: pass every step on (`relay` False) or answer it to the head, which carries it on."""
        while not done.is_set():
            try:
                env = self.got.get(timeout=0.1)
            except queue.Empty:
                continue
            if relay:
                self.answer(env, HiddenState(hidden_state=env.message.hidden_state, compute_seconds=0.0))
            else:
                self.pass_on(env)


def serve_until_answered(stage: ScriptedFirstStage, request: Request, relay: bool = False) -> tuple[int, dict]:
    done = threading.Event()
    server = threading.Thread(target=stage.serve, args=(done, relay), daemon=True)
    server.start()
    try:
        return request.wait(120)
    finally:
        done.set()
        server.join()


def test_a_batch_passed_on_before_a_stage_failed_makes_no_cache_the_head_released(tmp_path, model_dir):
    """A step in two groups: the first stage passes one on (a prompt's first positions, which make a cache) and
    fails the other. The head gives the step up and releases both sequences; the group passed on may reach the
    next stage after its RELEASE did, and must not make a cache that nobody will release again: the worker holds
    max_batch caches at most, so a leaked one would fail every full batch after it."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"},
                                                              {"id": "b", "device": "cpu"}],
                              head={"micro_batches": 2, "max_batch": 2, "resume": False})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        a = ScriptedFirstStage(cluster.listen_port, "a")
        cluster.start_worker("b")
        cluster.wait_ready()
        body = {"model": "tiny-qwen", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        first = Request(cluster, {**body, "prompt": "hello"})
        prompt = a.got.get(timeout=60)  # the first request's prompt, held until the second one waits
        second = Request(cluster, {**body, "prompt": "the quick brown fox"})
        while cluster.get("/v1/cluster")[1]["queue"]["waiting"] < 1:
            assert second.thread.is_alive()
            time.sleep(0.05)
        a.pass_on(prompt)
        # the next step holds both: the first request's decode step, and the second's prompt from position 0
        decode, stale = a.got.get(timeout=60), a.got.get(timeout=60)
        assert [e.position_start for e in stale.message.entries] == [0]
        route_of_the_step = a.routes.current
        a.answer(decode, InferenceError(message="CUDA out of memory (as a stage that fails a group says it)"))
        for request in (first, second):
            status, reply = request.wait(60)
            assert status >= 500 and "out of memory" in reply["error"]["message"], reply
        # a step relayed through the head to b: b has read the RELEASE of both sequences, sent to it before that
        third = Request(cluster, {**body, "prompt": "hello"})
        assert serve_until_answered(a, third, relay=True)[0] == 200
        a.pass_on(stale, route_of_the_step)  # the group passed on before the failure reaches b only now
        # two choices: one prompt read, its cache copied, two caches on b, the most it holds
        fourth = Request(cluster, {**body, "prompt": "a b c", "n": 2})
        status, reply = serve_until_answered(a, fourth)
        assert status == 200, reply
        assert len(reply["choices"]) == 2


class ForgetfulNat:
    """A TCP relay to `port` that, once `forget()` is called, drops what the connections open then carry without
    closing them, as a NAT or firewall does with a connection it has forgotten; connections opened later relay."""

    def __init__(self, port: int):
        self.port_to = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.forgotten: set[socket.socket] = set()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside = self.server.accept()[0]
            except OSError:
                return
            outside = socket.create_connection(("127.0.0.1", self.port_to))
            self.pairs.append((inside, outside))
            for src, dst in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if src not in self.forgotten and dst not in self.forgotten:
                    dst.sendall(data)
        except OSError:
            pass

    def forget(self) -> None:
        self.forgotten.update(s for pair in self.pairs for s in pair)

    def close(self) -> None:
        self.server.close()
        for pair in self.pairs:
            for s in pair:
                s.close()


def test_a_link_idle_long_enough_for_a_middlebox_to_forget_it_is_opened_anew(listener, monkeypatch):
    """Nothing crosses a peer link between requests; a NAT or firewall that forgot it took the next batch without a
    word, and the head waited out the step's bound, then dropped every stage. A link idle past PEER_IDLE_REOPEN_S
    is now opened anew before it carries the next batch, and the listener closes the route's old link, whose close
    the middlebox drops too: left open, such links filled its places, and direct hops stopped."""
    monkeypatch.setattr(peers, "PEER_IDLE_REOPEN_S", 0.3)
    nat = ForgetfulNat(listener.port)
    forwarder = Forwarder(1 << 20)
    route = Route(route=3, next_host="127.0.0.1", next_port=nat.port, next_key=KEY, inbound_key=None)
    try:
        assert forwarder.send(route, batch(3, seed=1), "step-1", 1)
        assert listener.got.get(timeout=5).request_id == "step-1"
        assert forwarder.send(route, batch(3, seed=2), "step-2", 1)  # within the idle limit: the same link
        assert listener.got.get(timeout=5).request_id == "step-2"
        assert len(nat.pairs) == 1
        nat.forget()
        for step in range(3, 3 + peers.MAX_PEER_CONNECTIONS + 1):  # more idle spells than the listener has places
            time.sleep(0.5)  # idle past the limit
            assert forwarder.send(route, batch(3, seed=step), f"step-{step}", 1)
            assert listener.got.get(timeout=5).request_id == f"step-{step}"
            assert len(nat.pairs) == step - 1
            nat.forget()
    finally:
        forwarder.close()
        nat.close()


def test_a_loopback_worker_is_routed_at_the_head_s_ipv4_address_unmapped():
    """A head listening dual-stack sees an IPv4 worker's link from an IPv4-mapped address; the worker on the head's
    machine is routed to at the IPv4 address it maps, which a stage without IPv6 reaches too."""
    from tc.protocol.connection import is_loopback, unmapped

    assert unmapped("::ffff:10.0.0.1") == "10.0.0.1"
    assert unmapped("10.0.0.1") == "10.0.0.1" and unmapped("fe80::1") == "fe80::1" and unmapped("host") == "host"
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("::1") and not is_loopback("host")

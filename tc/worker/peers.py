"""Direct hops: a worker passes its stage's output straight to the next worker instead of back through the head.

The head decides the route (ROUTE, one to each worker, whenever the workers of the pipeline change) and each step
says whether to follow it (RUN_BATCH.route). Three parts here, one per thread that uses them:

- `Routes`, the newest ROUTE: the connection's reader sets it, the peer listener checks inbound proofs against
  it, the compute thread forwards by it.
- `PeerListener`, the worker's side for the stage before it: a listening socket, and per accepted connection a
  handshake (a fresh nonce; the stage before proves the route's key over it, tc.protocol.auth.peer_proof, the key
  bound to the join token when the cluster has one, and the listener proves it back over the other's nonce) and a
  reader that hands each RUN_BATCH of that route to the compute thread, like one from the head.
- `Forwarder`, the compute thread's link to the next stage: connected on first use for each route, and again
  after it has been idle a minute (a middlebox may have forgotten it), proven both ways. When it cannot connect
  or send, the route counts as cut: the worker replies to the head instead (which then carries the output on
  itself), and tries the next stage again after a backoff, so a next stage that cannot be reached costs speed,
  never a request. A batch over the next stage's frame limit goes through the head.

Anything a peer sends that breaks the protocol, or a proof that does not hold, closes that one peer connection.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from ..protocol.auth import check_peer_proof, new_nonce, peer_proof, route_key
from ..protocol.connection import Connection, connect, oldest_of_busiest_host
from ..protocol.errors import ConnectionClosed, ProtocolError
from ..protocol.framing import Envelope
from ..protocol.messages import (ERROR_HELLO_REFUSED, ERROR_PROTOCOL, PROTOCOL_VERSION, Error, PeerAck,
                                 PeerChallenge, PeerHello, Route, RunBatch)
from ..topology import HostPort
from ..trace import mark

log = logging.getLogger(__name__)

PEER_HANDSHAKE_TIMEOUT_S = 10.0  # a peer link's whole handshake, either side
PEER_HANDSHAKE_MAX_FRAME_BYTES = 4096  # a frame before the proof holds (a PEER_HELLO is ~150 bytes)
# What a frame over a peer link's limit is taken for (FrameTooLarge says it, in the log and to the other end):
# before the proof the cap is this fixed one, which no setting raises; after it, the listener's --max-frame-mb,
# which it told the stage before (PEER_ACK) so that a larger batch goes through the head instead
HANDSHAKE_FRAME_ADVICE = ("a peer link's handshake frames are a few hundred bytes, whatever the frame limits: the "
                          "other end is not a tc worker of this release")
PROVEN_FRAME_ADVICE = ("that is this worker's --max-frame-mb (TC_MAX_FRAME_MB), which the stage before was told and "
                       "should have sent a larger batch through the head for: run the same tc release on every "
                       "worker, or start this one with a larger --max-frame-mb")
PEER_CONNECT_TIMEOUT_S = 3.0  # reaching the next stage: once per route, on the compute thread
# A send to the next stage that blocks this long (it stopped reading: frozen, or its machine gone without a word)
# cuts the route, so the compute thread is never held for good; the head's step bound judges the stage itself.
PEER_SEND_TIMEOUT_S = 30.0
MAX_PEER_CONNECTIONS = 8  # peer connections open at once; one per route is all a healthy pipeline uses
FULL_WARNING_EVERY_S = 60.0  # refused connections are logged at most this often
RETRY_FIRST_S, RETRY_MAX_S = 30.0, 600.0  # a next stage that could not be reached is tried again after these
# A link to the next stage that carried nothing for this long is opened anew before its next batch. Nothing else
# crosses a peer link (the head's links have its PINGs), and a NAT or firewall between two machines forgets an idle
# connection without a word: a batch sent into one is lost, the kernel taking it all the same, and the head waits
# out the step's bound before it drops the stages. A handshake (a few ms) after each idle minute costs nothing.
PEER_IDLE_REOPEN_S = 60.0
PROVEN_IDLE_S = 2 * PEER_IDLE_REOPEN_S  # a link in silent this long is closed (PeerListener._handshake)


class Routes:
    """The newest ROUTE from the head, shared by the threads of one connection to it."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._current: Route | None = None

    @property
    def current(self) -> Route | None:
        return self._current

    def set(self, route: Route) -> None:
        with self._changed:
            if self._current is None or route.route > self._current.route:
                self._current = route
                self._changed.notify_all()

    def wait_for(self, route_id: int, timeout_s: float, given_up: Callable[[], bool] = lambda: False) -> Route | None:
        """The route `route_id` once the head has sent it (a peer may connect before our ROUTE arrives); None when
        a newer one came first, none did within `timeout_s`, or `given_up()` holds at a `wake()`."""
        with self._changed:
            self._changed.wait_for(lambda: given_up() or (self._current is not None and
                                                          self._current.route >= route_id), timeout_s)
            current = self._current
        return current if current is not None and current.route == route_id else None

    def wake(self) -> None:
        """Have every wait_for look at its `given_up` again."""
        with self._changed:
            self._changed.notify_all()


class PeerListener:
    """Takes RUN_BATCH from the stage before this one; `deliver(envelope)` hands each to the compute thread.

    The port listens at once (HELLO names it; a peer that connects before this worker has its ROUTE waits in the
    backlog), but connections are accepted and read only from `start()`, once the head's ROUTE gives this worker a
    link in: a worker that is first in the pipeline, or in a cluster that relays, reads nothing from its port.
    Until a peer has proven the route's key it may send only small frames, and the whole handshake has one
    deadline however the peer paces its bytes; with MAX_PEER_CONNECTIONS open, the oldest still in its handshake
    (of the host holding most) gives way to a new one. A link proven for a newer route closes those of older ones.
    """

    def __init__(self, host: str, port: int, routes: Routes, deliver: Callable[[Envelope], None],
                 max_frame_bytes: int, join_key: bytes | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        if host == "::" and socket.has_dualstack_ipv6():  # every address: IPv4 peers too, whatever the default
            self._server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            if port:  # a fixed port: rebinding it at once after a restart must not fail on TIME_WAIT
                self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._server.bind((host, port))
            self._server.listen()
        except OSError:
            self._server.close()
            raise
        self.host, self.port = host, self._server.getsockname()[1]
        self._routes, self._deliver, self._max_frame_bytes = routes, deliver, max_frame_bytes
        self._join_key = join_key
        self._lock = threading.Lock()
        self._open: dict[Connection, int] = {}  # each connection, and the route it was proven for (0: not yet)
        self._closed = False
        self._accepting = False
        self._last_full_warning = 0.0

    @property
    def address(self) -> str:
        return str(HostPort(self.host, self.port))

    def start(self) -> None:
        """Accept connections from now on (idempotent; without a thread to accept on, the next call tries again)."""
        with self._lock:
            if self._accepting or self._closed:
                return
            self._accepting = True
        try:
            threading.Thread(target=self._accept_loop, name=f"peer-listen-{self.port}", daemon=True).start()
        except RuntimeError as exc:
            # a thread or memory limit, maybe for a moment: the stage before, its handshake unanswered, passes
            # through the head, and the next ROUTE tries again; raised, it would end the reader of the head's link
            with self._lock:
                self._accepting = False
            log.warning("cannot take hidden states from the stage before now: no thread to accept on (%s); they "
                        "come through the head", exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            open_now = list(self._open)
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._server.close()
        for conn in open_now:
            conn.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                with self._lock:
                    if self._closed:
                        return
                # EMFILE, or ECONNABORTED (BSD and macOS, for a connection reset while it waited to be accepted):
                # this thread goes on, or no link in could open again; it backs off rather than spin
                time.sleep(0.1)
                continue
            conn = Connection(sock, max_frame_bytes=PEER_HANDSHAKE_MAX_FRAME_BYTES)
            conn.frame_limit_advice = HANDSHAKE_FRAME_ADVICE
            with self._lock:
                # Full, the oldest connection still in its handshake (of the host holding most) gives way: the
                # stage before finishes its own within a round trip or two, so those that sit idle (a plain TCP
                # connect takes a place, no key needed) are the ones that go, and it still gets in. Refusing the
                # newcomer instead had the stage before pass through the head, and back off for up to RETRY_MAX_S,
                # for as long as they kept coming.
                full = len(self._open) >= MAX_PEER_CONNECTIONS
                waiting = {c: c.peer for c, route in self._open.items() if route == 0}
                oldest = oldest_of_busiest_host(waiting, conn.peer) if full else None
                if self._closed or (full and oldest is None):
                    conn.close()
                    now = time.monotonic()
                    if not self._closed and now - self._last_full_warning > FULL_WARNING_EVERY_S:
                        self._last_full_warning = now
                        log.warning("refusing peer connections (from %s, and any more for %.0fs unless one closes): "
                                    "%d are open already", conn.peer, FULL_WARNING_EVERY_S, MAX_PEER_CONNECTIONS)
                    continue
                if oldest is not None:
                    del self._open[oldest]
                self._open[conn] = 0
                now = time.monotonic()
                warn = oldest is not None and now - self._last_full_warning > FULL_WARNING_EVERY_S
                if warn:
                    self._last_full_warning = now
            if oldest is not None:
                self._give_up(oldest)
            if warn:
                log.warning("closed a peer connection still in its handshake (from %s) for a newer one (from %s), and "
                            "any more for %.0fs: %d may be open at once, and something keeps connections to this "
                            "worker's peer port open without proving a route", oldest.peer, conn.peer,
                            FULL_WARNING_EVERY_S, MAX_PEER_CONNECTIONS)
            try:
                threading.Thread(target=self._serve, args=(conn,), name=f"peer-{conn.peer}", daemon=True).start()
            except RuntimeError as exc:
                # a thread or memory limit, maybe for a moment: this peer is turned away (the stage before passes
                # through the head, and tries again later), and this thread goes on, or no link in could open again
                log.warning("turned away a peer connection from %s: no thread to handle it (%s)", conn.peer, exc)
                with self._lock:
                    self._open.pop(conn, None)
                conn.close()
                time.sleep(0.1)  # as for EMFILE: back off rather than spin

    def _serve(self, conn: Connection) -> None:
        try:
            route = self._handshake(conn)
            if route is None:
                return
            log.info("the stage before this one (%s) passes hidden states straight here (route %d)", conn.peer,
                     route)
            while True:
                env = conn.recv()
                mark("peer received")
                msg = env.message
                if not isinstance(msg, RunBatch) or msg.route != route:
                    what = msg.TYPE if not isinstance(msg, RunBatch) else f"RUN_BATCH of route {msg.route}"
                    raise ProtocolError(f"a peer link of route {route} carries RUN_BATCH of that route, not {what}")
                self._deliver(env)
        except ProtocolError as exc:
            log.warning("peer %s broke the protocol (%s); closing its connection", conn.peer, exc)
            _tell(conn, Error(code=ERROR_PROTOCOL, message=str(exc)))
        except (ConnectionClosed, OSError):
            pass  # the stage before moved to a newer route, or left: the head hears of it on its own links
        finally:
            conn.close()
            with self._lock:
                self._open.pop(conn, None)

    def _give_up(self, conn: Connection) -> None:
        """End a connection still in its handshake: its thread wakes, whether it reads its handshake or waits for
        the route it came for (a route number no ROUTE has named yet, sent by anyone who can reach the port, kept
        each such thread for the whole deadline after its place had gone to a newer connection)."""
        conn.close()
        self._routes.wake()

    def _handshake(self, conn: Connection) -> int | None:
        """The route the peer proved it may send on; None (the connection refused) when it could not."""
        # the whole handshake, however paced
        deadline = threading.Timer(PEER_HANDSHAKE_TIMEOUT_S, self._give_up, args=(conn,))
        deadline.daemon = True
        deadline.start()
        try:
            nonce = new_nonce()
            conn.send(PeerChallenge(nonce=nonce))
            msg = conn.recv().message
            if not isinstance(msg, PeerHello):
                raise ProtocolError(f"expected PEER_HELLO, got {msg.TYPE}")
            if msg.protocol_version != PROTOCOL_VERSION:
                _tell(conn, Error(code=ERROR_HELLO_REFUSED, message=f"protocol {msg.protocol_version} against this "
                                  f"worker's {PROTOCOL_VERSION}: run the same tc release on every machine"))
                return None
            route = self._routes.wait_for(msg.route, PEER_HANDSHAKE_TIMEOUT_S, lambda: conn.closed)
            if conn.closed:
                return None
            newest = self._routes.current
            if route is None and newest is not None and newest.route > msg.route:
                # the head moved on (a step given up, a worker replaced) before the stage before first used the
                # route: no link is wanted for it, and nothing is wrong with the peer
                log.info("a peer connection from %s came for route %d, which route %d has replaced; closing it",
                         conn.peer, msg.route, newest.route)
                _tell(conn, Error(code=ERROR_HELLO_REFUSED, message=f"route {msg.route} was replaced by route "
                                  f"{newest.route}"))
                return None
            key = None if route is None or route.inbound_key is None else route_key(self._join_key,
                                                                                    route.inbound_key)
            if key is None or not check_peer_proof(key, nonce, msg.proof):
                log.warning("refused a peer connection from %s: it could not prove the head routed it here "
                            "(route %d)", conn.peer, msg.route)
                _tell(conn, Error(code=ERROR_HELLO_REFUSED, message=f"route {msg.route} is not this worker's, or "
                                  "the proof for it is wrong"))
                return None
            conn.send(PeerAck(route=msg.route, proof=peer_proof(key, msg.nonce, listener=True),
                              max_frame_bytes=self._max_frame_bytes))
        finally:
            deadline.cancel()
        if conn.closed:
            return None
        conn.max_frame_bytes, conn.frame_limit_advice = self._max_frame_bytes, PROVEN_FRAME_ADVICE
        # the stage before opens its link anew after PEER_IDLE_REOPEN_S without a batch (Forwarder), so one silent
        # for longer is no longer used: its machine may be gone, without a FIN, and it would hold its place, its
        # thread and a buffer as large as the largest batch
        conn.settimeout(PROVEN_IDLE_S)
        with self._lock:
            self._open[conn] = msg.route
            older = [c for c, r in self._open.items() if c is not conn and 0 < r <= msg.route]
        # the stage before has moved on to this route (or a worker in its place has), or opened this route's link
        # anew after an idle spell (Forwarder): one sender per route, so its older link is done with, though its
        # close may never come (the middlebox that forgot it drops the FIN too) and would hold a place for good
        for stale in older:
            stale.close()
        return msg.route


def _tell(conn: Connection, message: Error) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


class Forwarder:
    """The compute thread's connection to the next stage's `PeerListener`, one route at a time."""

    def __init__(self, max_frame_bytes: int, join_key: bytes | None = None):
        self._max_frame_bytes = max_frame_bytes
        self._join_key = join_key
        self._conn: Connection | None = None
        self._route = 0  # the route `_conn` was opened for
        self._cut = 0  # a route whose next stage could not be reached or written to: replies go to the head
        self._retry_at = 0.0  # when to try that route's next stage again
        self._retry_after_s = RETRY_FIRST_S
        self._used_at = 0.0  # when `_conn` last carried a batch

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def send(self, route: Route, message: RunBatch, request_id: str | None, seq: int) -> bool:
        """Pass `message` to the next stage of `route`; False when it went nowhere (the head then gets it)."""
        if route.next_host is None or route.next_port is None or route.next_key is None:
            return False
        now = time.monotonic()
        if route.route == self._cut and now < self._retry_at:
            return False
        where = str(HostPort(route.next_host, route.next_port))
        try:
            if self._conn is None or self._route != route.route or now - self._used_at > PEER_IDLE_REOPEN_S:
                idle = self._conn is not None and self._route == route.route
                self.close()
                self._conn = self._open(route)
                self._route, self._used_at = route.route, now  # a batch too large for it below: not idle again
                log.log(logging.DEBUG if idle else logging.INFO, "passing hidden states straight to the next stage "
                        "at %s (route %d%s)", where, route.route, ", a new link after an idle one" if idle else "")
                if self._cut == route.route:
                    self._cut, self._retry_after_s = 0, RETRY_FIRST_S
            self._conn.send(message, request_id, seq)
            self._used_at = now
            return True
        except ValueError as exc:  # over the next stage's frame limit: nothing was sent, the link stays
            log.warning("%s; this batch goes through the head", exc)
            return False
        except (OSError, ProtocolError) as exc:  # ConnectionClosed is an OSError
            first = self._cut != route.route
            if first:
                self._retry_after_s = RETRY_FIRST_S
            log.log(logging.WARNING if first else logging.DEBUG, "cannot pass hidden states to the next stage at %s "
                    "(%s); replying through the head for route %d, trying again in %.0fs (open the next worker's "
                    "--peer-port to this machine, or give it --peer-host with an address this machine reaches, or "
                    "--no-direct-hops)", where, exc, route.route, self._retry_after_s)
            self.close()
            self._cut, self._retry_at = route.route, time.monotonic() + self._retry_after_s
            self._retry_after_s = min(self._retry_after_s * 2, RETRY_MAX_S)
            return False

    def _open(self, route: Route) -> Connection:
        assert route.next_host is not None and route.next_port is not None and route.next_key is not None
        key = route_key(self._join_key, route.next_key)
        conn = connect(route.next_host, route.next_port, timeout=PEER_CONNECT_TIMEOUT_S,
                       max_frame_bytes=PEER_HANDSHAKE_MAX_FRAME_BYTES)
        conn.frame_limit_advice = HANDSHAKE_FRAME_ADVICE  # it reads only in the handshake
        deadline = threading.Timer(PEER_HANDSHAKE_TIMEOUT_S, conn.close)  # the whole handshake, however paced
        deadline.daemon = True
        try:
            deadline.start()
        except RuntimeError as exc:
            # a thread or memory limit, maybe for a moment: the link is not opened now (the head carries this
            # stage's output on, and the link is tried again later), where raised on it would end the compute
            # thread, and with it this worker's place at the head
            conn.close()
            raise OSError(f"no thread to bound the handshake with ({exc})") from exc
        try:
            conn.settimeout(PEER_HANDSHAKE_TIMEOUT_S)
            challenge = conn.recv().message
            if not isinstance(challenge, PeerChallenge):
                raise ProtocolError(f"expected PEER_CHALLENGE, got {challenge.TYPE}")
            nonce = new_nonce()
            conn.send(PeerHello(protocol_version=PROTOCOL_VERSION, route=route.route,
                                proof=peer_proof(key, challenge.nonce), nonce=nonce))
            ack = conn.recv().message
            if isinstance(ack, Error):
                raise ProtocolError(f"the next stage refused: {ack.message}")
            if not isinstance(ack, PeerAck) or ack.route != route.route:
                raise ProtocolError(f"expected PEER_ACK for route {route.route}, got {ack.TYPE}")
            if not check_peer_proof(key, nonce, ack.proof, listener=True):
                raise ProtocolError("the next stage could not prove the head routed this worker to it: something "
                                    "else listens at its address")
            conn.settimeout(PEER_SEND_TIMEOUT_S)
            conn.max_frame_bytes = min(self._max_frame_bytes, ack.max_frame_bytes)  # what send may write
            return conn
        except BaseException:
            conn.close()
            raise
        finally:
            deadline.cancel()

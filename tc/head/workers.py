"""The head's side of the worker connections: admission, assignment, liveness, and request/reply.

Each planned node has a slot. A joining worker proves it knows the join token when the topology sets one
(tc.protocol.auth), is matched to a slot (admission.py), sent its ASSIGNMENT, and is ready once it reports
LOAD_COMPLETE. When the topology asks for a plan from the workers' own measurements (head.plan_from: workers), the
registry starts without a plan: each joining worker holds its slot ("planning") until every slot is held and every
held worker's link has been probed, then `plan_once` makes the plan from their HELLOs and links, once, and every
held worker gets its ASSIGNMENT. From then on the plan never changes: a worker that rejoins gets the same layers, a
spare a lost node's. A worker that joins as a spare entry stands by until some slot loses its worker, then is
assigned that slot's layers.

Threads per admitted worker: a reader that routes replies to whoever waits on them and notices a closed socket at
once, and a pinger, which first probes the link (empty PINGs for its round trip, PINGs carrying a prefill's hidden
states for its bandwidth: what the plan's hops cost), then keeps it alive. One watch thread drops any worker that
has been silent (no reply, no PONG) for longer than the topology's heartbeat_timeout_s: a stopped process or a cut
link, whose socket never closes. A worker whose compute hangs still answers pings, so each inference step also has
a bound of its own, from the worker's measured step times (step_deadline.py); the request that waits past it drops
the worker the same way. Dropping closes the socket, which also wakes a thread blocked sending to it. Losing a
worker frees its slot for the next worker that joins: the head never needs a restart.

A joining peer has HELLO_TIMEOUT_S for its whole handshake, however it paces its bytes; at most
MAX_PENDING_HANDSHAKES are in progress at once, and a connection past that closes the oldest of them: a worker
finishes its handshake within a round trip or two, so connections that sit idle to fill the places (a plain TCP
connect takes one, no token needed) are the ones that go, and a worker still gets in. Stopping tells every worker
(an ERROR shutting_down) before closing its connection.

Anything a peer sends that breaks the protocol (garbage, an oversized or out-of-order frame, a reply nobody
asked for, a hidden state of the wrong shape) closes that one connection with an ERROR saying why.
"""
from __future__ import annotations

import errno
import itertools
import logging
import queue
import statistics
from collections import deque
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from .. import full_version
from ..batch_memory import BatchPlan, plan_batch
from ..forecast import hop_bytes_per_position
from ..model.config import ModelConfig
from ..model.weights import layer_tensor_names
from ..planner import Plan, PlanError, Stage, format_bytes
from ..protocol.auth import AuthError, check_answer, check_nonce, make_challenge, token_key
from ..protocol.connection import Connection, oldest_of_busiest_host
from ..protocol.errors import ConnectionClosed, ProtocolError
from ..protocol.messages import (ERROR_COMPUTE_FAILED, ERROR_HELLO_REFUSED, ERROR_NODE_TAKEN, ERROR_PROTOCOL,
                                 ERROR_SHUTTING_DOWN, Assignment, Error, Hello, HelloAck, HiddenState, InferenceError,
                                 LoadComplete, LoadFailed, LoadProgress, Message, Ping, Pong, Release, Route,
                                 RunBatch)
from ..protocol.tensors import WIRE_DTYPES
from ..speed import LinkSpeed
from ..topology import MIB, WILDCARD_HOSTS, HostPort, Topology, TopologyError
from ..trace import mark
from .addresses import bind_address
from .admission import (NodeTaken, Refusal, build_mismatch, caches_short_of_the_batch, choose_entry, device_for,
                        dtype_fallback, sequences_to_hold, stage_fit_problem)
from .service import Readiness, StageFailed, WorkerLost
from .step_deadline import StepBudget, StepClock

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # the whole handshake, both rounds when a token is set: a deadline, not a per-read limit
HANDSHAKE_MAX_FRAME_BYTES = 1 << 20  # a HELLO is a few hundred bytes; a peer not yet admitted gets no more
MAX_PENDING_HANDSHAKES = 32  # connections still in their handshake; one more closes the oldest
EVICTION_WARNING_EVERY_S = 60.0  # handshakes closed for newer ones are logged at most this often
SLOT_HISTORY = 50  # joins and losses remembered per slot, for operators
RECENT_DECODES = 32  # decode steps per worker kept for /v1/cluster's measured times
FAREWELL_TIMEOUT_S = 1.0  # on stop, the longest wait for the workers to read the ERROR shutting_down and hang up
SHUTTING_DOWN_WORD = "the head is shutting down; rejoin when it is back"
_LOST = object()  # put on a link's reply queue when its connection ends
PROBE_ECHOES = 5  # PINGs of each size when a link is probed: the least time of each is the link's own
PROBE_TIMEOUT_S = 5.0  # the longest wait for one probe's PONG; a worker that does not answer is left unmeasured
# a step's frame past its hidden states: the envelope, and per sequence its entry and release (~85 bytes measured)
STEP_FRAME_MARGIN, STEP_FRAME_MARGIN_PER_SEQUENCE = 512, 96
PROBE_POSITIONS = 512  # the large probe carries this many positions of hidden states: one prefill's frame
PING_FORGET_S = 60.0  # a PING unanswered this long is forgotten
PROBE_FRAME_MARGIN = 4096  # the envelope around a probe's payload


class _Stopping(Exception):
    """A worker is joining a head that is stopping: it is told so, and rejoins later."""


class Doorbell:
    """Wakes the thread waiting for any link's reply: `ring` once a reply is queued (or a link lost), `wait` until
    it rings or the timeout passes.

    A lock used as a one-ring bell, so that ringing and waking are C: a Condition's wait and notify run Python,
    which every decode step paid twice over on caches cold from the stages' weights (a hand-over took 114-120 us
    with a Condition, 56-70 with this). One thread waits at a time (the pipeline runs one step at a time). Rings
    while nobody waits leave one ring pending, so a wait may return with no reply: the waiter looks at its links
    and waits again, as it would after a Condition's wake."""

    def __init__(self) -> None:
        self._bell = threading.Lock()
        self._bell.acquire()  # held: silent until the first ring

    def ring(self) -> None:
        try:
            self._bell.release()
        except RuntimeError:
            pass  # rung already and not yet heard: one ring pending is all a waiter needs

    def wait(self, timeout: float) -> None:
        self._bell.acquire(timeout=max(0.0, timeout))


class WorkerLink:
    """One admitted worker's connection.

    `entry_id` is the topology entry the worker joined as; `node_id` the planned node whose layers it serves,
    which differs for a spare that took over a lost node, and is None while a spare stands by. `drop(link,
    reason)` is how a request that waited past its step's bound has the registry drop the worker; `arrived` rings
    whenever a reply arrives or the link is lost (shared by every link, so a step passed from worker to worker can
    wait on all of them at once).
    """

    def __init__(self, conn: Connection, entry_id: str, hello: Hello, device: str, peer: str, hidden_size: int,
                 budget: StepBudget, drop: Callable[["WorkerLink", str], None], arrived: Doorbell):
        self.conn, self.entry_id, self.hello, self.device, self.peer = conn, entry_id, hello, device, peer
        self.node_id: str | None = None
        self.hostname = hello.hostname
        self.hidden_size = hidden_size
        self.steps = StepClock(budget)  # this connection's own: a rejoined worker is measured afresh
        self._drop = drop
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # C put and get: every decode step's answer passes here
        self.arrived = arrived
        self.closed = threading.Event()
        self.close_reason = ""
        self._close_lock = threading.Lock()  # the reader, the watch and a request may close at once: one wins
        self.farewell = ""  # what the worker said before it left, if it said anything
        self.last_seen = time.monotonic()
        self._pongs = threading.Condition()  # guards the ping bookkeeping below; notified by each PONG
        self._nonces = itertools.count(1)
        self._pings_sent: dict[int, tuple[float, bool]] = {}  # nonce -> (when, awaited by `round_trip`)
        self._answered: dict[int, float] = {}  # nonce -> round trip, for a `round_trip` call waiting on it
        self.round_trip_s: float | None = None  # the least empty PING -> PONG time seen: the link's own latency
        self.bytes_per_s: float | None = None  # from the link probe (`measure`), once it has run
        self.probed = threading.Event()  # the link probe has run (whatever it found)
        self.decode_compute_s: deque[float] = deque(maxlen=RECENT_DECODES)  # the worker's own step time
        self.decode_round_trip_s: deque[float] = deque(maxlen=RECENT_DECODES)  # the same steps, seen from here
        self.passes_to: str | None = None  # where its last step's output went: the next node's id, or "head"
        # the command send_expected is sending now: the watch drops a worker that takes it for longer than its
        # step's bound (a send has no bound of its own, and the one scheduler waits in it)
        self.sending: Sent | None = None
        self._pending_lock = threading.Lock()
        # (request_id, seq, may pass it on) of each command awaiting its reply, in the order the worker takes them:
        # several when a step's groups reach it from the stage before (direct hops), and a worker that may pass
        # its output on to the next stage answers the head only when it cannot
        self._pending: deque[tuple[str, int, bool]] = deque()
        self._abandoned: deque[str] = deque(maxlen=64)  # steps given up: their late replies are dropped

    @property
    def name(self) -> str:
        """How logs and errors name this worker: the node it serves, and the spare entry if it is one."""
        node = self.node_id or self.entry_id
        return node if node == self.entry_id else f"{node} (spare {self.entry_id})"

    def close(self, reason: str) -> None:
        """Close the link for `reason`; the first of several closers gives the reason every waiter hears."""
        with self._close_lock:
            if self.closed.is_set():
                return
            self.close_reason = reason
            self.closed.set()
        self.replies.put(_LOST)
        self._announce()
        self.conn.close()
        with self._pongs:
            self._pongs.notify_all()  # a probe waiting for a PONG gives up at once

    def refuse(self, problem: str) -> None:
        """Close for a protocol violation, telling the worker why first (best effort)."""
        try:
            self.conn.send(Error(code=ERROR_PROTOCOL, message=problem))
        except (OSError, ValueError):
            pass
        self.close(f"protocol error: {problem}")

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """Where the stage before may pass hidden states straight to this worker; None: through the head only."""
        host = self.hello.peer_host or self.conn.peer_host
        return None if self.hello.peer_port is None or host is None else (host, self.hello.peer_port)

    def deliver(self, env) -> None:
        """Hand a reply to the waiting request. Raises ProtocolError for a reply nobody asked for."""
        with self._pending_lock:
            if env.request_id in self._abandoned:
                return  # a step that failed elsewhere: nobody waits for it any more
            # Not necessarily the oldest: with direct hops a worker may get one group of a step from the stage
            # before and the next from the head, by two connections, and commands it passed on stay listed until
            # the step settles.
            for i, (request_id, seq, _) in enumerate(self._pending):
                if (request_id, seq) == (env.request_id, env.seq):
                    del self._pending[i]
                    break
            else:
                awaiting = f"{self._pending[0][0]} #{self._pending[0][1]}" if self._pending else "nothing"
                raise ProtocolError(f"{env.message.TYPE} for {env.request_id} #{env.seq}, which was not asked for "
                                    f"(awaiting {awaiting})")
            self.replies.put(env)  # under the lock, so that `abandon` never misses one on its way
        self._announce()

    def _announce(self) -> None:
        self.arrived.ring()

    def abandon(self, request_id: str) -> None:
        """A step that failed: forget its commands still awaiting replies here, and drop those replies if they come
        (a stage may have been passed a group before the step failed elsewhere)."""
        with self._pending_lock:
            self._abandoned.append(request_id)
            self._pending = deque(p for p in self._pending if p[0] != request_id)
            kept = []
            while True:  # replies already delivered for it, ahead of the next step's
                try:
                    item = self.replies.get_nowait()
                except queue.Empty:
                    break
                if item is _LOST or item.request_id != request_id:
                    kept.append(item)
            for item in kept:
                self.replies.put(item)

    def settle(self, request_id: str) -> None:
        """A step passed along worker to worker has ended: the commands of it this worker answered nothing for
        were passed on, and no answer to them will come."""
        with self._pending_lock:
            self._pending = deque(p for p in self._pending if p[0] != request_id)

    def awaits(self, request_id: str) -> bool:
        with self._pending_lock:
            return any(p[0] == request_id for p in self._pending)

    def send_route(self, route: Route) -> None:
        """Tell the worker where its output goes (no reply). Raises WorkerLost."""
        try:
            self.conn.send(route)
        except OSError as exc:
            self.close(f"send failed: {exc}")
            raise WorkerLost(self.node_id or self.entry_id, self.close_reason) from exc

    def release(self, sequences: list[int]) -> None:
        """Tell the worker these sequences ended (no reply). A link that is gone has dropped every cache anyway."""
        if self.closed.is_set():
            return
        try:
            self.conn.send(Release(sequences=tuple(sequences)))
        except OSError as exc:
            self.close(f"send failed: {exc}")

    def request(self, message: RunBatch, request_id: str, seq: int) -> HiddenState:
        """Send one inference command and wait for its reply, up to the step's bound (step_deadline.py).

        Raises WorkerLost (the worker is gone, or was dropped for missing the bound) or StageFailed.
        """
        return self.await_reply(self.send_command(message, request_id, seq))

    def send_command(self, message: RunBatch, request_id: str, seq: int) -> "Sent":
        """Send one inference command without waiting; `await_reply` takes what this returns. Raises WorkerLost."""
        return self.send_expected(self.expect(message, request_id, seq))

    def expect(self, message: RunBatch, request_id: str, seq: int, may_pass: bool = False) -> "Sent":
        """Await a reply to `message` without sending it: the stage before passes it here (direct hops), or the
        head does later with `send_expected`. `may_pass`: the worker may pass its output on to the next stage
        instead of answering. Raises WorkerLost."""
        if self.closed.is_set():
            raise WorkerLost(self.node_id or self.entry_id, self.close_reason)
        positions = message.hidden_state.shape[1]
        kind = "decode" if message.is_decode else "prefill"
        with self._pending_lock:
            self._pending.append((request_id, seq, may_pass))
        return Sent(message, kind, positions, self.steps.bound(kind, positions), time.monotonic(), request_id, seq)

    def send_expected(self, sent: "Sent", message: RunBatch | None = None) -> "Sent":
        """Send the command `expect` registered (or `message` in its place: the same rows, computed since).
        Raises WorkerLost."""
        self.sending = sent
        try:
            self.conn.send(message or sent.message, sent.request_id, sent.seq)
        except OSError as exc:
            self.close(f"send failed: {exc}")
            raise WorkerLost(self.node_id or self.entry_id, self.close_reason) from exc
        finally:
            self.sending = None
        return sent

    def await_reply(self, sent: "Sent") -> HiddenState:
        """The reply to the command `send_command` sent, within its bound. Raises WorkerLost or StageFailed."""
        try:
            item = self.replies.get(timeout=max(0.0, sent.bound - (time.monotonic() - sent.at)))
        except queue.Empty:
            self.drop(f"no reply to {sent.message.TYPE} within {sent.bound:.3g}s "
                      f"({self.steps.explain(sent.kind, sent.positions)}): its compute is hung or has failed")
            raise WorkerLost(self.node_id or self.entry_id, self.close_reason) from None
        reply = self.accept(sent, item)
        self.record(sent, time.monotonic() - sent.at, reply.compute_seconds)
        return reply

    def take_reply(self):
        """A reply (or the mark of a lost connection) that has arrived, without waiting; None if none has. For
        `accept`."""
        try:
            return self.replies.get_nowait()
        except queue.Empty:
            return None

    def accept(self, sent: "Sent", item) -> HiddenState:
        """Check a reply taken from this link to the command `sent`. Raises WorkerLost or StageFailed."""
        node = self.node_id or self.entry_id
        if item is _LOST:
            self.replies.put(_LOST)  # later waiters must see it too
            raise WorkerLost(node, self.close_reason)
        if isinstance(item.message, (InferenceError, Error)):
            raise StageFailed(node, item.message.message)
        hidden = item.message.hidden_state  # [1, positions, hidden]
        expected = (1, sent.positions, self.hidden_size)
        if tuple(hidden.shape) != expected:
            self.refuse(f"HIDDEN_STATE has shape {list(hidden.shape)}; {sent.message.TYPE} of {sent.positions} "
                        f"row(s) needs {list(expected)}")
            raise WorkerLost(node, self.close_reason)
        return item.message

    def record(self, sent: "Sent", elapsed: float, compute_s: float) -> None:
        """What one step took this worker: `elapsed` from the head's view (its bound learns from it), `compute_s`
        from its own."""
        self.steps.record(sent.kind, sent.positions, elapsed)
        if sent.kind == "decode" and sent.positions == len(sent.message.entries):  # one row each, as predicted
            self.decode_compute_s.append(compute_s)
            self.decode_round_trip_s.append(elapsed)

    def drop(self, reason: str) -> None:
        """Have the registry drop this worker (it missed its step's bound)."""
        self._drop(self, reason)

    @property
    def link_speed(self) -> LinkSpeed | None:
        """The link as measured so far: the least empty-ping round trip, and the probe's bandwidth."""
        return None if self.round_trip_s is None else LinkSpeed(self.round_trip_s, self.bytes_per_s)

    def ping(self, payload: bytes = b"", awaited: bool = False) -> int:
        """Send a PING; returns its nonce. Raises OSError when the send fails."""
        nonce = next(self._nonces)
        now = time.monotonic()
        with self._pongs:
            # a PONG that never comes must not leave its entry behind for the life of the link
            self._pings_sent = {n: sent for n, sent in self._pings_sent.items() if now - sent[0] < PING_FORGET_S}
            self._pings_sent[nonce] = (now, awaited)
        self.conn.send(Ping(nonce=nonce, payload=payload))
        return nonce

    def pong(self, nonce: int, payload: bytes) -> None:
        with self._pongs:
            sent = self._pings_sent.pop(nonce, None)
            if sent is None:
                return
            rtt = time.monotonic() - sent[0]
            if not payload:
                self.round_trip_s = rtt if self.round_trip_s is None else min(self.round_trip_s, rtt)
            if sent[1]:
                self._answered[nonce] = rtt
                self._pongs.notify_all()

    def round_trip(self, payload: bytes, timeout_s: float) -> float | None:
        """Seconds from a PING with `payload` to its PONG; None if none came within `timeout_s` or the link
        closed. Raises OSError when the send fails."""
        nonce = self.ping(payload, awaited=True)
        with self._pongs:
            self._pongs.wait_for(lambda: nonce in self._answered or self.closed.is_set(), timeout_s)
            self._pings_sent.pop(nonce, None)
            return self._answered.pop(nonce, None)

    def measure(self, payload_bytes: int, timeout_s: float) -> LinkSpeed | None:
        """Probe the link: a few empty PINGs for its latency, then a few carrying `payload_bytes` (a prefill's
        hidden states) for its bandwidth. Sets what `link_speed` reports and `probed`; returns the link, or None
        when the worker did not answer. Raises OSError when a send fails."""
        small: list[float] = []
        large: list[float] = []
        # small and large take turns, so that whatever else the machines do hits both alike
        turn = ((small, b""), (large, bytes(payload_bytes))) if payload_bytes else ((small, b""),)
        for times, payload in turn * PROBE_ECHOES:
            rtt = self.round_trip(payload, timeout_s)
            if rtt is None:  # no answer: sending more (a large payload) to a worker not reading would block
                break
            times.append(rtt)
        found = LinkSpeed.from_probes(small, large, payload_bytes)
        if found is not None:  # the small PONGs set round_trip_s already
            self.bytes_per_s = found.bytes_per_s
        self.probed.set()
        return self.link_speed


@dataclass(frozen=True)
class Sent:
    """An inference command on its way: what `await_reply` needs to wait for its answer."""

    message: RunBatch
    kind: str  # "prefill" or "decode", for the step's bound
    positions: int
    bound: float  # seconds the reply may take
    at: float  # time.monotonic() when it was sent
    request_id: str
    seq: int


@dataclass
class Slot:
    node_id: str
    state: str = "waiting"  # waiting -> loading -> ready (or failed: it could not load); waiting when it goes
    link: WorkerLink | None = None
    detail: str = ""
    loaded: LoadComplete | None = None
    joined_at: float = 0.0
    ever_lost: bool = False  # a spare fills only a node that lost its worker, not one whose worker is still coming
    history: deque[str] = field(default_factory=lambda: deque(maxlen=SLOT_HISTORY))  # bounded: workers churn


class WorkerRegistry:
    def __init__(self, topology: Topology, plan: Plan | None, config: ModelConfig, max_frame_bytes: int | None = None,
                 on_ready: Callable[[], None] | None = None, handshake_timeout_s: float = HELLO_TIMEOUT_S,
                 plan_once: Callable[[dict[str, Hello], dict[str, LinkSpeed | None]], Plan] | None = None,
                 batch: BatchPlan | None = None):
        """`plan` None: make it with `plan_once(HELLO by node id, link by node id)` when every planned node has a
        worker whose link has been probed. `batch`: the batch the head serves (default: planned from `plan` and
        head.max_batch)."""
        if (plan is None) == (plan_once is None):
            raise ValueError("give either a plan or plan_once, the function that makes it once workers join")
        self.topology, self.plan, self.config = topology, plan, config
        self.plan_once = plan_once
        self.plan_problem = ""  # why plan_once failed, for operators; the workers keep waiting
        if batch is None and plan is None:
            raise ValueError("without a plan, give the batch the head serves (batch_memory.plan_batch)")
        # PlanError when max_batch cannot fit; a plan made later must fit head.max_batch where the topology sets it,
        # else holds as many as its nodes fit, up to this batch (what the HTTP threads are sized for)
        self.batch = batch if batch is not None else plan_batch(plan, config, topology.head.max_batch)
        self.on_plan: Callable[[BatchPlan], None] | None = None  # told the batch of a plan made once workers join
        node_ids = [s.node_id for s in plan.stages] if plan is not None else [e.id for e in topology.pipeline_nodes]
        self.slots = {node_id: Slot(node_id) for node_id in node_ids}
        self.standby: dict[str, WorkerLink] = {}  # spare entry id -> its link, while it waits for a lost node
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified whenever a slot changes state
        self.replies_arrived = Doorbell()  # rings whenever any link gets a reply or is lost
        settings = topology.head
        self.max_frame_bytes = max_frame_bytes if max_frame_bytes is not None else settings.max_frame_bytes
        self.on_ready = on_ready
        self.stopping = threading.Event()
        self.listener: socket.socket | None = None
        self.heartbeat_s = settings.heartbeat_s
        self.silence_limit_s = settings.silence_limit_s
        self.step_budget = StepBudget(settings.step_timeout_s, settings.step_timeout_factor)
        self.handshake_timeout_s = handshake_timeout_s
        self.hop_bytes = hop_bytes_per_position(config.hidden_size, topology.dtype)
        # what one position may take in a step's frames: a stage may compute, and pass on, in a wider dtype than
        # the head's (a node's own dtype, or its device's fallback), so frames are sized for the widest there is
        self.frame_bytes_per_position = config.hidden_size * max(d.itemsize for d in WIRE_DTYPES.values())
        need = self._step_frame_bytes()
        if self.max_frame_bytes < need:  # every request with a full batch would fail at it
            raise TopologyError("head.max_frame_mb", f"{self.max_frame_bytes / MIB:g} ({self.max_frame_bytes} bytes) "
                                f"is under the {need} bytes that one step of this model takes ({self.batch.max_batch} "
                                f"sequences of hidden size {config.hidden_size}); give at least {need / MIB:.3g}, or "
                                "leave it out")
        self._token_key = token_key(settings.join_token) if settings.join_token else None
        self._pending_lock = threading.Lock()
        self._pending: dict[socket.socket, str] = {}  # sockets in their handshake, oldest first, and their peers
        self._evicted, self._last_eviction_warning = 0, 0.0
        self._last_accept_warning = -EVICTION_WARNING_EVERY_S  # the first failure to accept is said at once

    # --- views -------------------------------------------------------------------------------------------------
    def readiness(self) -> Readiness:
        with self.lock:
            if self.stopping.is_set():
                return Readiness(required=len(self.slots), ready=(), missing=tuple(self.slots), stopping=True)
            ready = tuple(n for n, s in self.slots.items() if s.state == "ready")
            missing = tuple(n for n, s in self.slots.items() if s.state != "ready")
        return Readiness(required=len(self.slots), ready=ready, missing=missing)

    def unready(self) -> list[tuple[str, str, str]]:
        """(node id, state, detail) of each planned node not ready (waiting, loading or failed), in plan order."""
        with self.lock:
            return [(node, s.state, s.detail) for node, s in self.slots.items() if s.state != "ready"]

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every slot is ready (True), or the head stops or the time runs out (False)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not self.stopping.is_set():
                if all(s.state == "ready" for s in self.slots.values()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return False

    def snapshot(self) -> list[dict]:
        """Each planned node's state, then each spare standing by, for operators: plan, device, memory, liveness."""
        now = time.monotonic()
        with self.lock:
            rows = []
            for node_id, slot in self.slots.items():
                stage = None if self.plan is None else self.plan.stage_for(node_id)
                link = slot.link
                rows.append({
                    "id": node_id, "state": slot.state, "detail": slot.detail,
                    "layers": [stage.start, stage.end] if stage else None,
                    "planned_device": stage.device if stage else self.topology.node(node_id).device,
                    "dtype": stage.dtype if stage else None,
                    "planned_weight_bytes": stage.weight_bytes if stage else None,
                    "memory_bytes": stage.memory_bytes if stage else None,
                    "device": link.device if link else None,
                    "hostname": link.hostname if link else None,
                    "served_by": link.entry_id if link else None,
                    "loaded_weight_bytes": slot.loaded.weight_bytes if slot.loaded else None,
                    "seconds_since_heard": round(now - link.last_seen, 3) if link else None,
                    "passes_to": link.passes_to if link else None,
                    **_times(stage, link, self.hop_bytes),
                })
            for entry_id, link in self.standby.items():  # the same keys, with no plan of their own
                rows.append({
                    "id": entry_id, "state": "standby", "detail": "spare, waiting for a lost node", "layers": None,
                    "planned_device": self.topology.node(entry_id).device, "dtype": None,
                    "planned_weight_bytes": None, "memory_bytes": None, "device": link.device,
                    "hostname": link.hostname, "served_by": entry_id, "loaded_weight_bytes": None,
                    "seconds_since_heard": round(now - link.last_seen, 3), "passes_to": None,
                })
        return rows

    def step_positions(self) -> int:
        """Positions of hidden states one step may carry: its frames, to every worker and back, must fit what each
        end takes (head.max_frame_bytes here, each worker's --max-frame-mb). A prompt longer than that is read
        over several steps."""
        with self.lock:
            caps = [self.max_frame_bytes, *(s.link.hello.max_frame_bytes for s in self.slots.values() if s.link)]
        return max(1, (min(caps) - self._frame_margin()) // self.frame_bytes_per_position)

    def _frame_margin(self) -> int:
        return STEP_FRAME_MARGIN + STEP_FRAME_MARGIN_PER_SEQUENCE * self.batch.max_batch

    def _step_frame_bytes(self) -> int:
        """The least frame limit that carries one decode step of a full batch and a prompt position."""
        return self._frame_margin() + self.frame_bytes_per_position * (self.batch.max_batch + 1)

    def _check_frames(self, hello: Hello) -> None:
        """Refuses a worker whose frame limit cannot carry one decode step of a full batch and a prompt position:
        every request would fail at it (it drops the head at the first such frame, and rejoins to fail again)."""
        need = self._step_frame_bytes()
        if hello.max_frame_bytes < need:
            raise Refusal(f"this worker takes frames of at most {hello.max_frame_bytes} bytes (--max-frame-mb), "
                          f"under the {need} that one step of this model takes ({self.batch.max_batch} sequences "
                          f"of hidden size {self.config.hidden_size}); start it with --max-frame-mb "
                          f"{-(-need // (1 << 20))} or more")

    def links_in_order(self) -> list[WorkerLink]:
        """The ready workers' links in pipeline order. Raises WorkerLost for the first missing one."""
        links = []
        with self.lock:
            for node_id, slot in self.slots.items():
                if slot.state != "ready" or slot.link is None:
                    raise WorkerLost(node_id, slot.detail or "not connected")
                links.append(slot.link)
        return links

    def serving_links(self) -> list[WorkerLink]:
        """The links of the planned nodes that have a worker now (ready or not), in pipeline order."""
        with self.lock:
            return [slot.link for slot in (self.slots[s.node_id] for s in self.plan.stages) if slot.link is not None]

    def _live_links(self) -> list[WorkerLink]:
        with self.lock:
            return [s.link for s in self.slots.values() if s.link is not None] + list(self.standby.values())

    # --- accepting workers -------------------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Listen for workers; returns the bound port. Raises OSError, and ValueError for a host that does not
        resolve."""
        family, address = bind_address(host, port)
        # "::" takes IPv4 workers too where the system can (as 0.0.0.0 does them all)
        dual = family == socket.AF_INET6 and address == "::" and socket.has_dualstack_ipv6()
        self.listener = socket.create_server((address, port), family=family, reuse_port=False, dualstack_ipv6=dual)
        bound = self.listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="accept", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="heartbeat-watch", daemon=True).start()
        return bound

    def stop(self) -> None:
        """Stop accepting workers, tell each one, close every link: requests in flight fail with HeadShuttingDown."""
        self.stopping.set()
        if self.listener is not None:
            try:
                # close() alone leaves the socket listening while the accept thread is blocked in accept(): a
                # worker rejoining now would still get in. shutdown() stops listening and wakes that thread.
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not every platform allows shutdown on a listening socket; close() then has to do
            self.listener.close()
        links = self._live_links()
        _tell_and_wait(links, Error(code=ERROR_SHUTTING_DOWN, message=SHUTTING_DOWN_WORD), FAREWELL_TIMEOUT_S)
        for link in links:
            link.close("the head is shutting down")
        with self.changed:
            self.changed.notify_all()

    def _accept_loop(self) -> None:
        assert self.listener is not None
        while not self.stopping.is_set():
            try:
                sock, addr = self.listener.accept()
            except OSError as exc:
                if self.stopping.is_set():
                    return  # listener closed
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # workers would wait in the backlog, and be told they may have the API's port
                    now = time.monotonic()
                    if now - self._last_accept_warning >= EVICTION_WARNING_EVERY_S:
                        self._last_accept_warning = now
                        log.error("cannot take a worker's connection on the join port: %s; raise the limit on open "
                                  "files (ulimit -n) or free memory, and the workers waiting join", exc.strerror)
                time.sleep(0.1)  # back off rather than spin
                continue
            self._admit_pending(sock, f"{addr[0]}:{addr[1]}")
            try:
                threading.Thread(target=self._join, args=(sock, addr), name=f"join-{addr[0]}:{addr[1]}",
                                 daemon=True).start()
            except RuntimeError as exc:
                # a thread or memory limit, maybe for a moment: this peer is turned away (a worker retries), and
                # this thread goes on, or no worker could join again
                log.warning("turned away a worker from %s:%s: no thread to handle it (%s)", addr[0], addr[1], exc)
                with self._pending_lock:
                    self._pending.pop(sock, None)
                sock.close()
                time.sleep(0.1)  # as for EMFILE: back off rather than spin

    def _admit_pending(self, sock: socket.socket, peer: str) -> None:
        """Count `sock` among the handshakes in progress; with MAX_PENDING_HANDSHAKES already, close the oldest of
        the host that holds most of them (`sock`'s own included): connections flooding the port from one host then
        close each other, not a worker's handshake from another."""
        with self._pending_lock:
            full = len(self._pending) >= MAX_PENDING_HANDSHAKES
            oldest = oldest_of_busiest_host(self._pending, peer) if full else None
            if oldest is not None:
                oldest_peer = self._pending.pop(oldest)
                self._evicted += 1
            self._pending[sock] = peer
            now = time.monotonic()
            warn = oldest is not None and now - self._last_eviction_warning >= EVICTION_WARNING_EVERY_S
            if warn:
                self._last_eviction_warning, evicted, self._evicted = now, self._evicted, 0
        if oldest is None:
            return
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # wakes its thread, blocked reading, which then closes it
        except OSError:
            pass
        if warn:
            log.warning("%d handshake(s) in progress closed for newer connections (%d at once at most; the last "
                        "from %s): something keeps connections to the join port open without joining",
                        evicted, MAX_PENDING_HANDSHAKES, oldest_peer)

    def _join(self, sock: socket.socket, addr: tuple) -> None:
        try:
            admitted = self._handshake(sock, f"{addr[0]}:{addr[1]}")
        finally:
            with self._pending_lock:
                self._pending.pop(sock, None)
        if admitted is not None:
            self._serve(*admitted)

    def _answer_http(self, sock: socket.socket, peer: str) -> None:
        """An HTTP request on the workers' port: answered in HTTP, with where the API is, and closed."""
        try:
            reached = sock.getsockname()[0]
        except OSError:
            reached = None
        api = api_address(self.topology.head.api, reached)
        words = (f"this is a TrueCluster head's port for workers (head.listen); the OpenAI API is at "
                 f"http://{api}/v1 (head.api)")
        log.warning("an HTTP client at %s asked the workers' port; the API is at http://%s/v1 (head.api), and "
                    "--join takes this port only in `tc worker`", peer, api)
        body = (words + "\n").encode()
        reply = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            sock.sendall(reply)
            # closed with its request unread, the socket would reset the connection, and the client could lose
            # the answer: the end of ours is sent, then what it sent is read (a little, briefly) before closing
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(HTTP_DRAIN_S)
            for _ in range(HTTP_DRAIN_READS):
                if not sock.recv(65536):
                    break
        except OSError:
            pass  # it went already, or sends on: the log says what it was
        sock.close()

    def _handshake(self, sock: socket.socket, peer: str) -> tuple[WorkerLink, list] | None:
        """Admit a worker: (its link, assignments to send), or None once it is refused and closed."""
        conn = Connection(sock, max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES)
        conn.frame_limit_advice = ("a worker's HELLO is a few kilobytes at most, and no setting raises this cap "
                                   "before it is admitted: what connected is not a tc worker of this release")
        # A socket timeout bounds each read, not the frame: a peer sending a byte now and then would hold its
        # place for ever. The deadline closes the connection when the whole handshake is not over in time.
        deadline = _Deadline(conn, self.handshake_timeout_s)
        try:
            conn.settimeout(self.handshake_timeout_s)
            if _speaks_http(sock):
                self._answer_http(sock, peer)
                return None
            hello = _expect_hello(conn)
            if self._token_key is not None:
                hello = self._authenticate(conn, hello)
            with self.lock:
                if self.stopping.is_set():
                    raise _Stopping()
                entry, link, assignments = self._place(hello, conn, peer)
            conn.settimeout(None)
            conn.max_frame_bytes = self.max_frame_bytes
            conn.frame_limit_advice = "that is head.max_frame_mb: raise it in topology.yaml"
            conn.send(HelloAck(node_id=entry.id, heartbeat_s=self.heartbeat_s))
            if not deadline.finish():  # it struck while the worker was being placed
                raise ConnectionClosed("the connection was closed")
            if link.node_id is None:
                log.info("spare %s joined from %s (%s, %s) and stands by for a lost node", entry.id, peer,
                         hello.hostname, link.device)
            mismatch = build_mismatch(hello, full_version())
            if mismatch is not None:
                log.warning("%s from %s: %s", entry.id, peer, mismatch)
        except _Stopping:
            _send_and_close(conn, Error(code=ERROR_SHUTTING_DOWN, message=SHUTTING_DOWN_WORD))
            return None
        except (Refusal, AuthError) as exc:
            log.warning("refused a worker from %s: %s", peer, exc)
            code = ERROR_NODE_TAKEN if isinstance(exc, NodeTaken) else ERROR_HELLO_REFUSED  # the worker may retry
            _send_and_close(conn, Error(code=code, message=str(exc)))
            return None
        except ProtocolError as exc:  # includes a protocol version mismatch found while parsing HELLO
            log.warning("refused a worker from %s: %s", peer, exc)
            _send_and_close(conn, Error(code=ERROR_PROTOCOL, message=str(exc)))
            return None
        except (ConnectionClosed, OSError) as exc:  # TimeoutError is an OSError
            why = f"it did not finish within {self.handshake_timeout_s:g}s" if deadline.struck else str(exc)
            with self._pending_lock:
                evicted = sock not in self._pending  # closed for a newer connection: counted in one warning
            log.log(logging.DEBUG if evicted else logging.WARNING, "a worker from %s went away during its "
                    "handshake: %s", peer, "closed for a newer connection" if evicted else why)
            conn.close()
            self._lost_if_placed(conn, f"handshake failed: {why}")
            return None
        finally:
            deadline.finish()
        return link, assignments

    def _authenticate(self, conn: Connection, hello: Hello) -> Hello:
        """The head's side of the join-token exchange (tc.protocol.auth); returns the proven HELLO."""
        assert self._token_key is not None
        try:
            worker_nonce = check_nonce(hello.auth)
        except AuthError:
            raise Refusal("this cluster needs a join token: start the worker with --join-token-file PATH (or "
                          "TC_JOIN_TOKEN) holding the head's head.join_token") from None
        head_nonce, challenge = make_challenge(self._token_key, worker_nonce)
        conn.send(HelloAck(node_id="", challenge=challenge))
        try:
            proven = _expect_hello(conn)
        except ConnectionClosed as exc:  # a worker checks the head's proof first, and leaves when it fails
            raise ConnectionClosed(f"{exc} at the join-token challenge: its token most likely differs from this "
                                   "head's head.join_token; give it the same one (--join-token-file or "
                                   "TC_JOIN_TOKEN)") from exc
        check_answer(self._token_key, head_nonce, worker_nonce, proven.auth)
        return proven

    def _place(self, hello: Hello, conn: Connection, peer: str) -> tuple:
        """Under the lock: pick the worker's entry and slot. Raises Refusal."""
        served_by_spare = {n: s.link.entry_id for n, s in self.slots.items()
                           if s.link is not None and s.link.entry_id != n}
        if hello.node_id in served_by_spare:
            raise Refusal(f"node {hello.node_id} is served by the spare {served_by_spare[hello.node_id]} since its "
                          "worker was lost; this worker is not needed now (start it again once the spare is gone, "
                          "or declare another spare entry for it)")
        self._check_frames(hello)
        links = [s.link for s in self.slots.values() if s.link is not None]
        # a spare serving a lost node holds both entries
        holders = {**{n: s.link.hello.hostname for n, s in self.slots.items() if s.link is not None},
                   **{link.entry_id: link.hello.hostname for link in [*links, *self.standby.values()]}}
        entry = choose_entry(hello, self.topology, self.plan, set(holders), self.config, self.batch.max_batch,
                             holders)
        link = WorkerLink(conn, entry.id, hello, device_for(entry.device, hello), peer, self.config.hidden_size,
                          self.step_budget, self._lost, self.replies_arrived)
        assignments: list = []
        if entry.spare:
            self.standby[entry.id] = link
            assignments = self._match_standby()
        elif self.plan is None:
            self._hold(self.slots[entry.id], link)  # its ASSIGNMENT comes once the plan is made (_plan_if_ready)
        else:
            assignments = [self._occupy(self.slots[entry.id], link)]
        return entry, link, assignments

    def _hold(self, slot: Slot, link: WorkerLink) -> None:
        """Under the lock, before the plan exists: `link` holds `slot` until the plan is made, which waits for its
        link's probe (`_probe` then calls `_plan_if_ready`)."""
        link.node_id = slot.node_id
        slot.link, slot.state, slot.loaded, slot.joined_at = link, "planning", None, time.time()
        slot.detail = "joined; the plan is made once every planned node has a worker and its link is measured"
        slot.history.append(f"{time.strftime('%H:%M:%S')} {link.entry_id} joined from {link.peer}")
        self.changed.notify_all()

    def _plan_if_ready(self) -> list[tuple[WorkerLink, Assignment]]:
        """Under the lock, while there is no plan yet: once every slot is held by a worker whose link has been
        probed, make the plan and return every held worker's ASSIGNMENT (none before, or once planned)."""
        if self.plan is not None or any(s.link is None or not s.link.probed.is_set() for s in self.slots.values()):
            return []
        assert self.plan_once is not None
        hellos = {node_id: s.link.hello for node_id, s in self.slots.items() if s.link is not None}
        links = {node_id: s.link.link_speed for node_id, s in self.slots.items() if s.link is not None}
        try:
            plan = self.plan_once(hellos, links)
            asked = self.topology.head.max_batch
            batch = plan_batch(plan, self.config, asked)  # its nodes must hold the batch too
            if asked is None and batch.max_batch > self.batch.max_batch:
                batch = replace(batch, max_batch=self.batch.max_batch)
        except PlanError as exc:
            # the workers stay joined and waiting: replacing the one named (or fixing its limits) plans again
            self.plan_problem = str(exc)
            log.error("cannot plan from the joined workers: %s", exc)
            for s in self.slots.values():
                s.detail = f"no plan: {exc}"
            return []
        self.plan, self.batch = plan, batch
        self.plan_problem = ""
        if self.on_plan is not None:
            self.on_plan(batch)
        return [self._occupy(s, s.link) for s in self.slots.values() if s.link is not None]

    def _occupy(self, slot: Slot, link: WorkerLink) -> tuple[WorkerLink, Assignment]:
        """Under the lock: give `slot` to `link`; returns the ASSIGNMENT to send it."""
        stage = self.plan.stage_for(slot.node_id)
        link.node_id = slot.node_id
        link.steps.prefill_forecast = _prefill_forecast(stage, link.link_speed or stage.link, self.hop_bytes)
        slot.link, slot.state, slot.detail, slot.loaded, slot.joined_at = link, "loading", "loading", None, time.time()
        slot.history.append(f"{time.strftime('%H:%M:%S')} {link.entry_id} joined from {link.peer}")
        self.changed.notify_all()
        short = caches_short_of_the_batch(self.topology.node(link.entry_id), link.hello, stage, self.config,
                                          self.batch.max_batch)
        if short:
            log.warning("%s", short)
        return link, self._assignment(stage, link)

    def _match_standby(self) -> list[tuple[WorkerLink, Assignment]]:
        """Under the lock: hand every slot that lost its worker to a spare standing by that can hold its layers and
        their KV caches for the batch."""
        assignments: list[tuple[WorkerLink, Assignment]] = []
        if self.plan is None:  # nothing to take over before the plan exists
            return assignments
        for slot in self.slots.values():
            if slot.link is not None or not slot.ever_lost:
                continue
            stage = self.plan.stage_for(slot.node_id)
            for entry_id, link in list(self.standby.items()):
                problem = stage_fit_problem(self.topology.node(entry_id), link.hello, stage, self.config,
                                            sequences_to_hold(self.topology.head.max_batch, self.batch.max_batch))
                if problem is None:
                    del self.standby[entry_id]
                    assignments.append(self._occupy(slot, link))
                    log.info("spare %s takes over node %s (layers %s)", entry_id, slot.node_id, stage.layers_text)
                    break
                log.info("spare %s cannot take node %s: %s", entry_id, slot.node_id, problem)
        return assignments

    def _send_assignments(self, assignments: list[tuple[WorkerLink, Assignment]]) -> None:
        for link, assignment in assignments:
            try:
                link.conn.send(assignment)
            except OSError as exc:
                self._lost(link, f"sending its assignment failed: {exc}")
                continue
            log.info("worker %s joined from %s (%s, %s): assigned layers %d-%d on %s", link.name, link.peer,
                     link.hello.hostname, link.hello.platform, assignment.layer_start,
                     assignment.layer_end_exclusive - 1, assignment.device)

    def _lost_if_placed(self, conn: Connection, reason: str) -> None:
        """A handshake that failed after placing its worker (the HELLO_ACK did not go out) frees the place."""
        for link in self._live_links():
            if link.conn is conn:
                self._lost(link, reason)

    def _assignment(self, stage: Stage, link: WorkerLink) -> Assignment:
        """`stage`'s layers for `link`'s worker; threads come from the worker's own entry (a spare's, if it is one)."""
        fallback = dtype_fallback(stage.dtype, link.device, link.hello)
        if fallback:
            log.warning("worker %s: %s", link.name, fallback)
        return Assignment(model_id=self.topology.model,
                          model_source="local" if self.topology.model_is_local else "hub",
                          revision=self.topology.revision, device=link.device, architecture=self.config.model_type,
                          quant=self.topology.quant, group_size=self.topology.group_size, compute_dtype=stage.dtype,
                          layer_start=stage.start, layer_end_exclusive=stage.end, config=self.config.to_dict(),
                          tensor_count=len(layer_tensor_names(self.config, stage.start, stage.end)),
                          threads=self.topology.node(link.entry_id).threads,
                          max_sequences=self.batch.max_batch, context_length=self.config.context_length)

    # --- serving -----------------------------------------------------------------------------------------------
    def _serve(self, link: WorkerLink, assignments: list[tuple[WorkerLink, Assignment]]) -> None:
        self._send_assignments(assignments)  # before the first PING: a worker planned already starts loading
        try:
            threading.Thread(target=self._ping_loop, args=(link,), name=f"ping-{link.entry_id}", daemon=True).start()
        except RuntimeError as exc:
            # a thread or memory limit, maybe for a moment: unpinged, the worker would hold its place unheard until
            # the watch found it silent, and this thread would end with a traceback; dropped, it rejoins
            self._lost(link, f"no thread to ping it with ({exc})")
            return
        self._read_loop(link)

    def _read_loop(self, link: WorkerLink) -> None:
        reason = "connection closed"
        try:
            while True:
                env = link.conn.recv()
                mark("received")
                link.last_seen = time.monotonic()
                msg = env.message
                if isinstance(msg, (HiddenState, InferenceError)):
                    link.deliver(env)
                elif isinstance(msg, Pong):
                    link.pong(msg.nonce, msg.payload)
                elif isinstance(msg, (LoadProgress, LoadComplete, LoadFailed)) and link.node_id is None:
                    raise ProtocolError(f"{msg.TYPE} from a spare that was given nothing to load")
                elif isinstance(msg, LoadProgress):
                    log.debug("worker %s: %s %d/%d", link.name, msg.stage, msg.done, msg.total)
                    self._set_detail(link, load_progress_detail(msg))
                elif isinstance(msg, LoadComplete):
                    self._loaded(link, msg)
                elif isinstance(msg, LoadFailed):
                    log.error("worker %s could not load its layers: %s; the node stays out of the cluster until "
                              "that is fixed and the worker restarted", link.name, msg.reason)
                    self._set_detail(link, f"load failed: {msg.reason}", state="failed")
                elif isinstance(msg, Error):
                    log.warning("worker %s reports: %s (%s)", link.name, msg.message, msg.code)
                    if msg.code in (ERROR_SHUTTING_DOWN, ERROR_COMPUTE_FAILED):
                        # it is leaving: dropped now with its reason, not once its connection ends, which may be
                        # slow to come (a large frame still going out), while it is sent steps it will not answer
                        link.farewell = msg.message
                        break
                    elif env.request_id is not None:  # a refused inference command: its waiter must hear
                        link.deliver(env)
                else:
                    raise ProtocolError(f"a head does not accept {msg.TYPE} from a worker")
        except ConnectionClosed as exc:
            reason = str(exc) or "connection closed"
        except ProtocolError as exc:  # the connection is still in step after a bad body: say why before closing
            reason = f"protocol error: {exc}"
            link.refuse(str(exc))
        except OSError as exc:
            reason = str(exc)
        self._lost(link, link.farewell or reason)  # a reason given earlier (a timeout, a refusal) wins

    def _set_detail(self, link: WorkerLink, detail: str, state: str | None = None) -> None:
        with self.lock:
            slot = self.slots.get(link.node_id or "")
            if slot is not None and slot.link is link:
                slot.detail = detail
                if state is not None:
                    slot.state = state
                    self.changed.notify_all()

    def _loaded(self, link: WorkerLink, msg: LoadComplete) -> None:
        with self.lock:
            slot = self.slots[link.node_id or ""]
            if slot.link is not link:
                return
            slot.state, slot.detail, slot.loaded = "ready", "ready", msg
            ready = sum(s.state == "ready" for s in self.slots.values())
            self.changed.notify_all()
        log.info("worker %s ready: %s of weights on %s (%s), loaded in %.1fs [%d/%d workers ready]",
                 link.name, format_bytes(msg.weight_bytes), msg.device, msg.compute_dtype, msg.load_seconds, ready,
                 len(self.slots))
        if ready == len(self.slots) and self.on_ready is not None:
            self.on_ready()

    def _lost(self, link: WorkerLink, reason: str) -> None:
        link.close(reason)
        reason = link.close_reason  # the first reason given is the one requests saw
        with self.lock:
            if self.standby.get(link.entry_id) is link:
                del self.standby[link.entry_id]
                log.warning("spare %s left (%s)", link.entry_id, reason)
                return
            slot = self.slots.get(link.node_id or "")
            if slot is None or slot.link is not link:
                return
            was = slot.state
            slot.link, slot.state, slot.detail, slot.loaded = None, "waiting", f"lost: {reason}", None
            slot.ever_lost = True
            slot.history.append(f"{time.strftime('%H:%M:%S')} {link.entry_id} lost: {reason}")
            self.changed.notify_all()
            assignments = [] if self.stopping.is_set() else self._match_standby()
        if not self.stopping.is_set():
            log.warning("worker %s lost (%s, was %s); the cluster is not ready until a worker fills %s again",
                        link.name, reason, was, slot.node_id)
        if assignments:
            # A send blocks while its worker does not read, or while another send to it does (its link probe's
            # large PING), and only dropping that worker unblocks it. `_lost` runs on the heartbeat watch, which
            # drops silent workers, and on the scheduler: a spare's ASSIGNMENT goes from a thread of its own.
            try:
                threading.Thread(target=self._send_assignments, args=(assignments,), daemon=True,
                                 name=f"assign-{slot.node_id}").start()
            except RuntimeError:  # no thread to be had (a thread or memory limit): sent here, as it must be
                self._send_assignments(assignments)

    def _ping_loop(self, link: WorkerLink) -> None:
        # One per link: a ping blocked on a worker that stopped reading holds up only this thread, and the watch
        # thread's close() wakes it. It first probes the link, then keeps it alive.
        try:
            self._probe(link)
            while not link.closed.wait(self.heartbeat_s):
                link.ping()
        except OSError as exc:
            self._lost(link, f"ping failed: {exc}")

    def _probe(self, link: WorkerLink) -> None:
        """Measure the link's latency and bandwidth (what the plan's hops cost); the last probe of the planned
        set makes the plan when the head waits for one. Raises OSError when a send fails."""
        # one prefill's frame of hidden states, within what both ends' frames may carry
        frame_cap = min(self.max_frame_bytes, link.hello.max_frame_bytes)
        probe_bytes = max(0, min(self.hop_bytes * PROBE_POSITIONS, frame_cap - PROBE_FRAME_MARGIN))
        speed = link.measure(probe_bytes, PROBE_TIMEOUT_S)
        if speed is not None:
            log.info("link to worker %s: %s (%d-byte probe)", link.name, speed.describe(), probe_bytes)
        elif not link.closed.is_set():
            # a plan made from the topology never counted the probe: its hops are the topology's links there
            counted = "its hops count as free in the plan" if self.plan_once is not None else \
                "its hops' time is not known (the plan and forecast are as the topology made them)"
            log.warning("worker %s did not answer the link probe within %gs; %s", link.name, PROBE_TIMEOUT_S,
                        counted)
        with self.lock:
            assignments = self._plan_if_ready()
        self._send_assignments(assignments)

    def _watch_loop(self) -> None:
        period = min(self.heartbeat_s, self.silence_limit_s / 4)
        # A head that did not run (SIGSTOP, a debugger, a VM paused) wakes to every worker's PONGs still unread in
        # its sockets: silence counts from when it woke, so that they are read before any worker is judged by it
        # (each was dropped at once, and had to rejoin and reload its caches)
        woke = last = time.monotonic()
        while not self.stopping.wait(period):
            now = time.monotonic()
            if now - last > period + self.silence_limit_s / 2:
                woke = now
                log.warning("the head did not run for %.1fs (stopped or paused?); its workers' silence counts from "
                            "now", now - last)
            last = now
            for link in self._live_links():
                sending = link.sending
                if sending is not None and now - max(sending.at, woke) > sending.bound:
                    # taking a segment now and then, a worker (or a link) this slow kept the scheduler in the send
                    # for as long as it liked: the step's bound, which counts from the send, holds it too
                    self._lost(link, f"still taking {sending.message.TYPE} {now - sending.at:.1f}s after it was "
                                     f"sent, past its bound of {sending.bound:.3g}s "
                                     f"({link.steps.explain(sending.kind, sending.positions)}): its link or its "
                                     "machine takes the step's input too slowly")
                    continue
                # a frame still coming or going counts: a long prompt's hidden states over Wi-Fi may take longer
                # than the limit, and a PING waits behind it
                silent = now - max(link.last_seen, link.conn.last_progress, woke)
                if silent > self.silence_limit_s:
                    self._lost(link, f"silent for {silent:.1f}s (heartbeat_timeout_s {self.silence_limit_s:g}): "
                                     "the worker is stopped, hung or unreachable")


def _prefill_forecast(stage: Stage, link: LinkSpeed | None, hop_bytes: int) -> Callable[[int], float] | None:
    """The plan's forecast of a prefill's round trip through `stage` (its compute, and its hidden states both ways
    over the measured link), by positions; None where the node's speed is unknown."""
    speed = stage.speed
    if speed is None:
        return None
    return lambda positions: (speed.prefill_s(stage.weight_bytes, stage.layer_count, positions)
                              + (link.hop_s(hop_bytes * positions) if link is not None else 0.0))


def _times(stage: Stage | None, link: WorkerLink | None, hop_bytes: int) -> dict[str, float | None]:
    """A node's predicted and measured decode times (ms) for /v1/cluster: its compute, and its hop."""
    measured = list(link.decode_compute_s) if link else []
    round_trips = list(link.decode_round_trip_s) if link else []
    compute = statistics.median(measured) if measured else None
    hop = statistics.median(r - c for r, c in zip(round_trips, measured)) if measured else None
    predicted_hop = link.link_speed.hop_s(hop_bytes) if link and link.link_speed else None
    return {"predicted_decode_ms": _ms(stage.decode_s if stage else None), "measured_decode_ms": _ms(compute),
            "predicted_hop_ms": _ms(predicted_hop), "measured_hop_ms": _ms(hop)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class _Deadline:
    """Closes a connection unless `finish()` is called within `seconds`; `struck` says whether it closed it."""

    def __init__(self, conn: Connection, seconds: float):
        self._conn = conn
        self._lock = threading.Lock()
        self._over = False
        self.struck = False
        self._timer = threading.Timer(seconds, self._strike)
        self._timer.daemon = True
        self._timer.start()

    def _strike(self) -> None:
        with self._lock:
            if self._over:
                return
            self._over = self.struck = True
        self._conn.close()  # wakes the handshake's blocked read, which then fails

    def finish(self) -> bool:
        """Call off the deadline; False if it struck first (the connection is closed). Idempotent."""
        with self._lock:
            self._over = True
        self._timer.cancel()
        return not self.struck


def _tell_and_wait(links: list[WorkerLink], message: Message, timeout_s: float) -> None:
    """Best effort: send `message` to every link at once, then wait for each worker to hang up; `timeout_s` in all.

    One thread each, since a worker that stopped reading blocks its send; closing its link afterwards ends it.
    Waiting for the worker to close first matters: closing our end while it answers a PING queued before the
    message makes its reply fail, and it drops the connection without reading the message.
    """
    def send(link: WorkerLink) -> None:
        try:
            link.conn.send(message)
        except (OSError, ValueError):
            pass  # it is gone already: there is nobody to tell

    threads = [threading.Thread(target=send, args=(link,), name=f"farewell-{link.entry_id}", daemon=True)
               for link in links]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for link in links:  # the reader sees the worker hang up and marks its link closed
        link.closed.wait(max(0.0, deadline - time.monotonic()))


def _expect_hello(conn: Connection) -> Hello:
    env = conn.recv()
    if not isinstance(env.message, Hello):
        raise ProtocolError(f"expected HELLO, got {env.message.TYPE}")
    return env.message


HTTP_DRAIN_S, HTTP_DRAIN_READS = 1.0, 16  # how long, and how much, an HTTP client's request is read before closing
# the first bytes of an HTTP request (a method and its space, cut to four): a browser, curl or an OpenAI client
# given head.listen's port instead of head.api's
_HTTP_STARTS = (b"GET ", b"POST", b"HEAD", b"PUT ", b"DELE", b"OPTI", b"PATC", b"CONN", b"TRAC")


def _speaks_http(sock: socket.socket) -> bool:
    """Whether what connected opens with an HTTP request line, looked at without taking it from the socket (a
    worker's frame header never starts so: it would announce a body of gigabytes). Waits, as the handshake waits
    for its first frame, for what comes first: a request line comes whole in its first segment, and fewer than
    four bytes are left to the handshake to read on and judge."""
    return sock.recv(4, socket.MSG_PEEK) in _HTTP_STARTS


def api_address(api: HostPort, reached: str | None) -> HostPort:
    """Where a client on this machine's network finds the API: head.api, but for a wildcard host (0.0.0.0, ::)
    the address it reached this head at (`reached`, the connection's own end), which it can reach again."""
    if api.host in WILDCARD_HOSTS and reached:
        return HostPort(reached, api.port)
    return api


def _send_and_close(conn: Connection, message: Message) -> None:
    try:
        conn.send(message)
    except OSError:
        pass
    conn.close()


def load_progress_detail(msg: LoadProgress) -> str:
    """A node's detail while it loads: a download's in MB (the worker counts its bytes), else units done."""
    if msg.stage.startswith("download"):
        total = f"{msg.total / 1e6:.1f} MB" if msg.total else "? MB"
        return f"{msg.stage}: {msg.done / 1e6:.1f} of {total}"
    return f"loading {msg.stage} {msg.done}/{msg.total}"

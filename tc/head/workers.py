"""The head's side of the worker connections: admission, assignment, liveness, and request/reply.

Each planned node has a slot. A joining worker is matched to a slot (admission.py), sent its ASSIGNMENT, and
is ready once it reports LOAD_COMPLETE. A reader thread per connection routes replies to whoever waits on them
and notices a closed socket at once; a heartbeat thread pings and drops workers that fall silent. Losing a
worker frees its slot for the next worker that joins: the head never needs a restart.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..model.config import Qwen2Config
from ..planner import Plan
from ..protocol.connection import Connection
from ..protocol.errors import ConnectionClosed, ProtocolError
from ..protocol.messages import (Assignment, Error, Hello, HelloAck, HiddenState, InferenceError, LoadComplete,
                                 LoadFailed, LoadProgress, Message, Ping, Pong)
from ..topology import Topology
from .admission import Refusal, choose_entry, device_for
from .service import Readiness, StageFailed, WorkerLost

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
_LOST = object()  # put on a link's reply queue when its connection ends


class WorkerLink:
    """One admitted worker's connection."""

    def __init__(self, conn: Connection, node_id: str, hello: Hello, device: str):
        self.conn, self.node_id, self.hello, self.device = conn, node_id, hello, device
        self.hostname = hello.hostname
        self.replies: queue.Queue = queue.Queue()
        self.closed = threading.Event()
        self.close_reason = ""
        self.last_seen = time.monotonic()

    def close(self, reason: str) -> None:
        if not self.closed.is_set():
            self.close_reason = reason
            self.closed.set()
            self.replies.put(_LOST)
            self.conn.close()

    def request(self, message: Message, request_id: str, seq: int) -> HiddenState:
        """Send one inference command and wait for its reply. Raises WorkerLost or StageFailed."""
        if self.closed.is_set():
            raise WorkerLost(self.node_id, self.close_reason)
        try:
            self.conn.send(message, request_id, seq)
        except OSError as exc:
            self.close(f"send failed: {exc}")
            raise WorkerLost(self.node_id, self.close_reason) from exc
        while True:
            reply = self.replies.get()
            if reply is _LOST:
                self.replies.put(_LOST)  # later waiters must see it too
                raise WorkerLost(self.node_id, self.close_reason)
            if reply.request_id != request_id or reply.seq != seq:
                log.debug("dropping a stale reply from %s (%s #%s)", self.node_id, reply.request_id, reply.seq)
                continue
            if isinstance(reply.message, (InferenceError, Error)):
                raise StageFailed(self.node_id, reply.message.message)
            return reply.message


@dataclass
class Slot:
    node_id: str
    state: str = "waiting"  # waiting -> loading -> ready; back to waiting when the worker goes
    link: WorkerLink | None = None
    detail: str = ""
    loaded: LoadComplete | None = None
    joined_at: float = 0.0
    history: list[str] = field(default_factory=list)


class WorkerRegistry:
    def __init__(self, topology: Topology, plan: Plan, config: Qwen2Config, max_frame_bytes: int | None = None, on_ready: Callable[[], None] | None = None):
        self.topology, self.plan, self.config = topology, plan, config
        self.slots = {s.node_id: Slot(s.node_id) for s in plan.stages}
        self.lock = threading.Lock()
        self.max_frame_bytes = max_frame_bytes
        self.on_ready = on_ready
        self.stopping = threading.Event()
        self.listener: socket.socket | None = None
        self.heartbeat_s = topology.head.heartbeat_s

    # --- views -------------------------------------------------------------------------------------------------
    def readiness(self) -> Readiness:
        with self.lock:
            ready = tuple(n for n, s in self.slots.items() if s.state == "ready")
            missing = tuple(n for n, s in self.slots.items() if s.state != "ready")
        return Readiness(required=len(self.slots), ready=ready, missing=missing)

    def snapshot(self) -> list[dict]:
        """Each planned node's state, for operators: plan, device, memory, liveness."""
        now = time.monotonic()
        with self.lock:
            rows = []
            for stage in self.plan.stages:
                slot = self.slots[stage.node_id]
                link = slot.link
                rows.append({
                    "id": stage.node_id, "state": slot.state, "detail": slot.detail,
                    "layers": [stage.start, stage.end], "planned_device": stage.device, "dtype": stage.dtype,
                    "planned_weight_bytes": stage.weight_bytes, "memory_bytes": stage.memory_bytes,
                    "device": link.device if link else None,
                    "hostname": link.hostname if link else None,
                    "loaded_weight_bytes": slot.loaded.weight_bytes if slot.loaded else None,
                    "seconds_since_heard": round(now - link.last_seen, 3) if link else None,
                })
        return rows

    def links_in_order(self) -> list[WorkerLink]:
        """The ready workers' links in pipeline order. Raises WorkerLost for the first missing one."""
        links = []
        with self.lock:
            for stage in self.plan.stages:
                slot = self.slots[stage.node_id]
                if slot.state != "ready" or slot.link is None:
                    raise WorkerLost(stage.node_id, slot.detail or "not connected")
                links.append(slot.link)
        return links

    # --- accepting workers -------------------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Listen for workers; returns the bound port."""
        self.listener = socket.create_server((host, port), reuse_port=False)
        bound = self.listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="accept", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        return bound

    def stop(self) -> None:
        self.stopping.set()
        if self.listener is not None:
            self.listener.close()
        with self.lock:
            links = [s.link for s in self.slots.values() if s.link is not None]
        for link in links:
            link.close("the head is shutting down")

    def _accept_loop(self) -> None:
        assert self.listener is not None
        while not self.stopping.is_set():
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return  # listener closed
            threading.Thread(target=self._handshake, args=(sock, addr), name=f"join-{addr[0]}:{addr[1]}",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket, addr: tuple) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        kwargs = {} if self.max_frame_bytes is None else {"max_frame_bytes": self.max_frame_bytes}
        conn = Connection(sock, **kwargs)
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            env = conn.recv()
            if not isinstance(env.message, Hello):
                raise ProtocolError(f"expected HELLO first, got {env.message.TYPE}")
            hello = env.message
            with self.lock:
                taken = {n for n, s in self.slots.items() if s.link is not None}
                entry = choose_entry(hello, self.topology, self.plan, taken)
                device = device_for(entry.device, hello)
                link = WorkerLink(conn, entry.id, hello, device)
                slot = self.slots[entry.id]
                slot.link, slot.state, slot.detail, slot.joined_at = link, "loading", "loading", time.time()
            conn.settimeout(None)
            conn.send(HelloAck(node_id=entry.id))
            stage = self.plan.stage_for(entry.id)
            conn.send(self._assignment(stage, device))
            log.info("worker %s joined from %s (%s, %s): assigned layers %s on %s", entry.id, peer, hello.hostname,
                     hello.platform, stage.layers_text, device)
        except Refusal as exc:
            log.warning("refused a worker from %s: %s", peer, exc)
            _send_and_close(conn, Error(code="hello_refused", message=str(exc)))
            return
        except ProtocolError as exc:  # includes a protocol version mismatch found while parsing HELLO
            log.warning("refused a worker from %s: %s", peer, exc)
            _send_and_close(conn, Error(code="protocol_error", message=str(exc)))
            return
        except (ConnectionClosed, OSError) as exc:
            log.warning("a worker from %s went away during its handshake: %s", peer, exc)
            conn.close()
            return
        self._read_loop(link)

    def _assignment(self, stage, device: str) -> Assignment:
        tensor_count = 12 * (stage.end - stage.start)
        return Assignment(model_id=self.topology.model,
                          model_source="local" if self.topology.model_is_local else "hub",
                          revision=self.topology.revision, device=device, architecture="qwen2", quant=self.topology.quant,
                          group_size=self.topology.group_size, compute_dtype=stage.dtype,
                          layer_start=stage.start, layer_end_exclusive=stage.end, config=self.config.to_dict(),
                          tensor_count=tensor_count, total_weight_bytes=stage.weight_bytes,
                          threads=self.topology.node(stage.node_id).threads)

    # --- serving -----------------------------------------------------------------------------------------------
    def _read_loop(self, link: WorkerLink) -> None:
        reason = "connection closed"
        try:
            while True:
                env = link.conn.recv()
                link.last_seen = time.monotonic()
                msg = env.message
                if isinstance(msg, (HiddenState, InferenceError)):
                    link.replies.put(env)
                elif isinstance(msg, Pong):
                    pass
                elif isinstance(msg, LoadProgress):
                    log.debug("worker %s: %s %d/%d", link.node_id, msg.stage, msg.done, msg.total)
                    self._set_detail(link, f"loading {msg.stage} {msg.done}/{msg.total}")
                elif isinstance(msg, LoadComplete):
                    self._loaded(link, msg)
                elif isinstance(msg, LoadFailed):
                    log.error("worker %s could not load its layers: %s", link.node_id, msg.reason)
                    self._set_detail(link, f"load failed: {msg.reason}")
                elif isinstance(msg, Error):
                    log.warning("worker %s reports: %s (%s)", link.node_id, msg.message, msg.code)
                    if env.request_id is not None:  # a refused inference command: its waiter must hear
                        link.replies.put(env)
                else:
                    raise ProtocolError(f"a head does not accept {msg.TYPE} from a worker")
        except ConnectionClosed as exc:
            reason = str(exc) or "connection closed"
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
            try:
                link.conn.send(Error(code="protocol_error", message=str(exc)))
            except OSError:
                pass
        except OSError as exc:
            reason = str(exc)
        self._lost(link, reason)

    def _set_detail(self, link: WorkerLink, detail: str) -> None:
        with self.lock:
            slot = self.slots[link.node_id]
            if slot.link is link:
                slot.detail = detail

    def _loaded(self, link: WorkerLink, msg: LoadComplete) -> None:
        with self.lock:
            slot = self.slots[link.node_id]
            if slot.link is not link:
                return
            slot.state, slot.detail, slot.loaded = "ready", "ready", msg
            ready = sum(s.state == "ready" for s in self.slots.values())
        log.info("worker %s ready: %.0f MB of weights on %s (%s), loaded in %.1fs [%d/%d workers ready]",
                 link.node_id, msg.weight_bytes / 1e6, msg.device, msg.compute_dtype, msg.load_seconds, ready,
                 len(self.slots))
        if ready == len(self.slots) and self.on_ready is not None:
            self.on_ready()

    def _lost(self, link: WorkerLink, reason: str) -> None:
        link.close(reason)
        with self.lock:
            slot = self.slots[link.node_id]
            if slot.link is not link:
                return
            was = slot.state
            slot.link, slot.state, slot.detail, slot.loaded = None, "waiting", f"lost: {reason}", None
        if not self.stopping.is_set():
            log.warning("worker %s lost (%s, was %s); the cluster is not ready until a worker fills %s again",
                        link.node_id, reason, was, link.node_id)

    def _heartbeat_loop(self) -> None:
        nonce = 0
        while not self.stopping.wait(self.heartbeat_s):
            with self.lock:
                links = [s.link for s in self.slots.values() if s.link is not None]
            now = time.monotonic()
            for link in links:
                silent = now - link.last_seen
                if silent > 3 * self.heartbeat_s:
                    log.warning("worker %s silent for %.1fs", link.node_id, silent)
                    self._lost(link, f"no heartbeat for {silent:.1f}s")
                    continue
                nonce += 1
                try:
                    link.conn.send(Ping(nonce=nonce))
                except OSError as exc:
                    self._lost(link, f"ping failed: {exc}")


def _send_and_close(conn: Connection, message: Message) -> None:
    try:
        conn.send(message)
    except OSError:
        pass
    conn.close()

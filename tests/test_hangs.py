"""Nothing hangs and nothing is dropped without an answer.

- A worker whose compute stops while its reader still answers PINGs is dropped once a step outlives the bound
  measured from its own steps (tc.head.step_deadline): the request fails naming it, or resumes.
- A worker whose compute thread fails leaves with the reason, and the head shows it.
- A stopping head stops listening for workers at once.
- Stopping the HTTP server answers every request it accepted.
- A joining peer gets one deadline for its whole handshake, however slowly it sends.

Real head and worker processes where the behaviour is theirs; a hand-driven worker over a real socket where the
test needs a worker that answers PINGs and never replies, which no real worker can be made to do on purpose.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import logging
import select
import socket
import threading
import time
from typing import Iterator

import pytest
import torch

from cluster import Cluster, HandJoinedWorker, Request, join_loaded, worker_hello, write_topology
from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import create_app
from tc.head import http_server
from tc.head.http_server import start_http_server
from tc.head.main import load_config_and_plan
from tc.head.service import GenerationService, Readiness
from tc.head.step_deadline import StepBudget
from tc.head.workers import HELLO_TIMEOUT_S, MAX_PENDING_HANDSHAKES, Doorbell, WorkerLink, WorkerRegistry, _Deadline
from tc.local import LocalPipeline
from tc.model.tokenizer import TextTokenizer
from tc.protocol.connection import Connection
from tc.protocol.errors import ConnectionClosed
from tc.protocol.framing import encode
from tc.protocol.messages import (ERROR_COMPUTE_FAILED, ERROR_NODE_TAKEN, ERROR_SHUTTING_DOWN, Assignment, Error,
                                 Hello, HelloAck, HiddenState, Ping, Pong, RunBatch)
from tc.sampling import SamplingParams
from tc.topology import load_topology
from tc.worker import main as worker_main
from tc.worker.main import Worker, WorkerOptions
from tiny_model import write_tiny_model

PROMPT = "the quick brown fox"
HIDDEN = 64  # the tiny model's hidden size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=5)


def registry_for(tmp_path, model_dir, nodes: list[dict] | None = None,
                 handshake_timeout_s: float = HELLO_TIMEOUT_S, **head) -> WorkerRegistry:
    """The head's registry of workers, not started, for a topology of `nodes` (one CPU node "a" by default) with
    the `head` settings given."""
    topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, nodes or [{"id": "a", "device": "cpu"}],
                                            head=head))
    _, config, plan = load_config_and_plan(topology)
    return WorkerRegistry(topology, plan, config, handshake_timeout_s=handshake_timeout_s)


def greedy(model_dir, max_tokens: int) -> str:
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return gen.generate(tok.encode(PROMPT), SamplingParams(max_tokens, temperature=0, ignore_eos=True)).text




class ScriptedWorker(HandJoinedWorker):
    """A worker whose reader answers every PING at once, as a real worker's does, while its "compute" answers
    each inference step after `delay(kind, index)` seconds, or never when that is None (a hung compute thread).
    """

    def __init__(self, port: int, node_id: str, delay):
        self.delay = delay
        self.steps = 0
        self.hung_at: float | None = None  # when it took the step it never answers
        super().__init__(port, worker_hello(node_id))

    def received(self, env) -> None:
        msg = env.message
        if not isinstance(msg, RunBatch):
            return
        kind = "decode" if msg.is_decode else "prefill"
        delay = self.delay(kind, self.steps)
        self.steps += 1
        if delay is None:
            self.hung_at = time.monotonic()
            return
        reply = HiddenState(hidden_state=torch.zeros(1, msg.hidden_state.shape[1], HIDDEN), compute_seconds=delay)
        threading.Timer(delay, self._send, args=(reply, env.request_id, env.seq)).start()

    def _send(self, reply, request_id, seq) -> None:
        try:
            self.conn.send(reply, request_id, seq)
        except (ConnectionClosed, OSError):
            pass


def node_row(cluster: Cluster, node_id: str) -> dict:
    return {row["id"]: row for row in cluster.get("/v1/cluster")[1]["nodes"]}[node_id]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def start(tmp_path, model_dir, nodes: list[dict], **head) -> Cluster:
    # heartbeats every 0.5 s, a silence limit far beyond every step bound here: only the step bound can catch it
    head = {"heartbeat_s": 0.5, "heartbeat_timeout_s": 120, **head}
    topo = write_topology(tmp_path / "t.yaml", model_dir, nodes, head=head)
    cluster = Cluster(topo, tmp_path)
    cluster.start_head()
    cluster.wait_api()
    return cluster


# --- a worker whose compute hangs while its reader answers PINGs ------------------------------------------------

def test_a_worker_that_pings_but_stops_computing_is_dropped_within_its_measured_bound(tmp_path, model_dir):
    floor, factor, step_s = 0.5, 4, 0.3
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    # one token a step (no drafts): every step after the prefill is a decode step of one row
    with start(tmp_path, model_dir, nodes, step_timeout_s=floor, step_timeout_factor=factor,
               resume=False, draft_tokens=0) as cluster:
        cluster.start_worker("a")
        # b answers its prefill and three decode steps in step_s each, then never again
        b = ScriptedWorker(cluster.listen_port, "b", lambda kind, index: step_s if index < 4 else None)
        cluster.wait_ready()
        request = Request(cluster, {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                    "ignore_eos": True})
        status, body = request.wait(30)
        assert b.hung_at is not None and b.steps == 5
        waited = request.answered_at - b.hung_at
        # the bound: the floor plus factor x its slowest decode step so far (a little over step_s each)
        assert floor + factor * step_s - 0.1 < waited < floor + factor * (step_s + 0.2) + 1.5, waited
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        message = body["error"]["message"]
        assert "worker b" in message and "no reply to RUN_BATCH within" in message, message
        assert "head.step_timeout_s 0.5s + 4 x its slowest recent decode step" in message, message
        # dropped like a silent worker: its connection closed, the cluster not ready, the reason on its slot
        assert b.closed.wait(5)
        status, ready = cluster.get("/health/ready")
        assert status == 503 and ready["missing_nodes"] == ["b"]
        row = node_row(cluster, "b")
        assert row["state"] == "waiting" and row["detail"].startswith("lost: no reply to RUN_BATCH"), row
        # a real worker fills b again and the head serves
        cluster.start_worker("b")
        cluster.wait_ready()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == greedy(model_dir, 8), body


def test_a_request_held_by_a_hung_worker_resumes_on_its_replacement(tmp_path, model_dir):
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    with start(tmp_path, model_dir, nodes, step_timeout_s=0.5, step_timeout_factor=2, resume=True,
               resume_grace_s=120) as cluster:
        cluster.start_worker("a")
        b = ScriptedWorker(cluster.listen_port, "b", lambda kind, index: None)  # never answers anything
        cluster.wait_ready()
        request = Request(cluster, {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                    "ignore_eos": True})
        # nothing measured yet: its first prefill may take factor x floor = 1 s, then it is dropped
        assert b.closed.wait(10), "the hung worker was never dropped"
        assert request.thread.is_alive(), "the request should wait for b to be filled again"
        wait_for(lambda: node_row(cluster, "b")["state"] == "waiting", 10, "b's slot to be freed")
        cluster.start_worker("b")
        status, body = request.wait(120)
        assert status == 200, body
        assert body["choices"][0]["text"] == greedy(model_dir, 12)  # b hung before any token: nothing to undo
        assert "resumed on a refilled pipeline" in cluster.head.output()


def test_a_request_whose_lost_worker_is_still_loading_at_the_end_of_the_grace_says_so(tmp_path, model_dir):
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    with start(tmp_path, model_dir, nodes, step_timeout_s=0.5, step_timeout_factor=2, resume=True,
               resume_grace_s=10) as cluster:
        cluster.start_worker("a")
        b = ScriptedWorker(cluster.listen_port, "b", lambda kind, index: None)  # never answers anything
        cluster.wait_ready()
        request = Request(cluster, {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert b.closed.wait(10), "the hung worker was never dropped"
        wait_for(lambda: node_row(cluster, "b")["state"] == "waiting", 10, "b's slot to be freed")
        # b's replacement joins and takes its assignment, and is still loading when the grace period ends
        with Connection(socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=15)) as loading:
            loading.send(worker_hello("b"))
            assert isinstance(loading.recv(timeout=15).message, HelloAck)
            assert isinstance(loading.recv(timeout=15).message, Assignment)
            assert node_row(cluster, "b")["state"] == "loading"
            status, body = request.wait(60)
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert ("a worker took its place but was still loading its layers at the end of the 10s resume grace period "
                "(head.resume_grace_s: give it more than a worker's start-up and load time)"
                in body["error"]["message"]), body


# --- a worker whose compute thread fails -------------------------------------------------------------------------

@contextlib.contextmanager
def worker_b_by_hand(tmp_path, model_dir) -> Iterator[tuple[Cluster, Connection]]:
    """A head (heartbeats every 0.5 s, no resume) whose node a is a real worker and b one joined by hand, its
    layers reported loaded: (the cluster, b's connection, whose reads the test makes)."""
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    topo = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={"heartbeat_s": 0.5, "resume": False})
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        yield cluster, join_loaded(cluster.listen_port, worker_hello("b"))


def test_a_worker_whose_compute_fails_fails_the_step_with_its_reason_and_may_rejoin(tmp_path, model_dir):
    """A worker whose compute thread failed says so (ERROR_COMPUTE_FAILED) and closes: the step fails at once as
    worker_lost with the worker's reason, the head logs it, and the node serves again once a worker rejoins. (The
    worker's side, leaving with the reason and rejoining with its layers, is test_wire_abuse's.)"""
    reason = "worker b is out of service (the compute thread failed on RUN_BATCH: MemoryError: out of memory); " \
             "it rejoins"
    with worker_b_by_hand(tmp_path, model_dir) as (cluster, b):

        def fail_the_first_step() -> None:
            while not isinstance((env := b.recv()).message, RunBatch):
                if isinstance(env.message, Ping):
                    b.send(Pong(nonce=env.message.nonce))
            b.send(Error(code=ERROR_COMPUTE_FAILED, message=reason), env.request_id, env.seq)
            b.close()

        threading.Thread(target=fail_the_first_step, daemon=True).start()
        cluster.wait_ready()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": list(range(16)),
                                                        "max_tokens": 4}, timeout=60)
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert reason in body["error"]["message"], body
        assert "lost (worker b is out of service" in cluster.head.output()
        cluster.start_worker("b")
        cluster.wait_ready()
        # ignore_eos: a random model's sampled text may end at any token
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": list(range(16)),
                                                        "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def test_a_worker_s_farewell_drops_it_at_once_though_its_connection_stays_open(tmp_path, model_dir):
    """A worker's farewell (shutting_down, compute_failed) was only noted, for when its connection ended: one
    whose close was slow to come (the compute thread still sending a large frame, say) kept its place, was sent
    steps, and its request waited for a step bound, to fail with a reason other than the worker's own. The head
    now drops it at the farewell."""
    reason = "worker b is shutting down (SIGTERM received)"
    with worker_b_by_hand(tmp_path, model_dir) as (cluster, b):

        def leave_at_the_first_step_and_stay_connected() -> None:
            try:
                while True:
                    env = b.recv()
                    if isinstance(env.message, Ping):
                        b.send(Pong(nonce=env.message.nonce))
                    elif isinstance(env.message, RunBatch):
                        b.send(Error(code=ERROR_SHUTTING_DOWN, message=reason))
            except (ConnectionClosed, OSError):
                pass

        threading.Thread(target=leave_at_the_first_step_and_stay_connected, daemon=True).start()
        cluster.wait_ready()
        started = time.monotonic()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": list(range(16)),
                                                        "max_tokens": 4}, timeout=120)
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert reason in body["error"]["message"], body
        assert time.monotonic() - started < 10  # not a step bound's wait
        assert cluster.get("/health/ready")[1]["missing_nodes"] == ["b"]
        b.close()


# --- a head that stops -------------------------------------------------------------------------------------------

def test_a_stopped_registry_refuses_connections_at_once(tmp_path, model_dir):
    """Closing a listening socket while a thread is blocked in accept() leaves it listening on Linux: a worker
    rejoining a head that is still stopping would get in (and be turned away). Stopping must stop listening."""
    registry = registry_for(tmp_path, model_dir)
    port = registry.start("127.0.0.1", 0)
    time.sleep(0.2)  # the accept thread is blocked in accept()
    registry.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_spare_that_stops_reading_mid_probe_is_still_dropped_after_it_takes_over(tmp_path, model_dir):
    """The heartbeat watch drops a silent worker, and its spare takes over the node: the spare's ASSIGNMENT must
    not be sent from the watch thread. A spare that stopped reading while its link probe's large PING was going
    out holds its connection's send (that PING's, blocked); an ASSIGNMENT sent from the watch thread waited
    behind it, and the watch thread, the one that would drop the silent spare and so unblock both, never did:
    the node stayed with a worker that is gone, and no silent worker was dropped again."""
    limit = 2.0
    nodes = [{"id": "a", "device": "cpu"}, {"id": "sp", "device": "cpu", "spare": True}]
    registry = registry_for(tmp_path, model_dir, nodes, heartbeat_s=0.5, heartbeat_timeout_s=limit)
    port = registry.start("127.0.0.1", 0)
    # small buffers on the head's side of every link (accepted sockets take the listener's), so that a probe's
    # 128 KiB PING fills them at once when the worker does not read
    registry.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    spare_sock = None
    try:
        silent = join_loaded(port, worker_hello("a"))  # loaded, then never reads nor answers again
        time.sleep(0.8)  # the spare is heard from later than `a`, so `a` is the first to fall silent too long
        spare_sock = socket.socket()
        spare_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        spare_sock.connect(("127.0.0.1", port))
        spare = Connection(spare_sock)
        spare.send(worker_hello("sp"))
        assert isinstance(spare.recv(timeout=5).message, HelloAck)
        ping = spare.recv(timeout=5).message  # the probe's first, empty PING: answered, as a live worker does
        assert isinstance(ping, Ping) and not ping.payload
        spare.send(Pong(nonce=ping.nonce))  # then it reads nothing more: the large PING after it blocks

        def node_a() -> dict:
            return {row["id"]: row for row in registry.snapshot()}["a"]

        wait_for(lambda: node_a()["served_by"] == "sp", 10, "the spare to take over node a")
        # silent since its PONG: the watch drops it within its limit and a period (0.5 s) of the takeover
        wait_for(lambda: node_a()["served_by"] is None, limit + 3, "the silent spare to be dropped")
        assert "silent for" in node_a()["detail"], node_a()
        silent.close()
    finally:
        if spare_sock is not None:
            spare_sock.close()
        registry.stop()


def test_a_worker_in_the_middle_of_a_large_frame_on_a_slow_link_is_not_silent(tmp_path, model_dir):
    """Silence counts bytes, not whole frames: a worker sending a prefill's hidden states over a slow link (Wi-Fi)
    for longer than heartbeat_timeout_s, its PONGs waiting behind them, is alive. It was dropped as "silent", and
    the step's replay sent the same frame again, to be dropped again."""
    limit = 1.5
    registry = registry_for(tmp_path, model_dir, heartbeat_s=0.5, heartbeat_timeout_s=limit)
    port = registry.start("127.0.0.1", 0)
    try:
        conn = join_loaded(port, worker_hello("a"))

        def drain():  # what the head sends (its PINGs) is read, and left unanswered: the frame below is under way
            try:
                while True:
                    conn.recv()
            except ConnectionClosed:
                pass
        threading.Thread(target=drain, daemon=True).start()
        frame = encode(Pong(nonce=12345, payload=b"h" * 64 * 1024))  # a PONG of nothing asked for: unused
        sock = conn._sock
        began = time.monotonic()
        for start in range(0, len(frame), len(frame) // 40):  # 40 slices over ~3 limits
            sock.sendall(frame[start:start + len(frame) // 40])
            time.sleep(3 * limit / 40)
        assert time.monotonic() - began > 2 * limit
        time.sleep(0.6)  # a watch period after the frame: had it counted whole frames only, `a` was gone by now
        (row,) = registry.snapshot()
        assert row["served_by"] == "a", row
        conn.close()
    finally:
        registry.stop()


def test_a_worker_that_takes_a_step_s_input_too_slowly_is_dropped_at_the_step_s_bound(tmp_path, model_dir):
    """A send has no bound of its own, and the one scheduler waits in it: a worker (or a link) that took a segment
    now and then, just inside the silence limit, held every request for as long as it liked. The step's bound, which
    counts from the send, now holds the send too (the heartbeat watch drops the worker)."""
    from tc.head.service import WorkerLost
    from tc.protocol.messages import BatchEntry

    registry = registry_for(tmp_path, model_dir, heartbeat_s=0.2, heartbeat_timeout_s=60, step_timeout_s=0.5,
                            step_timeout_factor=2)
    port = registry.start("127.0.0.1", 0)
    # small buffers at both ends: a frame of a few MB waits for a worker that does not read
    registry.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    slow = socket.socket()
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        conn = Connection(slow)
        conn.send(worker_hello("a"))
        assert isinstance(conn.recv(timeout=5).message, HelloAck)  # then it reads nothing more
        link = registry.slots["a"].link
        rows = 4096
        message = RunBatch(entries=(BatchEntry(sequence=1, position_start=0, length=rows, cache_capacity=rows),),
                           hidden_state=torch.zeros(1, rows, registry.config.hidden_size), route=0, released=())
        sent = link.expect(message, "step-1", 1)
        assert sent.bound == 1.0  # no step measured yet: factor x floor
        began = time.monotonic()
        with pytest.raises(WorkerLost, match=r"still taking RUN_BATCH .* past its bound of 1s"):
            link.send_expected(sent)
        assert time.monotonic() - began < 5  # the bound and a watch period; the silence limit is a minute
    finally:
        slow.close()
        registry.stop()


def test_a_first_prefill_is_bounded_by_the_plans_forecast_for_its_stage(tmp_path, model_dir):
    """The forecast comes from the node's speed in the plan: a long first prompt on a slow stage is given the time
    the plan expects it to take (times head.step_timeout_factor), not a flat factor x floor."""
    slow = {"decode_gbps": 1.0, "prefill_gbps": 0.001, "layer_ms": 1.0}
    registry = registry_for(tmp_path, model_dir, [{"id": "a", "device": "cpu", "speed": slow}])
    port = registry.start("127.0.0.1", 0)
    try:
        conn = join_loaded(port, worker_hello("a"))
        steps = registry.slots["a"].link.steps
        stage = registry.plan.stage_for("a")
        compute = stage.speed.prefill_s(stage.weight_bytes, stage.layer_count, 8192)
        assert compute > 300 and steps.bound("prefill", 8192) >= 30 + 10 * compute  # the defaults: 30 s, x 10
        assert steps.bound("prefill", 8) == 300 and steps.bound("decode", 1) == 300
        conn.close()
    finally:
        registry.stop()


def test_a_client_that_never_reads_its_reply_is_dropped_and_frees_its_thread(monkeypatch):
    """A reply's writes to a connected client that reads nothing waited forever once Waitress held 16 MB of it
    (with logprobs, a long stream writes that): each such client held a request thread for good, and enough of
    them every thread. Past STALLED_CLIENT_S of reading nothing, the reply ends as a client's that left, and the
    connection is closed; one that reads slowly is served to the end."""
    monkeypatch.setattr(http_server, "STALLED_CLIENT_S", 1.0)
    closed, ended = threading.Event(), threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def chunks():
            try:
                for _ in range(400):  # 25 MB, past Waitress's high watermark (16 MB)
                    yield b"data: " + b"x" * 65536 + b"\n\n"
                ended.set()
            finally:
                closed.set()
        return chunks()

    server = start_http_server(app, "127.0.0.1", 0, threads=1)
    try:
        for reads in (False, True):
            closed.clear()
            client = socket.create_connection(("127.0.0.1", server.port))
            client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            got = 0
            if reads:  # slowly: at most 64 KB every 10 ms
                client.settimeout(10)
                while got < 400 * 65536:
                    piece = client.recv(65536)
                    if not piece:
                        break
                    got += len(piece)
                    time.sleep(0.01)
                assert closed.wait(10) and ended.is_set() and got >= 400 * 65536, got
            else:  # reads nothing
                assert closed.wait(30), "the reply's thread still waits on a client that reads nothing"
                assert not ended.is_set()
                client.settimeout(10)
                while True:  # what it had been sent, then the end: the connection was closed
                    try:
                        piece = client.recv(1 << 20)
                    except ConnectionResetError:
                        break
                    if not piece:
                        break
                    got += len(piece)
                assert got < 20_000_000, got
            client.close()
    finally:
        server.stop()


# A thread stack larger than any address space: starting a thread then fails, as at a thread or memory
# limit, whatever the machine's overcommit policy (which may map a mere 32 TiB).
NO_STACK = 1 << 62


def test_a_join_that_gets_no_thread_leaves_the_head_accepting_workers(tmp_path, model_dir):
    """A connection the head cannot start a handshake thread for (a thread or memory limit, for a moment) is turned
    away; the thread that accepts workers must go on, or no worker could join, nor a lost one rejoin, again."""
    registry = registry_for(tmp_path, model_dir, heartbeat_s=0.5, heartbeat_timeout_s=30)
    port = registry.start("127.0.0.1", 0)
    try:
        usual = threading.stack_size(NO_STACK)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as turned_away:
                wait_for(lambda: closed_by_peer(turned_away), 5, "the connection with no thread to be closed")
        finally:
            threading.stack_size(usual)
        conn = Connection(socket.create_connection(("127.0.0.1", port), timeout=5))
        with conn:
            conn.send(worker_hello("a"))
            assert isinstance(conn.recv(timeout=5).message, HelloAck)
            assert isinstance(conn.recv(timeout=5).message, Assignment)
    finally:
        registry.stop()


def handshake_deadline_started(peer: str) -> bool:
    """Whether the head's handshake with `peer` has started its deadline (a Timer), the last thread it starts
    before it reads the HELLO."""
    return any(isinstance(t, threading.Timer) and isinstance(getattr(t.function, "__self__", None), _Deadline)
               and t.function.__self__._conn.peer == peer for t in threading.enumerate())


def test_a_worker_the_head_has_no_thread_to_ping_is_dropped_at_once_to_rejoin(tmp_path, model_dir):
    """Admitted, a worker gets a thread that pings it; with none to be had (a thread or memory limit, for a moment)
    it is dropped at once and may rejoin, where it held its place unheard until the watch found it silent."""
    registry = registry_for(tmp_path, model_dir, heartbeat_s=0.5, heartbeat_timeout_s=30)
    port = registry.start("127.0.0.1", 0)
    try:
        with Connection(socket.create_connection(("127.0.0.1", port), timeout=5)) as conn:
            peer = f"127.0.0.1:{conn._sock.getsockname()[1]}"
            wait_for(lambda: handshake_deadline_started(peer), 5, "its handshake to start")
            usual = threading.stack_size(NO_STACK)  # its handshake waits for the HELLO; no thread can start now
            try:
                conn.send(worker_hello("a"))
                assert isinstance(conn.recv(timeout=5).message, HelloAck)
                assert isinstance(conn.recv(timeout=5).message, Assignment)
                with pytest.raises(ConnectionClosed):
                    conn.recv(timeout=5)
            finally:
                threading.stack_size(usual)
            wait_for(lambda: registry.snapshot()[0]["state"] == "waiting", 5, "its place to be free again")
            assert registry.snapshot()[0]["detail"].startswith("lost: no thread to ping it with (")
        with Connection(socket.create_connection(("127.0.0.1", port), timeout=5)) as conn:  # it rejoins
            conn.send(worker_hello("a"))
            assert isinstance(conn.recv(timeout=5).message, HelloAck)
            assert isinstance(conn.recv(timeout=5).message, Assignment)
            assert registry.snapshot()[0]["state"] == "loading"
    finally:
        registry.stop()


# --- stopping the HTTP server --------------------------------------------------------------------------------------

class SlowPipeline(LocalPipeline):
    """The real layers, with each decode step held up, so that requests pile up behind a generation."""

    def run(self, entries, hidden):
        if any(e.start > 0 for e in entries):
            time.sleep(0.05)
        return super().run(entries, hidden)


def post_raw(port: int, body: dict, results: list, lock: threading.Lock) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read()
        try:
            outcome = (response.status, json.loads(text))
        except ValueError:
            outcome = (response.status, text)  # not the API's JSON: the assertions show it
    except (OSError, http.client.HTTPException) as exc:
        outcome = ("no answer", f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()
    with lock:
        results.append(outcome)


def test_stop_answers_every_request_it_accepted(model_dir):
    model = OurModel(model_dir)
    tokenizer = TextTokenizer.load(model_dir)
    generator = Generator(model.head, tokenizer, SlowPipeline(model.stages), torch.float32)
    service = GenerationService("tiny-qwen", tokenizer, generator, lambda: Readiness(1, ("w1",), ()), max_batch=1)
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=2, metrics=service.metrics)
    body = {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    results: list = []
    lock = threading.Lock()
    # two requests take both request threads (one generates, one waits for a place); six queue behind them
    clients = [threading.Thread(target=post_raw, args=(server.port, body, results, lock)) for _ in range(8)]
    for client in clients:
        client.start()
    wait_for(lambda: service.running == 1 and service.queue_depth == 1, 10, "a generation and one waiting")
    time.sleep(0.3)  # every request sent and accepted
    stopper = threading.Thread(target=server.stop, args=(10,))
    stopper.start()
    time.sleep(0.1)
    late: list = []  # a client arriving while the server drains learns why it is refused
    post_raw(server.port, body, late, lock)
    stopper.join(30)
    for client in clients:
        client.join(30)
    assert not stopper.is_alive() and not any(client.is_alive() for client in clients)
    assert all(isinstance(status, int) for status, _ in results + late), results + late  # an HTTP answer each
    assert [status for status, _ in results].count(200) == 2, results
    refused = [reply for status, reply in results if status != 200]
    assert len(refused) == 6, results
    for reply in refused + [late[0][1]]:
        assert reply["error"]["code"] == "shutting_down" and "shutting down" in reply["error"]["message"], reply
    assert late[0][0] == 503
    # every answer counted, the 503s the server gave while it drained (no route saw them) too
    counted = service.metrics.registry.get_sample_value
    assert counted("tc_http_requests_total", {"method": "POST", "route": "/v1/completions", "status": "200"}) == 2
    assert sum(counted("tc_http_requests_total", {"method": "POST", "route": route, "status": "503"}) or 0
               for route in ("/v1/completions", "unrouted")) == 7
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_a_scheduler_that_cannot_start_leaves_the_service_serving(model_dir):
    """A request that cannot start the scheduler's thread (no memory for its stack, a thread limit) fails; it must
    not stay queued, nor leave a thread that never ran in place of the loop, behind which every later request
    would wait for ever."""
    model = OurModel(model_dir)
    tokenizer = TextTokenizer.load(model_dir)
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    service = GenerationService("tiny-qwen", tokenizer, generator, lambda: Readiness(1, ("w1",), ()))
    params = SamplingParams(3, temperature=0, ignore_eos=True)
    usual = threading.stack_size(NO_STACK)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            service.open(tokenizer.encode(PROMPT), params)
    finally:
        threading.stack_size(usual)
    assert service.queue_depth == 0
    results: list = []
    later = threading.Thread(target=lambda: results.append(service.complete(tokenizer.encode(PROMPT), params)),
                             daemon=True)
    later.start()
    later.join(30)
    assert not later.is_alive(), "a later request waits for a scheduler that never started"
    assert results[0].completion_tokens == 3


# --- a handshake has one deadline ----------------------------------------------------------------------------------

def closed_by_peer(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_a_peer_that_dribbles_its_hello_loses_its_place_at_the_deadline(tmp_path, model_dir, caplog):
    cap = 1.0
    registry = registry_for(tmp_path, model_dir, handshake_timeout_s=cap, heartbeat_s=0.5, heartbeat_timeout_s=30)
    port = registry.start("127.0.0.1", 0)
    try:
        frame = encode(worker_hello("a"))
        with caplog.at_level(logging.WARNING, logger="tc.head.workers"), \
                socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            started = time.monotonic()
            for byte in frame[:-1]:  # one byte every 0.2 s: each read is quick, the frame takes a minute
                if closed_by_peer(sock) or time.monotonic() - started > cap + 5:
                    break
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # reset: the head closed it
                    break
                time.sleep(0.2)
            held = time.monotonic() - started
            assert closed_by_peer(sock), f"the head still holds the connection after {held:.1f}s"
            # the handshake thread says why once its read has failed, a moment after the close
            wait_for(lambda: f"it did not finish within {cap:g}s" in caplog.text, 10, "the deadline's warning")
        assert cap - 0.1 < held < cap + 1.0, held
        # the deadline ends with the handshake: a worker that joins in time keeps its connection past it
        conn = Connection(socket.create_connection(("127.0.0.1", port), timeout=5))
        with conn:
            conn.send(worker_hello("a"))
            assert isinstance(conn.recv(timeout=5).message, HelloAck)
            assert isinstance(conn.recv(timeout=5).message, Assignment)
            time.sleep(cap + 0.5)
            conn.send(Pong(nonce=0))
            assert registry.snapshot()[0]["state"] == "loading"
            while True:  # the head keeps pinging it: the connection stays open
                message = conn.recv(timeout=5).message
                assert not isinstance(message, Error), message
                if isinstance(message, Ping):
                    break
    finally:
        registry.stop()



def test_connections_that_hold_every_handshake_place_give_way_to_a_worker(tmp_path, model_dir, caplog):
    """Idle connections to the join port (a plain connect takes a place, no token needed) cannot keep a worker
    out: one more than MAX_PENDING_HANDSHAKES closes the oldest, and a worker finishes its handshake at once."""
    registry = registry_for(tmp_path, model_dir, heartbeat_s=0.5, heartbeat_timeout_s=30)  # the handshake
    # deadline (HELLO_TIMEOUT_S, 10 s): idle places are not freed by it here
    port = registry.start("127.0.0.1", 0)
    idle: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger="tc.head.workers"):
            for _ in range(MAX_PENDING_HANDSHAKES + 8):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            wait_for(lambda: sum(closed_by_peer(s) for s in idle) == 8, 10, "the oldest 8 closed")
            assert all(closed_by_peer(s) for s in idle[:8])  # the oldest ones, in order
            conn = Connection(socket.create_connection(("127.0.0.1", port), timeout=5))
            with conn:
                conn.send(worker_hello("a"))
                assert isinstance(conn.recv(timeout=5).message, HelloAck)
                assert isinstance(conn.recv(timeout=5).message, Assignment)
            # one warning for them all, not a line per connection
            assert caplog.text.count("closed for newer connections") == 1
            assert "went away during its handshake" not in caplog.text
    finally:
        for sock in idle:
            sock.close()
        registry.stop()


def test_a_flood_from_one_host_closes_its_own_handshakes_not_a_workers_from_another(tmp_path, model_dir, caplog):
    """A plain TCP flood of the join port closed the oldest handshakes, whoever held them: a worker whose HELLO was
    on its way from another host lost its place to the flood. The flooding host's own are closed now."""
    registry = registry_for(tmp_path, model_dir, heartbeat_s=0.5, heartbeat_timeout_s=30)
    port = registry.start("127.0.0.1", 0)
    worker = socket.socket()
    worker.bind(("127.0.0.2", 0))  # another host: loopback answers for all of 127/8
    worker.connect(("127.0.0.1", port))
    flood: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger="tc.head.workers"):
            for _ in range(MAX_PENDING_HANDSHAKES + 8):
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            wait_for(lambda: sum(closed_by_peer(s) for s in flood) == 9, 10, "9 of the flood's closed")
            assert all(closed_by_peer(s) for s in flood[:9])  # its own oldest, in order
            with Connection(worker) as conn:
                conn.send(worker_hello("a"))
                assert isinstance(conn.recv(timeout=5).message, HelloAck)
            assert "the last from 127.0.0.1:" in caplog.text
    finally:
        for sock in flood:
            sock.close()
        registry.stop()


class LooksTogether(threading.Event):
    """A link's `closed` event whose first two looks wait for each other (a second at most), so that two closers
    that look before either has set it both see it clear; `clear_to` names the threads that saw it clear."""

    def __init__(self) -> None:
        super().__init__()
        self.meeting = threading.Barrier(2, timeout=1)
        self.looks = 0
        self.clear_to: list[str] = []

    def is_set(self) -> bool:
        seen = super().is_set()
        if not seen:
            self.clear_to.append(threading.current_thread().name)
        self.looks += 1
        if self.looks <= 2:
            try:
                self.meeting.wait()
            except threading.BrokenBarrierError:
                pass  # the other closer could not look yet: it waits for the first to finish
        return seen


def test_a_link_closed_by_two_threads_at_once_keeps_the_first_reason_alone():
    """The reader (the worker hung up), the watch (silent too long) and a request (past its step's bound) may drop
    one link at the same moment: the first reason is the one requests hear and the slot records, given once."""
    a, b = socket.socketpair()
    link = WorkerLink(Connection(a), "a", worker_hello("a"), "cpu", "test", 64, StepBudget(5.0, 2.0),
                      lambda link, reason: None, Doorbell())
    link.closed = LooksTogether()
    reasons = {"reader": "the worker closed the connection", "watch": "silent for 31.0s"}
    closers = [threading.Thread(target=link.close, args=(reason,), name=name) for name, reason in reasons.items()]
    try:
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(10)
        assert len(link.closed.clear_to) == 1, link.closed.clear_to  # one closer acts, the other finds it closed
        assert link.close_reason == reasons[link.closed.clear_to[0]]
        assert link.replies.qsize() == 1 and link.conn.closed
    finally:
        link.conn.close()
        b.close()


def admit_serve_and_stop(conn: Connection, worker: Worker, runner: threading.Thread) -> None:
    """As a head on `conn`: take the worker's HELLO, admit it as node a, see it answer a PING, then stop it."""
    assert isinstance(conn.recv(timeout=30).message, Hello)
    conn.send(HelloAck(node_id="a"))
    conn.send(Ping(nonce=5))
    assert conn.recv(timeout=30).message == Pong(nonce=5)
    worker.shutdown("the test is over")
    runner.join(30)


def test_a_worker_told_to_stop_while_it_connects_leaves_without_joining(monkeypatch):
    """SIGTERM's handler hands the connection the worker holds to its farewell; one that lands while connect()
    runs finds none, and the worker joined on that connection and served, the signal lost (and, once a leaving
    worker ran no step, it pinged and computed nothing). Now it closes that connection unused and leaves."""
    with socket.create_server(("127.0.0.1", 0)) as head:
        head.settimeout(30)
        worker = Worker(WorkerOptions(host="127.0.0.1", port=head.getsockname()[1], node_id="a", device="cpu",
                                      hf_cache_dir=None, max_memory_bytes=None, bench=False, peer_port=None))
        connect = worker_main.connect

        def connect_then_signal(*args, **kwargs):
            conn = connect(*args, **kwargs)
            worker.shutdown("SIGTERM received")  # where the handler lands: before run() holds the connection
            return conn

        monkeypatch.setattr(worker_main, "connect", connect_then_signal)
        runner = threading.Thread(target=worker.run, name="worker", daemon=True)
        runner.start()
        sock = head.accept()[0]
        with sock:
            sock.settimeout(30)
            assert sock.recv(1) == b""  # closed without a HELLO
        runner.join(30)
        assert not runner.is_alive()


def test_a_worker_rejoining_while_the_head_holds_its_last_connection_retries():
    """A worker that heard nothing for --head-timeout-s (a head paused past it: a VM migrated, a laptop asleep)
    leaves and rejoins; a head that has not yet seen that connection end refuses the HELLO, its entry taken, and
    the worker exited for good (status 2). It now tries again until the head has dropped the dead connection; a
    worker that never joined still takes the refusal as final (tests/test_cluster.py)."""
    with socket.create_server(("127.0.0.1", 0)) as head:
        head.settimeout(30)
        worker = Worker(WorkerOptions(host="127.0.0.1", port=head.getsockname()[1], node_id="a", device="cpu",
                                      hf_cache_dir=None, max_memory_bytes=None, retry_max_s=1, bench=False,
                                      peer_port=None, head_timeout_s=1))
        runner = threading.Thread(target=worker.run, name="worker", daemon=True)
        runner.start()
        with Connection(head.accept()[0]) as first:
            assert isinstance(first.recv(timeout=30).message, Hello)
            first.send(HelloAck(node_id="a"))
            # the head falls silent: the worker leaves this connection after a second, and rejoins
            with Connection(head.accept()[0]) as conn:
                assert isinstance(conn.recv(timeout=30).message, Hello)
                conn.send(Error(code=ERROR_NODE_TAKEN, message="node id 'a' is already taken by a connected worker; "
                                                               "give another --node-id or stop the other worker"))
            with Connection(head.accept()[0]) as conn:  # it tried again, and serves
                admit_serve_and_stop(conn, worker, runner)
        assert not runner.is_alive()


def test_a_worker_whose_entry_stays_taken_past_any_dead_connection_gives_up(monkeypatch):
    """A head drops a dead connection within its heartbeat timeout; an entry still taken long after is held by
    another worker (the same --node-id twice, after a head restart), and the worker retried for ever, saying the
    head had not seen its last connection end. Past STILL_HELD_MAX_S the refusal is final (status 2)."""
    monkeypatch.setattr(worker_main, "STILL_HELD_MAX_S", 1.5)
    taken = Error(code=ERROR_NODE_TAKEN, message="node id 'a' is already taken by a connected worker")
    with socket.create_server(("127.0.0.1", 0)) as head:
        head.settimeout(30)
        worker = Worker(WorkerOptions(host="127.0.0.1", port=head.getsockname()[1], node_id="a", device="cpu",
                                      hf_cache_dir=None, max_memory_bytes=None, retry_max_s=0.5, bench=False,
                                      peer_port=None, head_timeout_s=1))
        status: list[int] = []
        runner = threading.Thread(target=lambda: status.append(worker.run()), name="worker", daemon=True)
        runner.start()
        with Connection(head.accept()[0]) as first:
            assert isinstance(first.recv(timeout=30).message, Hello)
            first.send(HelloAck(node_id="a"))
            refusals = 0
            head.settimeout(5)  # the worker tries again within a second, until it gives up
            while runner.is_alive() and refusals < 20:
                try:
                    sock = head.accept()[0]
                except TimeoutError:
                    break
                with Connection(sock) as conn:
                    assert isinstance(conn.recv(timeout=30).message, Hello)
                    conn.send(taken)
                    refusals += 1
        runner.join(30)
        assert status == [2] and 2 <= refusals < 20, (status, refusals)


def test_a_worker_with_no_thread_to_compute_on_tells_the_head_and_rejoins():
    """Joined, the worker starts its compute thread; with none to be had (a thread or memory limit, for a moment)
    the head hears it is out of service and why, and it rejoins with backoff: the error ended the process."""
    with socket.create_server(("127.0.0.1", 0)) as head:
        head.settimeout(30)
        worker = Worker(WorkerOptions(host="127.0.0.1", port=head.getsockname()[1], node_id="a", device="cpu",
                                      hf_cache_dir=None, max_memory_bytes=None, retry_max_s=1, bench=False,
                                      peer_port=None))
        runner = threading.Thread(target=worker.run, name="worker", daemon=True)
        runner.start()
        with Connection(head.accept()[0]) as conn:
            assert isinstance(conn.recv(timeout=30).message, Hello)
            usual = threading.stack_size(NO_STACK)
            try:
                conn.send(HelloAck(node_id="a"))  # the worker starts its compute thread once it has this
                told = conn.recv(timeout=30).message
            finally:
                threading.stack_size(usual)
            assert isinstance(told, Error) and told.code == ERROR_COMPUTE_FAILED, told
            assert "worker a is out of service (no thread to compute on (" in told.message
            with pytest.raises(ConnectionClosed):
                conn.recv(timeout=30)
        with Connection(head.accept()[0]) as conn:  # it rejoined, and serves
            admit_serve_and_stop(conn, worker, runner)
        assert not runner.is_alive()

"""Hostile and broken peers on the wire: each one loses its own connection, with an ERROR, and nothing else.

Against a real head: garbage, truncated, oversized and out-of-order frames from strangers, and a fake worker
that takes a node and then misbehaves (a hidden state of the wrong shape or dtype, a reply nobody asked for, a
second HELLO, a load that failed). Against a real worker: a fake head that sends commands before any ASSIGNMENT,
garbage, HELLO, an oversized frame, and inference commands the worker must refuse without leaving; an ASSIGNMENT
it cannot load, a command whose reply it cannot send, and a head that says it is shutting down.
"""
from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from dataclasses import replace
from typing import Iterator

import pytest
import torch

from cluster import WORKER_JOIN_S, Cluster, worker_hello, write_topology
from hub_standin import HubStandIn
from model_helpers import OurModel
from tc.generation import Generator
from tc.head.workers import load_progress_detail
from tc.model.config import Qwen2Config
from tc.model.tokenizer import TextTokenizer
from tc.protocol.cbor import encode_cbor
from tc.protocol.connection import Connection
from tc.protocol.errors import ConnectionClosed
from tc.protocol.framing import FrameDecoder, encode, frame_header
from tc.protocol.messages import (ERROR_COMPUTE_FAILED, ERROR_SHUTTING_DOWN, PROTOCOL_VERSION, Assignment, BatchEntry,
                                  Error, Hello, HelloAck, HiddenState, InferenceError, LoadComplete,
                                  LoadFailed, LoadProgress, Ping, Pong, RunBatch)
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

PROMPT = "the quick brown fox"
HIDDEN = 64  # the tiny model's hidden size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=3)


def greedy(model_dir, max_tokens: int) -> str:
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return gen.generate(tok.encode(PROMPT), SamplingParams(max_tokens, temperature=0, ignore_eos=True)).text




def raw_reply(port: int, data: bytes, half_close: bool = False, timeout: float = 15) -> list:
    """Send raw bytes to the head; return every message it sends back before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        decoder, messages = FrameDecoder(), []
        while True:
            chunk = sock.recv(65536)  # socket.timeout here means the head kept the connection open: a failure
            if not chunk:
                return messages
            messages += [env.message for env in decoder.feed(chunk)]


def only_error(messages: list, *phrases: str) -> Error:
    assert len(messages) == 1 and isinstance(messages[0], Error), messages
    for phrase in phrases:
        assert phrase in messages[0].message, messages[0].message
    return messages[0]


def completion(cluster: Cluster, max_tokens: int = 8) -> tuple[int, dict]:
    return cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True}, timeout=60)


class FakeWorker:
    """A hand-driven worker: joins as `node_id`, reports its layers loaded, then does what the test says."""

    def __init__(self, port: int, node_id: str):
        for _ in range(50):  # the previous fake's node may take a moment to be freed
            self.conn = Connection(socket.create_connection(("127.0.0.1", port), timeout=15))
            self.conn.send(worker_hello(node_id))
            reply = self.conn.recv(timeout=15).message
            if isinstance(reply, HelloAck):
                break
            assert isinstance(reply, Error) and "already taken" in reply.message, reply
            self.conn.close()
            time.sleep(0.1)
        assignment = self.next(Assignment)
        self.conn.send(LoadComplete(load_seconds=0.0, weight_bytes=1, device="cpu",
                                    compute_dtype=assignment.compute_dtype))
        self.answer_the_link_probe()

    def answer_the_link_probe(self, quiet_s: float = 0.5) -> None:
        """Answer PINGs until none comes for `quiet_s` (well under the heartbeat): the head's probe of this link,
        sent as the worker joins, is then over, and no probe frame is still in flight when the test misbehaves."""
        while True:
            try:
                env = self.conn.recv(timeout=quiet_s)
            except TimeoutError:
                return
            assert isinstance(env.message, Ping), env.message
            self.conn.send(Pong(env.message.nonce, env.message.payload))

    def next(self, kind: type, timeout: float = 30):
        """The next message of `kind`, answering PINGs on the way (the head would drop a silent worker)."""
        deadline = time.monotonic() + timeout
        while True:
            env = self.conn.recv(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(env.message, Ping):
                self.conn.send(Pong(env.message.nonce, env.message.payload))
                continue
            assert isinstance(env.message, kind), env.message
            self.last = env
            return env.message

    def closing_error(self) -> Error:
        """The ERROR the head sends before closing this connection (PINGs before it are skipped)."""
        error = self.next(Error)
        with pytest.raises(ConnectionClosed):
            while True:
                self.conn.recv(timeout=15)
        return error


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("abuse")
    topo = write_topology(tmp / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}],
                          head={"heartbeat_s": 1, "resume": False})
    with Cluster(topo, tmp) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        yield cluster


def join_fake(cluster: Cluster, node_id: str, timeout: float = WORKER_JOIN_S) -> FakeWorker:
    """A FakeWorker for `node_id`, joined once every other node is ready.

    A fake answers PINGs only while a test waits on it, so it joins last: the cluster is then ready at once,
    rather than after a real worker's slow (re)load during which the silent fake would be dropped.
    """
    deadline = time.monotonic() + timeout
    while cluster.get("/health/ready")[1].get("missing_nodes") != [node_id]:
        assert time.monotonic() < deadline, f"the other nodes never became ready with only {node_id} missing"
        time.sleep(0.1)
    return FakeWorker(cluster.listen_port, node_id)


def wait_ready_state(cluster: Cluster, ready: bool, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (cluster.get("/health/ready")[0] == 200) != ready:
        assert time.monotonic() < deadline, f"cluster never became {'ready' if ready else 'not ready'}"
        time.sleep(0.1)


# --- strangers on the listen port ------------------------------------------------------------------------------

def test_garbage_gets_an_error_and_a_close(cluster):
    only_error(raw_reply(cluster.listen_port, b"\xff" * 64), "frame header announces")


@pytest.mark.parametrize("request_line", [b"GET /v1/models HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1",
                                          b"HEAD / HTTP/1.0"])
def test_an_http_client_on_the_workers_port_is_told_in_http_where_the_api_is(cluster, request_line):
    """curl or an OpenAI client given head.listen's port instead of head.api's: an HTTP answer it can show, which
    names the API's address, and a line in the head's log; the head serves on."""
    with socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=15) as sock:
        sock.sendall(request_line + b"\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        reply = b""
        while chunk := sock.recv(65536):  # a timeout here: the head kept the connection open
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply
    assert f"the OpenAI API is at http://127.0.0.1:{cluster.api_port}/v1 (head.api)".encode() in body, reply
    assert f"Content-Length: {len(body)}".encode() in head
    deadline = time.monotonic() + 30
    while "asked the workers' port; the API is at" not in cluster.head.output():
        assert time.monotonic() < deadline, cluster.head.output()[-2000:]
        time.sleep(0.1)
    assert cluster.get("/health")[0] == 200


def test_the_api_address_told_is_one_the_client_can_reach():
    """head.api on a wildcard (the example's 0.0.0.0:8000) is no address to give a client: it is told the address
    it reached the head at, with the API's port; a named host is told as it is."""
    from tc.head.workers import api_address
    from tc.topology import HostPort

    assert str(api_address(HostPort("0.0.0.0", 8000), "192.168.1.50")) == "192.168.1.50:8000"
    assert str(api_address(HostPort("::", 8000), "fd00::5")) == "[fd00::5]:8000"
    assert str(api_address(HostPort("10.0.0.2", 8000), "192.168.1.50")) == "10.0.0.2:8000"
    assert str(api_address(HostPort("0.0.0.0", 8000), None)) == "0.0.0.0:8000"


def test_well_framed_garbage_body_gets_an_error(cluster):
    only_error(raw_reply(cluster.listen_port, frame_header(5) + b"\x00\x01\x02\x03\x04"))
    only_error(raw_reply(cluster.listen_port, frame_header(1) + encode_cbor([1, 2, 3])[:1]))


def test_oversized_frame_before_joining(cluster):
    # a peer that has not joined may not make the head buffer more than a HELLO needs
    only_error(raw_reply(cluster.listen_port, frame_header(8 << 20)), "over the", "cap",
               "not a tc worker of this release")


def batch(sequence: int, start: int, capacity: int, hidden: torch.Tensor) -> RunBatch:
    """A RUN_BATCH of one sequence's rows."""
    entry = BatchEntry(sequence=sequence, position_start=start, length=hidden.shape[1], cache_capacity=capacity)
    return RunBatch(entries=(entry,), hidden_state=hidden)


def test_truncated_frame_closes_without_harm(cluster):
    frame = encode(worker_hello("b"))
    assert raw_reply(cluster.listen_port, frame[: len(frame) // 2], half_close=True) == []


def test_commands_before_hello_are_refused(cluster):
    step = batch(1, 0, 4, torch.zeros(1, 1, HIDDEN))
    only_error(raw_reply(cluster.listen_port, encode(step, "req-1", 1)), "expected HELLO, got RUN_BATCH")
    only_error(raw_reply(cluster.listen_port, encode(Pong(1))), "expected HELLO, got PONG")


def test_unknown_message_type_and_wrong_version(cluster):
    envelope = encode_cbor({"type": "SUDO", "request_id": None, "seq": 0, "payload": {}})
    only_error(raw_reply(cluster.listen_port, frame_header(len(envelope)) + envelope), "unknown message type")
    hello = worker_hello("b", protocol_version=PROTOCOL_VERSION + 7)
    only_error(raw_reply(cluster.listen_port, encode(hello)), "protocol version")


# --- a fake worker that joins and then misbehaves -------------------------------------------------------------

def _request_in_thread(cluster: Cluster) -> dict:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(reply=completion(cluster)), daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def _finished(result: dict) -> tuple[int, dict]:
    result["thread"].join(30)
    assert not result["thread"].is_alive(), "the request hung"
    return result["reply"]


def test_hidden_state_of_the_wrong_shape(cluster):
    fake = join_fake(cluster, "b")
    wait_ready_state(cluster, True)
    result = _request_in_thread(cluster)
    prefill = fake.next(RunBatch)
    bad = HiddenState(hidden_state=torch.zeros(1, prefill.hidden_state.shape[1], HIDDEN + 1), compute_seconds=0.0)
    fake.conn.send(bad, fake.last.request_id, fake.last.seq)
    assert "HIDDEN_STATE has shape" in fake.closing_error().message
    status, body = _finished(result)
    assert status == 503 and body["error"]["type"] == "worker_lost" and "worker b" in body["error"]["message"]
    assert cluster.get("/health")[0] == 200


def test_hidden_state_of_an_unknown_dtype(cluster):
    fake = join_fake(cluster, "b")
    wait_ready_state(cluster, True)
    result = _request_in_thread(cluster)
    fake.next(RunBatch)
    tensor = {"dtype": "int64", "shape": [1, 1, HIDDEN], "data": bytes(8 * HIDDEN)}
    envelope = encode_cbor({"type": "HIDDEN_STATE", "request_id": fake.last.request_id, "seq": fake.last.seq,
                            "payload": {"hidden_state": tensor, "compute_seconds": 0.0, "upstream_seconds": []}})
    fake.conn._sock.sendall(frame_header(len(envelope)) + envelope)
    assert "tensor dtype" in fake.closing_error().message
    status, body = _finished(result)
    assert status == 503 and body["error"]["type"] == "worker_lost"


def test_reply_nobody_asked_for(cluster):
    fake = join_fake(cluster, "b")
    fake.conn.send(HiddenState(hidden_state=torch.zeros(1, 1, HIDDEN), compute_seconds=0.0), "req-999", 4)
    assert "was not asked for" in fake.closing_error().message


def test_second_hello(cluster):
    fake = join_fake(cluster, "b")
    fake.conn.send(worker_hello("b"))
    assert "does not accept HELLO" in fake.closing_error().message


def test_a_worker_that_could_not_load_shows_as_failed_with_the_reason(cluster):
    # the head frees b's place when it has closed the last test's connection, a moment after telling it why
    deadline = time.monotonic() + 10
    while (row := cluster.get("/v1/cluster")[1]["nodes"][1])["state"] != "waiting":
        assert time.monotonic() < deadline, row
        time.sleep(0.05)
    conn = Connection(socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=15))
    with conn:
        conn.send(worker_hello("b"))
        assert isinstance(conn.recv(timeout=15).message, HelloAck)
        assert isinstance(conn.recv(timeout=15).message, Assignment)
        conn.send(LoadFailed(reason="out of memory on cpu: tried to allocate 9 GB"))
        deadline = time.monotonic() + 10
        while (row := cluster.get("/v1/cluster")[1]["nodes"][1])["state"] != "failed":
            assert time.monotonic() < deadline, row
            time.sleep(0.1)
        assert row["id"] == "b" and row["detail"] == "load failed: out of memory on cpu: tried to allocate 9 GB"
        assert cluster.get("/health/ready")[0] == 503
        # the worker stays connected and does nothing more: the head's log says what the operator does next
        assert ("could not load its layers: out of memory on cpu: tried to allocate 9 GB; the node stays out of the "
                "cluster until that is fixed and the worker restarted") in cluster.head.output()


def test_oversized_frame_from_a_joined_worker_is_bounded_by_the_topology(tmp_path, model_dir):
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}],
                          head={"max_frame_mb": 0.5})
    with Cluster(topo, tmp_path) as small:
        small.start_head()
        small.wait_api()
        fake = FakeWorker(small.listen_port, "a")
        fake.conn._sock.sendall(frame_header(1 << 20))
        assert "over the 524288-byte cap; that is head.max_frame_mb" in fake.closing_error().message


def test_after_all_that_a_real_worker_fills_b_and_the_cluster_serves(cluster, model_dir):
    wait_ready_state(cluster, False)
    cluster.start_worker("b")
    cluster.wait_ready()
    status, body = completion(cluster, 8)
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy(model_dir, 8)
    assert cluster.head.proc.poll() is None and cluster.workers["a"].proc.poll() is None
    log = cluster.head.output()
    assert "Traceback" not in log, log[log.find("Traceback") - 1500:log.find("Traceback") + 2500]


# --- a fake head that misbehaves towards a real worker ---------------------------------------------------------

class FakeHead:
    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(60)
        self.port = self.listener.getsockname()[1]

    def accept(self, node_id: str = "a") -> Connection:
        sock, _ = self.listener.accept()
        conn = Connection(sock)
        assert isinstance(conn.recv(timeout=30).message, Hello)
        conn.send(HelloAck(node_id=node_id))
        return conn

    def close(self) -> None:
        self.listener.close()


def expect_error_then_close(conn: Connection, *phrases: str) -> None:
    env = conn.recv(timeout=30)
    assert isinstance(env.message, Error), env.message
    for phrase in phrases:
        assert phrase in env.message.message, env.message.message
    with pytest.raises(ConnectionClosed):
        conn.recv(timeout=30)


def assignment_for(model_dir) -> Assignment:
    config = Qwen2Config.from_file(model_dir / "config.json")
    return Assignment(model_id=str(model_dir), model_source="local", revision=None, device="cpu",
                      architecture="qwen2", quant="fp16", group_size=128, compute_dtype="fp32", layer_start=0,
                      layer_end_exclusive=config.num_hidden_layers, config=config.to_dict(),
                      tensor_count=12 * config.num_hidden_layers)


def test_worker_drops_a_head_that_breaks_the_protocol_and_rejoins(tmp_path, model_dir):
    head = FakeHead()
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    cluster = Cluster(topo, tmp_path)
    cluster.listen_port = head.port
    try:
        worker = cluster.start_worker("a", "--retry-max-s", "1")
        conn = head.accept()
        conn.send(batch(1, 0, 4, torch.zeros(1, 1, HIDDEN)), "req-1", 1)
        expect_error_then_close(conn, "RUN_BATCH before any ASSIGNMENT")

        conn = head.accept()  # it rejoined
        conn._sock.sendall(frame_header(4) + b"\xff\xff\xff\xff")
        expect_error_then_close(conn)

        conn = head.accept()
        conn.send(worker_hello("a"))
        expect_error_then_close(conn, "does not accept HELLO")

        conn = head.accept()
        conn._sock.sendall(frame_header(1 << 40))
        expect_error_then_close(conn, "frame header announces", "this worker's --max-frame-mb (TC_MAX_FRAME_MB)")

        # a well-behaved session on the same worker: bad commands fail the request, not the connection
        conn = head.accept()
        conn.send(assignment_for(model_dir))
        while True:
            env = conn.recv(timeout=60)
            assert not isinstance(env.message, (Error, LoadFailed)), env.message
            if isinstance(env.message, LoadComplete):
                break
        x = torch.randn(1, 3, HIDDEN)
        conn.send(batch(1, 0, 10**12, x), "req-2", 1)
        reply = conn.recv(timeout=30).message
        assert isinstance(reply, InferenceError) and "over the model's context" in reply.message
        conn.send(batch(1, 0, 8, torch.randn(1, 3, HIDDEN + 2)), "req-2", 2)
        assert isinstance(conn.recv(timeout=30).message, InferenceError)
        conn.send(batch(1, 5, 8, torch.randn(1, 1, HIDDEN)), "req-2", 3)
        reply = conn.recv(timeout=30).message
        assert isinstance(reply, InferenceError) and "holds no cache" in reply.message
        conn.send(batch(1, 0, 8, x), "req-3", 1)
        env = conn.recv(timeout=30)
        assert isinstance(env.message, HiddenState) and env.request_id == "req-3"
        assert tuple(env.message.hidden_state.shape) == (1, 3, HIDDEN)
        assert worker.proc.poll() is None
        conn.close()
    finally:
        cluster.stop()
        head.close()


def worker_with_a_fake_head(tmp_path, model_dir, *extra: str) -> tuple[FakeHead, Cluster, object]:
    head = FakeHead()
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    cluster = Cluster(topo, tmp_path)
    cluster.listen_port = head.port
    return head, cluster, cluster.start_worker("a", "--retry-max-s", "1", *extra)


def next_load_report(conn: Connection):
    """LOAD_COMPLETE or LOAD_FAILED, past any LOAD_PROGRESS."""
    while True:
        message = conn.recv(timeout=20).message
        if not isinstance(message, LoadProgress):
            return message


def test_a_rejoined_worker_reports_its_kept_layers_as_taking_no_load_time(tmp_path, model_dir):
    """A worker that rejoins with the assignment it has loaded keeps its layers, and its LOAD_COMPLETE says no time
    went to loading them: it repeated the first load's seconds, and the head's log showed a reload that never
    happened."""
    head, cluster, worker = worker_with_a_fake_head(tmp_path, model_dir)
    try:
        conn = head.accept()
        conn.send(assignment_for(model_dir))
        first = next_load_report(conn)
        assert isinstance(first, LoadComplete) and first.load_seconds > 0, first
        conn.close()
        conn = head.accept()  # it rejoined
        conn.send(assignment_for(model_dir))
        again = next_load_report(conn)
        assert isinstance(again, LoadComplete) and again.load_seconds == 0.0, again
        assert again.weight_bytes == first.weight_bytes
        assert "already loaded; reusing them" in worker.output()
        conn.close()
        conn = head.accept()  # another context served: rotary tables made for it (longrope's are), so a new load
        conn.send(replace(assignment_for(model_dir), context_length=64))
        other = next_load_report(conn)
        assert isinstance(other, LoadComplete) and other.load_seconds > 0, other
        assert worker.output().count("already loaded; reusing them") == 1
        conn.close()
    finally:
        cluster.stop()
        head.close()


def test_a_worker_whose_head_goes_away_mid_prompt_gives_the_step_up_and_rejoins(tmp_path):
    """The head's connection ends while the worker runs a long prompt through its layers: the step is given up
    at the next layer, not run to its end for no one, so the worker rejoins within the head's resume grace
    rather than after a step that may take minutes on a slow CPU."""
    # 32 layers over 8192 positions: several seconds here, long enough on any CPU for the close to come mid-step
    model_dir = write_tiny_model(tmp_path / "deep", num_hidden_layers=32, max_position_embeddings=8192)
    trace = tmp_path / "trace"
    trace.mkdir()
    head = FakeHead()
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    cluster = Cluster(topo, tmp_path, env={"TC_TRACE_DIR": str(trace)})
    cluster.listen_port = head.port
    try:
        worker = cluster.start_worker("a", "--retry-max-s", "1")
        conn = head.accept()
        conn.send(assignment_for(model_dir))
        assert isinstance(next_load_report(conn), LoadComplete)
        conn.send(batch(1, 0, 8192, torch.randn(1, 8192, HIDDEN)))
        deadline = time.monotonic() + 30
        while not any(line.endswith(" compute") for f in trace.glob("*.trace") for line in f.read_text().splitlines()):
            assert time.monotonic() < deadline, "the worker never began the step"
            time.sleep(0.005)
        conn.close()  # while its 32 layers run
        head.accept().close()  # it rejoined
        assert "RUN_BATCH given up: the step was given up after" in worker.output()
        assert "Traceback" not in worker.output()
    finally:
        cluster.stop()
        head.close()


@contextlib.contextmanager
def worker_downloading(tmp_path, model_dir) -> Iterator[tuple[HubStandIn, FakeHead, Connection, object]]:
    """A real worker assigned the tiny model as a Hub repo whose shard the Hub stand-in holds half sent: (the
    stand-in, the fake head, its connection to the worker, the worker's process) once the assignment is sent."""
    with HubStandIn({"acme/tiny-qwen": model_dir}, hold={"model.safetensors"}) as hub:
        head = FakeHead()
        topo = write_topology(tmp_path / "t.yaml", "acme/tiny-qwen", [{"id": "a", "device": "cpu"}])
        cluster = Cluster(topo, tmp_path, env={"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
                                               "HF_HUB_DOWNLOAD_TIMEOUT": "300", "TC_DOWNLOAD_STALL_S": "300"})
        cluster.listen_port = head.port
        try:
            worker = cluster.start_worker("a", "--retry-max-s", "1", "--hf-cache-dir", str(tmp_path / "cache"))
            conn = head.accept()
            conn.send(replace(assignment_for(model_dir), model_id="acme/tiny-qwen", model_source="hub"))
            yield hub, head, conn, worker
        finally:
            cluster.stop()
            head.close()


def test_a_worker_tells_the_head_how_its_download_goes(tmp_path, model_dir):
    """A worker fetching its shards from the Hub reports the bytes so far in LOAD_PROGRESS (the head shows them for
    the node): a multi-GB download is not minutes of a bare "loading". Here the Hub stand-in holds the shard half
    sent until the head has heard of it."""
    size = (model_dir / "model.safetensors").stat().st_size
    with worker_downloading(tmp_path, model_dir) as (hub, _, conn, _):
        first = conn.recv(timeout=60).message
        assert isinstance(first, LoadProgress), first
        assert first.stage == "download of model.safetensors (1 of 1)"
        assert 0 < first.done <= size // 2 and first.total == size
        hub.release.set()
        reports = [first]
        while not isinstance(reports[-1], (LoadComplete, LoadFailed)):
            reports.append(conn.recv(timeout=60).message)
        assert isinstance(reports[-1], LoadComplete), reports[-1]
        downloads = [r for r in reports if isinstance(r, LoadProgress) and r.stage.startswith("download")]
        assert (downloads[-1].done, downloads[-1].total) == (size, size)  # the last report: the file whole
        assert [r.stage for r in reports if isinstance(r, LoadProgress)][-1] == "layers"
        conn.close()
    # what the head shows for the node (GET /v1/cluster's detail)
    assert load_progress_detail(first) == f"download of model.safetensors (1 of 1): {first.done / 1e6:.1f} of " \
        f"{size / 1e6:.1f} MB"
    assert load_progress_detail(reports[-2]) == f"loading layers {reports[-2].done}/{reports[-2].total}"


def test_a_head_gone_mid_download_is_no_download_failure(tmp_path, model_dir):
    """The head goes away while the worker downloads its shard: the download ends at its next report and the
    worker rejoins, logging no failed load (the Hub did nothing wrong)."""
    with worker_downloading(tmp_path, model_dir) as (hub, head, conn, worker):
        assert isinstance(conn.recv(timeout=60).message, LoadProgress)
        conn.close()
        hub.release.set()  # its next report finds the head gone
        head.accept().close()  # it rejoined
        assert "could not load layers" not in worker.output() and "Traceback" not in worker.output()


def test_worker_reports_a_load_failure_of_any_kind_and_stays_out_of_service(tmp_path, model_dir):
    head, cluster, worker = worker_with_a_fake_head(tmp_path, model_dir)
    try:
        conn = head.accept()
        good = assignment_for(model_dir)
        # config.json says 0 heads: building the layers fails with an error no load step expects
        conn.send(Assignment(**{**good.__dict__, "config": {**good.config, "num_attention_heads": 0}}))
        report = next_load_report(conn)
        assert isinstance(report, LoadFailed) and report.reason, report
        # still joined, out of service: it answers a PING, and refuses a command with a reason
        conn.send(Ping(nonce=7))
        assert conn.recv(timeout=10).message == Pong(nonce=7)
        conn.send(batch(1, 0, 8, torch.zeros(1, 2, HIDDEN)), "req-1", 1)
        env = conn.recv(timeout=10)
        assert isinstance(env.message, Error) and env.request_id == "req-1" and "before an ASSIGNMENT was loaded" \
            in env.message.message, env.message
        assert worker.proc.poll() is None and report.reason in worker.output()
        conn.close()
    finally:
        cluster.stop()
        head.close()


def test_worker_whose_reply_cannot_be_sent_tells_the_head_and_rejoins(tmp_path, model_dir):
    """A bf16 prefill fits the worker's frame cap; its fp32 reply, twice the size, does not."""
    cap_mb = 1100 / (1 << 20)
    head, cluster, worker = worker_with_a_fake_head(tmp_path, model_dir, "--max-frame-mb", f"{cap_mb:.7f}")
    try:
        conn = head.accept()
        conn.send(assignment_for(model_dir))
        assert isinstance(next_load_report(conn), LoadComplete)
        x = torch.randn(1, 6, HIDDEN, dtype=torch.bfloat16)
        conn.send(batch(1, 0, 8, x), "req-1", 1)
        env = conn.recv(timeout=20)
        assert isinstance(env.message, Error) and env.message.code == ERROR_COMPUTE_FAILED, env.message
        assert "worker a is out of service (the compute thread failed on RUN_BATCH: ValueError: HIDDEN_STATE " \
               "encodes to" in env.message.message, env.message
        with pytest.raises(ConnectionClosed):
            conn.recv(timeout=20)
        conn = head.accept()  # it rejoined, and its layers are still loaded
        conn.send(assignment_for(model_dir))
        assert isinstance(next_load_report(conn), LoadComplete)
        assert worker.proc.poll() is None and "left the head after a compute failure" in worker.output()
        assert "already loaded; reusing" in worker.output()
        conn.close()
    finally:
        cluster.stop()
        head.close()


def test_a_head_that_stops_reading_is_left_for_that_reason(tmp_path, model_dir):
    """The head sends PINGs and reads none of the PONGs: once the buffers are full the worker's send times out
    (--head-timeout-s), and the worker says so as it rejoins; it said the head had closed the connection."""
    head, cluster, worker = worker_with_a_fake_head(tmp_path, model_dir, "--head-timeout-s", "3")
    try:
        for _ in range(3):  # a join whose silence ran out before the PINGs came (a stalled machine) is tried again
            conn = head.accept()
            with pytest.raises(ConnectionClosed):  # the worker leaves, its PINGs unread
                for nonce in itertools.count(1):
                    conn.send(Ping(nonce=nonce, payload=bytes(1 << 20)))
            conn.close()
            head.accept().close()  # it rejoined: its log has said why it left
            if "lost the head (sending PONG" in worker.output():
                break
        assert "lost the head (sending PONG to 127.0.0.1:" in worker.output()
        assert "timed out: it took no bytes for 3s" in worker.output()
        assert "the head closed the connection" not in worker.output()
    finally:
        cluster.stop()
        head.close()


def test_worker_told_the_head_is_shutting_down_leaves_and_rejoins(tmp_path, model_dir):
    head, cluster, worker = worker_with_a_fake_head(tmp_path, model_dir)
    try:
        conn = head.accept()
        conn.send(Error(code=ERROR_SHUTTING_DOWN, message="the head is shutting down; rejoin when it is back"))
        with pytest.raises(ConnectionClosed):
            conn.recv(timeout=20)
        assert "the head says: the head is shutting down; rejoin when it is back; rejoining" in worker.output()
        # told so at its next join (a head still stopping), it does not take it for a refusal: it comes back
        sock, _ = head.listener.accept()
        with Connection(sock) as conn:
            assert isinstance(conn.recv(timeout=30).message, Hello)
            conn.send(Error(code=ERROR_SHUTTING_DOWN, message="the head is shutting down; rejoin when it is back"))
        head.accept().close()
        assert worker.proc.poll() is None
    finally:
        cluster.stop()
        head.close()

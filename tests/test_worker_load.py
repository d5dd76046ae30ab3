"""The worker's loading, driven over a real connection: what LOAD_COMPLETE reports, and what a reassignment frees
before it loads."""
from __future__ import annotations

import queue
import socket
import threading
import weakref

import pytest
import torch

from model_helpers import local_assignment
from tc.model.config import ModelConfig
from tc.protocol.connection import Connection
from tc.protocol.messages import Assignment, BatchEntry, HiddenState, LoadComplete, LoadFailed, RunBatch
from tc.worker.main import Worker, WorkerOptions




class RecordingWorker(Worker):
    """A worker that notes, as each load starts, which stages it loaded before are still in memory."""

    def __init__(self, options: WorkerOptions):
        super().__init__(options)
        self.stages: list[weakref.ref] = []
        self.alive_when_loading: list[list[bool]] = []

    def load(self, conn, assignment, interrupted=None):
        self.alive_when_loading.append([ref() is not None for ref in self.stages])
        runtime = super().load(conn, assignment, interrupted)
        if runtime is not None:
            self.stages.append(weakref.ref(runtime.loaded.stage))
        return runtime


@pytest.fixture
def worker_and_head():
    worker_end, head_end = socket.socketpair()
    worker_conn, head_conn = Connection(worker_end), Connection(head_end)
    worker = RecordingWorker(WorkerOptions(host="127.0.0.1", port=1, node_id="w", device="cpu", hf_cache_dir=None,
                                           max_memory_bytes=None))
    jobs: queue.Queue = queue.Queue()
    thread = threading.Thread(target=worker.compute_loop, args=(worker_conn, jobs), daemon=True)
    thread.start()

    def assign(msg: Assignment):
        """Send an ASSIGNMENT through the connection and return the worker's final answer to it."""
        head_conn.send(msg)
        jobs.put((worker_conn.recv(timeout=10), False))  # (envelope, from the stage before)
        while True:
            reply = head_conn.recv(timeout=60).message
            if isinstance(reply, (LoadComplete, LoadFailed)):
                return reply

    def step(request_id: str, hidden_size: int, wait: bool = True):
        """Send a prompt of three rows for layers loaded through the connection, queue it for the worker and, with
        `wait`, return the worker's answer."""
        rows = torch.randn(1, 3, hidden_size, generator=torch.Generator().manual_seed(0))
        head_conn.send(RunBatch(entries=(BatchEntry(sequence=0, position_start=0, length=3, cache_capacity=8),),
                                hidden_state=rows), request_id)
        jobs.put((worker_conn.recv(timeout=10), False))
        return head_conn.recv(timeout=60) if wait else None

    def heard_after_the_last_job() -> list:
        """End the compute loop once the jobs queued so far are done; what the worker sent the head meanwhile."""
        jobs.put(None)
        thread.join(timeout=30)
        assert not thread.is_alive()
        heard = []
        while True:
            try:
                heard.append(head_conn.recv(timeout=0.2))  # sent before the thread ended: already here
            except TimeoutError:
                return heard

    yield worker, assign, step, heard_after_the_last_job
    jobs.put(None)
    thread.join(timeout=10)
    worker_conn.close()
    head_conn.close()


def test_load_complete_reports_the_dtype_the_worker_computes_in(tiny_model_dir, worker_and_head):
    _, assign, *_ = worker_and_head
    # fp16 asked of a CPU computes in fp32: the head must hear fp32
    reply = assign(local_assignment(tiny_model_dir, 0, 2, compute_dtype="fp16"))
    assert isinstance(reply, LoadComplete) and reply.compute_dtype == "fp32" and reply.device == "cpu"
    assert assign(local_assignment(tiny_model_dir, 0, 2, compute_dtype="bf16")).compute_dtype == "bf16"


def test_a_reassignment_frees_the_old_layers_before_loading_the_new(tiny_model_dir, worker_and_head):
    worker, assign, *_ = worker_and_head
    assert isinstance(assign(local_assignment(tiny_model_dir, 0, 2)), LoadComplete)
    assert isinstance(assign(local_assignment(tiny_model_dir, 2, 4)), LoadComplete)
    assert worker.alive_when_loading[1] == [False]  # layers 0-1 were gone before layers 2-3 started loading
    # the same assignment again keeps what is loaded rather than loading it twice
    assert isinstance(assign(local_assignment(tiny_model_dir, 2, 4)), LoadComplete)
    assert worker.alive_when_loading[2] == [False, True]
    assert worker.loaded is not None and worker.loaded[1].stage is worker.stages[1]()  # set before LOAD_COMPLETE


def test_a_model_directory_missing_on_the_worker_machine_is_named_so(tiny_model_dir, worker_and_head, tmp_path):
    """The head has the local model; a worker machine without a copy at the same path said the directory had no
    config.json and asked whether it was a HuggingFace model directory, which it is, on the head."""
    _, assign, *_ = worker_and_head
    reply = assign(local_assignment(tiny_model_dir, 0, 2, model_id=str(tmp_path / "not-copied-here")))
    assert isinstance(reply, LoadFailed)
    assert "not-copied-here: no such directory on this machine" in reply.reason
    assert "copy the model directory here" in reply.reason


def test_a_worker_that_is_leaving_runs_and_passes_on_no_step(tiny_model_dir, worker_and_head):
    """From SIGTERM on (shutdown sets stop first), a step already queued is neither run nor answered: the head is
    to hear the worker's farewell, and the request fail as the signal says, where the queued frames carried it on,
    now and then to its end, before the head read the farewell."""
    worker, assign, step, heard_after_the_last_job = worker_and_head
    assert isinstance(assign(local_assignment(tiny_model_dir, 0, 2)), LoadComplete)
    hidden_size = ModelConfig.from_file(tiny_model_dir / "config.json").hidden_size
    answer = step("before", hidden_size)
    assert answer.request_id == "before" and isinstance(answer.message, HiddenState), answer
    worker.stop.set()
    step("while leaving", hidden_size, wait=False)
    assert heard_after_the_last_job() == []

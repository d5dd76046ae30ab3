"""Trace marks (tc/trace.py): real processes mark each hand-off of a step, and the reader lays the steps out."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cluster import ROOT, Cluster, write_topology
from tc.trace import decode_steps, read_events
from tiny_model import write_tiny_model

NODES = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
CHAIN = [("head", "send"), ("head", "encoded"), ("head", "sent"),
         ("w1", "read"), ("w1", "received"), ("w1", "computing"), ("w1", "compute"), ("w1", "computed"),
         ("w1", "encoded"), ("w1", "passed"),
         ("w2", "read"), ("w2", "peer received"), ("w2", "computing"), ("w2", "compute"), ("w2", "computed"),
         ("w2", "encoded"), ("w2", "answered"),
         ("head", "read"), ("head", "received"), ("head", "woke"), ("head", "chosen")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=5)


def test_every_step_through_head_and_two_workers_is_traced_hand_off_by_hand_off(tmp_path, model_dir):
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    with Cluster(topology, tmp_path, env={"TC_TRACE_DIR": str(trace_dir)}) as cluster:
        cluster.start_head()
        cluster.wait_api()
        for node in NODES:
            cluster.start_worker(node["id"])
        cluster.wait_ready()
        since = time.perf_counter_ns()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": "the quick brown fox",
                                                        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
    events = read_events(trace_dir)
    assert len({pid for _, pid, _ in events}) == 3  # the head and both workers wrote
    steps = decode_steps(events, workers=2, since_ns=since)
    assert len(steps) == 6  # the prompt's step and five decode steps, each through both workers
    for step in steps:
        assert [(node, event) for node, event, _ in step] == CHAIN
        times = dict(((node, event), ns) for node, event, ns in step)
        # each process's own marks come in order; a frame is read after its send began
        for node in ("head", "w1", "w2"):
            own = [ns for n, _, ns in step if n == node]
            assert own == sorted(own), node
        assert times[("head", "send")] < times[("head", "encoded")] < times[("w1", "read")] \
            < times[("w1", "received")] < times[("w1", "compute")]
        assert times[("w1", "computed")] < times[("w1", "encoded")] < times[("w2", "read")] \
            < times[("w2", "peer received")]
        assert times[("w2", "computed")] < times[("w2", "encoded")] < times[("head", "read")] \
            < times[("head", "received")] < times[("head", "woke")] < times[("head", "chosen")]


def test_marks_cost_nothing_and_write_nothing_unless_asked(tmp_path):
    script = "from tc.trace import mark; mark('send'); mark('sent')"
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, env={"PYTHONPATH": str(ROOT)})
    assert list(tmp_path.iterdir()) == []
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True,
                   env={"PYTHONPATH": str(ROOT), "TC_TRACE_DIR": str(tmp_path)})
    (written,) = tmp_path.iterdir()
    assert [line.split(" ", 2)[2] for line in written.read_text().splitlines()] == ["send", "sent"]


def test_the_reader_keeps_whole_chains_only():
    """A worker's reader may read a frame before its sender's call returned, a ping may wake another worker's
    reader in between (it reads, decodes and answers the ping), and a step cut short is left out."""
    head, w1, w2 = 10, 11, 12
    one = [(0, head, "send"), (1, head, "encoded"),
           (2, w2, "read"), (3, w2, "received"), (4, w2, "encoded"),  # w2 answers a ping
           (5, w1, "read"), (6, w1, "received"), (7, head, "sent"),
           (8, w1, "computing"), (9, w1, "compute"), (20, w1, "computed"), (21, w1, "encoded"), (22, w2, "read"),
           (23, w2, "peer received"), (24, w1, "passed"), (25, w2, "computing"), (26, w2, "compute"),
           (40, w2, "computed"), (41, w2, "encoded"), (42, head, "read"), (43, w2, "answered"),
           (44, head, "received"), (45, head, "woke"), (46, head, "chosen")]
    cut = [(100, head, "send"), (101, head, "encoded"), (102, head, "sent"), (103, w1, "read")]
    steps = decode_steps(sorted(one + cut), workers=2)
    assert len(steps) == 1
    assert [(node, event) for node, event, _ in steps[0]] == CHAIN
    times = dict(((node, event), ns) for node, event, ns in steps[0])
    assert (times[("w1", "read")], times[("w2", "read")], times[("w2", "peer received")]) == (5, 22, 23)
    assert times[("head", "read")] == 42  # read before the last worker's send returned
    assert decode_steps(sorted(one + cut), workers=2, since_ns=1) == []


def test_a_send_that_returns_after_the_next_step_began_still_belongs_to_its_step():
    """On shared cores the last worker's send may return only once the head has chosen the token and sent the next
    step: that step's `answered` then comes after the next `send`, and both steps are still whole."""
    head, w1, w2 = 10, 11, 12

    def step(t: int, answered_at: int) -> list[tuple[int, int, str]]:
        return [(t, head, "send"), (t + 1, head, "encoded"), (t + 2, head, "sent"), (t + 3, w1, "read"),
                (t + 4, w1, "received"), (t + 5, w1, "computing"), (t + 6, w1, "compute"), (t + 7, w1, "computed"),
                (t + 8, w1, "encoded"), (t + 9, w1, "passed"), (t + 10, w2, "read"), (t + 11, w2, "peer received"),
                (t + 12, w2, "computing"), (t + 13, w2, "compute"), (t + 14, w2, "computed"), (t + 15, w2, "encoded"),
                (t + 16, head, "read"), (t + 17, head, "received"), (t + 18, head, "woke"), (t + 19, head, "chosen"),
                (answered_at, w2, "answered")]

    steps = decode_steps(sorted(step(0, 25) + step(20, 36)), workers=2)
    assert [[(node, event) for node, event, _ in s] for s in steps] == [CHAIN, CHAIN]
    assert [dict(((node, event), ns) for node, event, ns in s)[("w2", "answered")] for s in steps] == [25, 36]

"""What ASSIGNMENT carries and what a worker does with it: torch threads from the topology entry, and the checks a
worker makes before it serves (architecture, the tensors of its layers)."""
from __future__ import annotations

import re
import sys
import time

import pytest

from cluster import ROOT, Cluster, Process, write_topology
from tiny_model import write_tiny_model

# Subprocesses import this checkout's tc, whatever tc the interpreter has installed.
ENV = {"PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=7)


def wait_for_line(process: Process, pattern: str, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, process.output())
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in:\n{process.output()}")


def test_the_topology_entry_threads_reach_the_worker_unless_its_command_line_sets_them(tmp_path, model_dir):
    nodes = [{"id": "a", "device": "cpu", "threads": 1}, {"id": "b", "device": "cpu", "threads": 1}]
    topo = write_topology(tmp_path / "t.yaml", model_dir, nodes)
    with Cluster(topo, tmp_path, env=ENV) as cluster:
        cluster.start_head()
        cluster.wait_api()
        # a: no --threads, so its entry's apply; b: --threads 2 on its own command line, which wins
        cluster.workers["a"] = Process([sys.executable, "-m", "tc", "worker", "--join",
                                        f"127.0.0.1:{cluster.listen_port}", "--device", "cpu", "--node-id", "a"],
                                       tmp_path / "a.log", ENV, cwd=tmp_path)
        cluster.start_worker("b", "--threads", "2")
        cluster.wait_ready()
        a, b = cluster.workers["a"], cluster.workers["b"]
        assert wait_for_line(a, r"using (\d+) torch threads, from the topology entry").group(1) == "1"
        wait_for_line(b, r"the topology entry asks for 1 torch threads; keeping --threads 2")
        assert "from the topology entry" not in b.output()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert status == 200, body

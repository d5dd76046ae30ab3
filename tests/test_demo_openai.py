"""What OpenAI clients ask of a local server, on the real demo model through a head and two worker processes.

One cluster serves the whole module (starting it is most of the time): fill in the middle, tool calls with the
official `openai` client (whole, streamed, and the final answer from the tool's result), and structured output.
"""
from __future__ import annotations

import pytest

from cluster import Cluster, write_topology

pytestmark = [pytest.mark.demo, pytest.mark.slow]

MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, demo_model_dir):
    workdir = tmp_path_factory.mktemp("demo-openai")
    nodes = [{"id": "w0", "device": "cpu"}, {"id": "w1", "device": "cpu"}]
    topology = write_topology(workdir / "t.yaml", demo_model_dir, nodes, dtype="fp32")
    with Cluster(topology, workdir) as running:
        running.start_all(["w0", "w1"])
        yield running


def test_fill_in_the_middle_of_a_python_function(cluster):
    status, body = cluster.post("/v1/completions", {
        "model": MODEL_NAME, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(2, 3))\n",
        "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"].startswith("return a + b"), body

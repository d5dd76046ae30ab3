"""Each weight mode through head + 2 workers on the demo model: coherent greedy text."""
from __future__ import annotations

import pytest

from cluster import Cluster, write_topology

pytestmark = [pytest.mark.demo, pytest.mark.slow]

MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
PROMPT = "def is_prime(n):\n"


def greedy(tmp_path, demo_model_dir, quant: str) -> tuple[str, str]:
    nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
    topology = write_topology(tmp_path / f"{quant}.yaml", demo_model_dir, nodes, quant=quant, dtype="bf16")
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_all([node["id"] for node in nodes])
        status, body = cluster.post("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24,
                                                        "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["text"], cluster.workers["w1"].output()


@pytest.fixture(scope="module")
def bf16_text(tmp_path_factory, demo_model_dir) -> str:
    return greedy(tmp_path_factory.mktemp("bf16"), demo_model_dir, "fp16")[0]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_cluster_writes_coherent_code(tmp_path, demo_model_dir, bf16_text, quant):
    text, worker_log = greedy(tmp_path, demo_model_dir, quant)
    assert "return" in text and "n" in text, text  # it still writes the function
    if quant == "int8":  # int8 keeps the unquantized model's choices on a simple prompt
        assert text[:20] == bf16_text[:20], (text, bf16_text)
    # the worker holds 12 layers: int8 about half of bf16's 341.4 MiB, int4 about a quarter plus scales
    weight_mib = float(worker_log.split("ready: ")[1].split(" MiB")[0])
    assert weight_mib < {"int8": 0.55, "int4": 0.32}[quant] * 341.4

"""The cluster on the real demo model: real head and worker processes on loopback."""
from __future__ import annotations

import pytest

from cluster import Cluster, write_topology
from tc.local import load_local_generator
from tc.sampling import SamplingParams

pytestmark = [pytest.mark.demo, pytest.mark.slow]

PROMPT = "def quicksort(items):\n"
TOKENS = 16
MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"


@pytest.fixture(scope="module")
def single_process_text(demo_model_dir) -> str:
    generator = load_local_generator(demo_model_dir, "fp32")
    ids = generator.tokenizer.encode(PROMPT)
    return generator.generate(ids, SamplingParams(max_tokens=TOKENS, temperature=0)).text


@pytest.mark.parametrize("workers", [1, 2])
def test_greedy_text_equals_the_single_process_generator(tmp_path, demo_model_dir, single_process_text, workers):
    nodes = [{"id": f"w{i}", "device": "cpu"} for i in range(workers)]
    topology = write_topology(tmp_path / "t.yaml", demo_model_dir, nodes, dtype="fp32")
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_all([node["id"] for node in nodes])
        status, body = cluster.post("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT,
                                                        "max_tokens": TOKENS, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["text"] == single_process_text
        if workers == 2:
            log = cluster.head.output()
            assert "assigned layers 0-11" in log and "assigned layers 12-23" in log
            status, body = cluster.post("/v1/chat/completions", {
                "model": MODEL_NAME, "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "system", "content": "You are a concise assistant."},
                             {"role": "user", "content": "What is the capital of France? Answer in one word."}]})
            assert status == 200, body
            assert "Paris" in body["choices"][0]["message"]["content"]
            assert body["usage"]["prompt_tokens"] > 20

"""A slow network changes timing, not text: workers join through proxies that delay every byte each way, with
workers passing hidden states to each other and with the head relaying every hop.

(tests/test_netns.py does the same with `tc netem` inside network namespaces where the kernel has netem.)
"""
from __future__ import annotations

import time

import pytest
import torch

from cluster import Cluster, write_topology
from latency_proxy import LatencyProxy
from model_helpers import OurModel
from tc.generation import Generator
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

DELAY_S = 0.02
TOKENS = 10


@pytest.mark.parametrize("direct_hops", [True, False], ids=["direct hops", "relayed"])
def test_latency_changes_timing_not_text(tmp_path, direct_hops):
    model_dir = write_tiny_model(tmp_path / "tiny-qwen", seed=6)
    model, tok = OurModel(model_dir), TextTokenizer.load(model_dir)
    expected = Generator(model.head, tok, model.pipeline(), torch.float32).generate(
        tok.encode("slow links"), SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)).text
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    topology = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={"direct_hops": direct_hops})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        proxies = [LatencyProxy(("127.0.0.1", cluster.listen_port), DELAY_S) for _ in nodes]
        try:
            for node, proxy in zip(nodes, proxies):
                # the worker joins the proxy's port, which forwards to the head's with the delay each way
                cluster.start_worker(node["id"], "--join", f"127.0.0.1:{proxy.port}")
            cluster.wait_ready()
            started = time.monotonic()
            status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": "slow links",
                                                            "max_tokens": TOKENS, "temperature": 0,
                                                            "ignore_eos": True})
            took = time.monotonic() - started
            passes_to = {n["id"]: n["passes_to"] for n in cluster.get("/v1/cluster")[1]["nodes"]}
        finally:
            for proxy in proxies:
                proxy.close()
    assert status == 200 and body["choices"][0]["text"] == expected
    # relayed, every step crosses both delayed links there and back: at least 4 delays a step; with direct hops
    # it goes in by a's link and back by b's, a passing to b straight (the proxies stand only between head and
    # workers): at least 2
    assert took > TOKENS * (2 if direct_hops else 4) * DELAY_S
    assert passes_to == ({"a": "b", "b": "head"} if direct_hops else {"a": "head", "b": "head"})

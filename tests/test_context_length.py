"""How many positions a sequence may use: the model's own context (YaRN's scaled one where config.json asks for
it), or the topology's `context_length` where that is less; the plan's KV caches, the head's refusals and the
workers' caches all follow it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cluster import ROOT, Cluster, write_topology
from model_helpers import OurModel, hf_logits, hf_model
from tc.batch_memory import kv_bytes_per_slot
from tc.head.main import with_context
from tc.model.config import ModelConfig
from tc.planner import Stage
from tc.topology import TopologyError, parse_topology
from tiny_model import tiny_config, write_tiny_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def config_of(**changes) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(**changes))


@pytest.mark.parametrize("changes, context", [
    ({}, 256),
    ({"rope_scaling": YARN, "max_position_embeddings": 64}, 256),  # Qwen2.5's card: 32768 x 4 for 131072
    # DeepSeek's way: max_position_embeddings gives the scaled context already
    ({"rope_scaling": {**YARN, "factor": 2.0}, "max_position_embeddings": 512}, 512),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 256),  # linear checkpoints give the scaled context
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, 256),  # dynamic changes past it: not computed
])
def test_the_model_context_follows_its_rope_scaling(changes, context):
    config = config_of(**changes)
    assert config.model_context == context
    assert config.context_length == context


def test_context_length_lowers_the_context_and_may_not_raise_it():
    config = config_of(rope_scaling=YARN, max_position_embeddings=64)
    assert with_context(config, None) is config
    served = with_context(config, 100)
    assert (served.context_length, served.model_context) == (100, 256)
    assert with_context(config, 256).context_length == 256
    with pytest.raises(TopologyError) as caught:
        with_context(config, 257)
    assert caught.value.key_path == "context_length"
    assert "257 is more than this model holds (256 positions" in str(caught.value)


def test_each_sequence_is_planned_at_the_context_served():
    config = config_of()
    stage = Stage(node_id="a", device="cpu", dtype="fp32", start=0, end=2, weight_bytes=0, memory_bytes=None)
    full = kv_bytes_per_slot(config, stage)
    assert full == 2 * 2 * 2 * 16 * 256 * 4  # K and V x layers x KV heads x head_dim x positions x fp32
    assert kv_bytes_per_slot(with_context(config, 64), stage) * 4 == full


TOPOLOGY = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "quant": "fp16", "dtype": "bf16",
            "head": {"api": "127.0.0.1:8000", "listen": "127.0.0.1:7001"}, "nodes": [{"id": "a", "device": "cpu"}]}


def test_the_topology_reads_and_writes_context_length():
    assert parse_topology(TOPOLOGY, ROOT).context_length is None
    topology = parse_topology({**TOPOLOGY, "context_length": 8192}, ROOT)
    assert topology.context_length == 8192
    assert parse_topology(topology.to_dict(), ROOT) == topology
    for bad, says in ((0, "too small"), (1.5, "whole number"), ("8k", "whole number"), (True, "whole number")):
        with pytest.raises(TopologyError) as caught:
            parse_topology({**TOPOLOGY, "context_length": bad}, ROOT)
        assert caught.value.key_path == "context_length" and says in caught.value.message


def test_positions_past_max_position_embeddings_under_yarn_compute_as_transformers_does(tmp_path):
    """A YaRN model serves its scaled context: the logits of a prompt four times its max_position_embeddings equal
    transformers' (which applies YaRN's frequencies at every position)."""
    model_dir = write_tiny_model(tmp_path / "yarn", seed=5, rope_scaling=YARN, max_position_embeddings=64)
    ids = torch.randint(0, 250, (240,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = OurModel(model_dir).full_logits(ids)
    theirs = hf_logits(hf_model(model_dir), ids)
    torch.testing.assert_close(ours[64:], theirs[64:], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def short_cluster(tmp_path_factory):
    """A head and one worker serving a YaRN tiny model (its own context 256) at context_length 48."""
    workdir = tmp_path_factory.mktemp("context")
    model_dir = write_tiny_model(workdir / "model", seed=2, rope_scaling=YARN, max_position_embeddings=64)
    topology = write_topology(workdir / "topology.yaml", model_dir, [{"id": "w1", "device": "cpu"}],
                              context_length=48)
    cluster = Cluster(topology, workdir)
    try:
        cluster.start_all(["w1"])
        yield cluster
    finally:
        cluster.stop()


def test_a_head_serves_the_context_length_it_was_given(short_cluster):
    assert "context 48 positions" in short_cluster.head.output()
    assert short_cluster.get("/v1/models")[1]["data"][0]["max_model_len"] == 48
    status, body = short_cluster.post("/v1/completions", {"model": "model", "prompt": list(range(1, 49)),
                                                          "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 48 tokens" in body["error"]["message"]
    # a prompt of 40: room for 8 more, and no more, whatever max_tokens asks
    status, body = short_cluster.post("/v1/completions", {"model": "model", "prompt": list(range(1, 41)),
                                                          "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48}
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_tc_plan_on_the_demo_model_counts_caches_at_the_context_served(tmp_path):
    """`tc plan` on the demo model: its own 32768 positions, the fewer that context_length asks for (a KV cache
    a quarter the size), and YaRN's four times as many where its config.json adds Qwen's rope_scaling."""
    from _demo import demo_model_dir
    demo = demo_model_dir()
    yarn_dir = tmp_path / "yarn"
    yarn_dir.mkdir()
    for item in demo.iterdir():
        if item.name != "config.json":
            (yarn_dir / item.name).symlink_to(item)
    config = json.loads((demo / "config.json").read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (yarn_dir / "config.json").write_text(json.dumps(config))

    def plan(model, **settings) -> str:
        topology = write_topology(tmp_path / "topology.yaml", model, [{"id": "a", "device": "cpu"}], **settings)
        done = subprocess.run([sys.executable, "-m", "tc", "plan", str(topology)], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def per_sequence(output: str) -> str:
        return output.split("KV cache per sequence at full context: a ")[1].split()[0]

    own, shorter, scaled = plan(demo), plan(demo, context_length=8192), plan(yarn_dir)
    assert "context 32768 positions" in own and "context 8192 positions" in shorter
    assert "context 131072 positions" in scaled
    assert (per_sequence(own), per_sequence(shorter), per_sequence(scaled)) == ("768.0", "192.0", "3.00")

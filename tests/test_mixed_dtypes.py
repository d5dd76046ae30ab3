"""Workers computing in different dtypes in one pipeline: hidden states are converted at every hop."""
from __future__ import annotations

import sys

import pytest
import torch

from cluster import Process, write_topology
from model_helpers import OurModel
from tc.generation import Entry
from tc.head.main import start_head
from tc.topology import load_topology
from tiny_model import write_tiny_model


def run_mixed(tmp_path, model_dir, dtypes: list[str], ids: list[int]) -> tuple[torch.Tensor, str]:
    """fp32 logits for `ids` from a head in this process and one worker process per dtype."""
    nodes = [{"id": f"{d}-node", "device": "cpu", "dtype": d} for d in dtypes]
    topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, nodes, dtype="fp32"))
    head = start_head(topology.with_ports(api_port=0, listen_port=0))
    workers = []
    try:
        for node in nodes:
            workers.append(Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{head.listen_port}",
                                    "--node-id", node["id"], "--threads", "1", "--device", "cpu"],
                                   tmp_path / f"{node['id']}.log"))
        assert head.registry.wait_ready(300), [w.output() for w in workers]
        generator = head.service.generator
        with torch.inference_mode():
            entry = Entry(sequence=1, start=0, length=len(ids), capacity=len(ids))
            hidden = generator.pipeline.run([entry], generator.head.embed(torch.tensor([ids])))
            generator.pipeline.release([1])
            logits = generator.head.logits(hidden)[0]
        return logits, head.registry.plan.table()
    finally:
        for w in workers:
            w.stop()
        head.stop()


def test_fp32_and_bf16_workers_agree_with_the_fp32_model(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny", seed=8)
    ids = [3, 70, 111, 9, 250, 31, 42, 42, 17, 5]
    logits, table = run_mixed(tmp_path, model_dir, ["fp32", "bf16"], ids)
    assert "fp32-node  cpu     fp32" in table and "bf16-node  cpu     bf16" in table
    reference = OurModel(model_dir).full_logits(ids)
    # the looser dtype (bf16) sets the tolerance: ~3 significant digits, on logits of this scale
    assert (logits - reference).abs().max().item() < 0.05 * reference.abs().max().item()
    assert not torch.equal(logits, reference)  # the bf16 stage really ran in bf16


@pytest.mark.demo
@pytest.mark.slow
def test_mixed_dtypes_on_the_demo_model(tmp_path, demo_model_dir):
    from tc.model.tokenizer import TextTokenizer

    ids = TextTokenizer.load(demo_model_dir).encode("import numpy as np\n\ndef normalize(v):\n    return v / np.linalg")
    logits, _ = run_mixed(tmp_path, demo_model_dir, ["bf16", "fp32"], ids)
    reference = OurModel(demo_model_dir).full_logits(ids)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"
    assert logits[-1].argmax() == reference[-1].argmax()
    assert (logits - reference).abs().max().item() < 0.05 * reference.abs().max().item()

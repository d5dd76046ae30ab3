"""Parity on accelerators (CUDA, MPS): our model there against our fp32 CPU model, and a mixed cluster.

These skip on a machine without the device; bench/device_check.sh runs them where there is one.
"""
from __future__ import annotations

import sys

import pytest
import torch

from cluster import Process, write_topology
from model_helpers import OurModel
from tc.generation import LocalPipeline
from tc.model.config import Qwen2Config
from tc.model.qwen2 import HeadModel, Stage, resolve_compute_dtype
from tc.model.tokenizer import TextTokenizer
from tc.model.weights import WeightIndex

PROMPT = "import numpy as np\n\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return"


def accelerators() -> list[str]:
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())][:1]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def device_params():
    devices = accelerators()
    if not devices:
        return [pytest.param("none", marks=pytest.mark.skip(reason="no CUDA or MPS device on this machine"))]
    return devices


@pytest.mark.demo
@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_layers_on_the_device_match_the_cpu(demo_model_dir, device, dtype):
    ids = TextTokenizer.load(demo_model_dir).encode(PROMPT)
    reference = OurModel(demo_model_dir).full_logits(ids)
    config = Qwen2Config.from_file(demo_model_dir / "config.json")
    index = WeightIndex.open(demo_model_dir)
    torch_dtype = resolve_compute_dtype(dtype, device)
    head = HeadModel.load(config, index, torch.float32)  # the head stays on the CPU, as in the cluster
    stage = Stage.load(config, index, 0, config.num_hidden_layers, torch_dtype, device)
    pipe = LocalPipeline([stage], device)
    hidden = pipe.prefill(head.embed(torch.tensor([ids])).to(device), capacity=len(ids) + 4)
    logits = head.logits(hidden.to("cpu", torch.float32))[0]
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{device} {dtype} ({torch_dtype}): top-1 agreement {agree:.3f}, "
          f"max abs diff {(logits - reference).abs().max().item():.3f}")
    assert agree >= 0.9 and logits[-1].argmax() == reference[-1].argmax()
    # one decode step through the device's cache
    step = pipe.decode(head.embed(torch.tensor([[int(logits[-1].argmax())]])).to(device), len(ids))
    assert step.shape == (1, 1, config.hidden_size) and torch.isfinite(step.float()).all()


@pytest.mark.demo
@pytest.mark.slow
@pytest.mark.parametrize("device", device_params())
def test_cluster_with_an_accelerator_worker_and_a_cpu_worker(tmp_path, demo_model_dir, device):
    from tc.head.main import start_head
    from tc.topology import load_topology

    nodes = [{"id": "gpu", "device": device, "dtype": "fp16"}, {"id": "cpu", "device": "cpu", "dtype": "bf16"}]
    topology = load_topology(write_topology(tmp_path / "t.yaml", demo_model_dir, nodes, dtype="fp32"))
    head = start_head(topology.with_ports(api_port=0, listen_port=0))
    workers = [Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{head.listen_port}",
                        "--node-id", n["id"], "--device", n["device"]], tmp_path / f"{n['id']}.log") for n in nodes]
    try:
        assert head.registry.wait_ready(600), [w.output() for w in workers]
        tok = head.service.tokenizer
        from tc.sampling import SamplingParams

        result = head.service.complete(tok.encode(PROMPT), SamplingParams(max_tokens=16, temperature=0))
        print(f"cluster {device}(fp16) + cpu(bf16): {result.decode_tokens_per_s:.1f} tok/s: {result.text!r}")
        # our CPU model writes " e / e.sum(axis=..." here in fp32 and in bf16 alike
        assert result.completion_tokens >= 1 and result.text.startswith(" e / e.sum("), result.text
    finally:
        for w in workers:
            w.stop()
        head.stop()

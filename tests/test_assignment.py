"""What ASSIGNMENT carries and what a worker does with it: torch threads from the topology entry, and the checks a
worker makes before it serves (architecture, the tensors of its layers)."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import ROOT, Cluster, Process, write_topology
from tc.head.admission import dtype_fallback
from model_helpers import local_assignment
from tc.model.config import ConfigError, ModelConfig
from tc.model.weights import WeightIndex, WeightsError, layer_tensor_names
from tc.protocol.messages import PROTOCOL_VERSION, DeviceInfo, Hello
from tc.worker.runtime import load_assignment
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


def test_a_real_head_assigns_the_entry_threads_and_warns_of_a_dtype_fallback(tmp_path, model_dir):
    nodes = [{"id": "a", "device": "cpu", "threads": 1}, {"id": "b", "device": "cpu", "threads": 1, "dtype": "fp16"}]
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
        assert wait_for_line(a, r"using (\d+) torch thread, from the topology entry").group(1) == "1"
        wait_for_line(b, r"the topology entry asks for 1 torch thread; keeping --threads 2")
        assert "from the topology entry" not in b.output()
        # a CPU has no native fp16 (the worker computes in fp32): the head says so, for b only
        warnings = re.findall(r"worker (\w+): cpu on .* has no native (\w+)", cluster.head.output())
        assert warnings == [("b", "fp16")], cluster.head.output()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": "abc", "max_tokens": 3,
                                                        "temperature": 0})
        assert status == 200, body


# --- the worker's checks before it serves ---------------------------------------------------------------------




def test_a_matching_assignment_loads(model_dir):
    loaded = load_assignment(local_assignment(model_dir, 1, 3), model_dir, "cpu")
    assert (loaded.stage.start, loaded.stage.end) == (1, 3)


def test_an_architecture_the_worker_does_not_run_is_refused(model_dir):
    config = {**ModelConfig.from_file(model_dir / "config.json").to_dict(), "model_type": "gpt_neox",
              "architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(ConfigError, match=r"architectures=\['GPTNeoXForCausalLM'\]; tc runs Qwen2ForCausalLM, "
                                          r"LlamaForCausalLM, .*MixtralForCausalLM"):
        load_assignment(local_assignment(model_dir, 0, 2, architecture="gpt_neox", config=config), model_dir, "cpu")


def test_an_architecture_that_disagrees_with_the_config_is_refused(model_dir):
    with pytest.raises(ConfigError, match=r"architecture 'llama', and this worker .* reads its config.json as "
                                          r"'qwen2'"):
        load_assignment(local_assignment(model_dir, 0, 2, architecture="llama"), model_dir, "cpu")


def test_a_tensor_count_the_worker_does_not_find_is_refused(model_dir):
    with pytest.raises(WeightsError, match=r"the head planned 25 tensors for layers 0-1 and this worker .* finds 24"):
        load_assignment(local_assignment(model_dir, 0, 2, tensor_count=25), model_dir, "cpu")


def test_layer_tensors_tc_would_skip_are_refused(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", seed=7)
    state = load_file(model_dir / "model.safetensors")
    state["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)  # a Qwen2 variant's weight tc has no place for
    save_file(state, model_dir / "model.safetensors")
    with pytest.raises(WeightsError, match=r"layers 0-1 .* \(model\.layers\.1\.self_attn\.o_proj\.bias\)"):
        load_assignment(local_assignment(model_dir, 0, 2), model_dir, "cpu")
    load_assignment(local_assignment(model_dir, 2, 4), model_dir, "cpu")  # other layers are plain Qwen2


def test_layer_tensors_in_a_shard_left_unread_are_refused_too(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", seed=7, shards=2)  # layers 0-1 in the first shard
    save_file({"model.layers.1.self_attn.q_norm.weight": torch.ones(16)}, model_dir / "extra.safetensors")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.1.self_attn.q_norm.weight"] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    names = layer_tensor_names(ModelConfig.from_file(model_dir / "config.json"), 0, 2)
    assert {info.file.name for info in WeightIndex.open(model_dir, only=names).tensors.values()} == {
        "model-00001-of-00002.safetensors"}  # the worker reads no other shard...
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_assignment(local_assignment(model_dir, 0, 2), model_dir, "cpu")  # ...and still sees what the index lists


# --- the head's view of HELLO's compute dtypes ----------------------------------------------------------------

CPU = DeviceInfo("cpu", "cpu", "x86_64", None, None)
CUDA0 = DeviceInfo("cuda:0", "cuda", "T4", 16 * 2**30, 15 * 2**30)


def hello(selected: str, dtypes: tuple[str, ...]) -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, tc_version="0", node_id=None, hostname="box", platform="linux",
                 python_version="3", torch_version="2", devices=(CUDA0, CPU), selected_device=selected,
                 compute_dtypes=dtypes, max_memory_bytes=None)


@pytest.mark.parametrize("dtype, device, worker, expected", [
    ("bf16", "cpu", hello("cpu", ("bf16", "fp32")), None),
    ("fp16", "cpu", hello("cpu", ("bf16", "fp32")), "cpu on box has no native fp16 (it computes in bf16, fp32)"),
    ("bf16", "cuda:0", hello("cuda:0", ("fp16", "fp32")), "cuda:0 on box has no native bf16"),
    ("bf16", "cuda:0", hello("cuda:0", ("fp16", "bf16", "fp32")), None),
    # HELLO lists the selected device's dtypes; an entry that runs on another device is not judged by them
    ("fp16", "cpu", hello("cuda:0", ("fp16", "bf16", "fp32")), None),
    ("fp16", "cuda:0", hello("cpu", ("bf16", "fp32")), None),
])
def test_a_dtype_the_worker_lacks_is_named(dtype, device, worker, expected):
    got = dtype_fallback(dtype, device, worker)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.startswith(expected) and "nodes[].dtype" in got

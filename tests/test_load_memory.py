"""What a worker's memory peaks at while it loads a quantized stage: its quantized weights, plus at most one linear
layer's worth of 16-bit rows, never a whole layer in 16 bits.

Measured in a fresh process (the worker's own load_assignment) by the kernel's high-water mark of its resident
memory, on a checkpoint whose layers are wide enough (a 134 MB gate_up_proj in bf16, 220 MB a layer) that loading
a whole layer before quantizing it would pass the bound by far more than the allocator's noise.
"""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster import ROOT
from tc.model.config import ModelConfig
from tc.model.weights import expected_shapes
from tiny_model import tiny_config

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")

WIDE = dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=4, torch_dtype="bfloat16")
MARGIN = 32 << 20  # slabs, float temporaries, a linear's codes while they take the kernel's layout, the allocator

# Runs in the child: load layers [0, 2) as a worker does and report the growth of resident memory it caused.
CHILD = """
import json, sys
import torch
sys.path.insert(0, "tests")
from model_helpers import local_assignment
from tc.worker.runtime import load_assignment

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

model_dir, quant = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from here, leaving out what importing torch peaked at
except OSError:
    pass  # then it can only be higher: the bound still holds where the load meets it
before = status("VmRSS")
loaded = load_assignment(local_assignment(model_dir, 0, 2, quant=quant, compute_dtype="bf16"), model_dir, "cpu")
print(json.dumps({"peak_growth": status("VmHWM") - before, "weight_bytes": loaded.weight_bytes}))
"""


def write_wide_checkpoint(path: Path) -> ModelConfig:
    """A bf16 model.safetensors of WIDE's shape, written a tensor at a time from a pool of random values."""
    path.mkdir(parents=True, exist_ok=True)
    config_json = tiny_config(**WIDE)
    config = ModelConfig.from_dict(config_json)
    shapes = expected_shapes(config)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    pool = (torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16().view(torch.int16)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, shape in enumerate(shapes.values()):
            count, start = math.prod(shape), (i * 7919) % len(pool)  # each tensor cut from its own place
            while count:
                take = min(count, len(pool) - start)
                f.write(pool[start:start + take].numpy().tobytes())
                count, start = count - take, 0
    (path / "config.json").write_text(json.dumps(config_json))
    return config


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> tuple[Path, ModelConfig]:
    path = tmp_path_factory.mktemp("wide")
    return path, write_wide_checkpoint(path)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_loading_a_quantized_stage_peaks_at_its_weights_plus_one_linear_layer(wide_model, quant):
    model_dir, config = wide_model
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), quant], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    # the largest linear layer as built: gate_up_proj, [2 * intermediate, hidden], in bf16
    one_linear = 2 * config.intermediate_size * config.hidden_size * 2
    layer = sum(2 * math.prod(s) for n, s in expected_shapes(config).items() if n.startswith("model.layers.0."))
    assert layer > 1.5 * one_linear  # a whole layer in bf16 would not fit the bound
    bound = measured["weight_bytes"] + one_linear + MARGIN
    assert measured["peak_growth"] <= bound, (
        f"loading peaked {measured['peak_growth'] / 1e6:.0f} MB above where it started, over the "
        f"{bound / 1e6:.0f} MB of {measured['weight_bytes'] / 1e6:.0f} MB of {quant} weights, one "
        f"{one_linear / 1e6:.0f} MB linear layer in bf16 and {MARGIN >> 20} MiB")

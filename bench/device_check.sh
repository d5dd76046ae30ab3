#!/usr/bin/env bash
# On a machine with a CUDA GPU (or an Apple Silicon Mac): the accelerator checks in one go, with a short report.
#   parity of our model on the device in fp16 and bf16 against our fp32 CPU model (the demo model),
#   a cluster of a head, one accelerator worker (fp16) and one CPU worker (bf16),
#   and the single-process speed on the device.
# Usage: bash bench/device_check.sh    (after scripts/setup.sh with a torch build for the device)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" scripts/make_demo_model.py > /dev/null || exit 1
echo "== devices"
"$PY" - <<'PYEOF'
import torch
from tc.worker.device import detect_devices, compute_dtypes
for d in detect_devices():
    print(f"{d.id:8s} {d.name:40s} total {d.total_memory} free {d.free_memory} dtypes {compute_dtypes(d.id)}")
print("torch", torch.__version__, "cuda", torch.version.cuda)
PYEOF
echo "== parity and mixed cluster"
"$PY" -m pytest -q -rA -s tests/test_device_parity.py 2>&1 | grep -E "agreement|cluster |passed|failed|skipped|PASSED|FAILED|SKIPPED"
echo "== single-process speed on the device"
"$PY" - <<'PYEOF'
import sys, time, torch
sys.path.insert(0, "tests")
from _demo import demo_model_dir
from tc.local import load_local_generator
from tc.sampling import SamplingParams
device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
for dtype in ("fp16", "bf16"):
    g = load_local_generator(demo_model_dir(), dtype, device)
    ids = g.tokenizer.encode("def quicksort(items):\n")
    g.generate(ids, SamplingParams(max_tokens=4, temperature=0))
    r = g.generate(ids, SamplingParams(max_tokens=64, temperature=0))
    print(f"{device} {dtype}: decode {r.decode_tokens_per_s:.1f} tok/s, first token {r.time_to_first_token_s*1000:.0f} ms")
PYEOF

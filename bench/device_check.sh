#!/usr/bin/env bash
# On a machine with a CUDA GPU or an Apple Silicon Mac: the accelerator checks in one go, in a few minutes, ending
# in one short report to paste (what each part does: bench/device_check.py's docstring).
#   devices and their dtypes; parity of the demo model on each device in fp16, bf16, int8 and int4 against our
#   fp32 CPU model (1- and 512-token prompts, 64 decode steps) with the kernel path each layer took; prefill and
#   decode speed on the device; a head + device worker + CPU worker streaming a chat.
# On a CPU-only machine it lists the devices and says why the rest is skipped (--device cpu runs it on the CPU).
# Usage: bash bench/device_check.sh [--device cuda:1] [--prompt-tokens N] [--steps N] [--no-cluster]
#        (after scripts/setup.sh with a torch build for the device). Exits 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec "$PY" bench/device_check.py "$@"

#!/usr/bin/env bash
# Install what tc and its tests need into the current Python. Idempotent; quick when already installed.
# TORCH_SPEC picks the torch build (default: the CPU build these scripts are tested with).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
"$PY" -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"

#!/usr/bin/env bash
# Install what tc and its tests need into the current Python. Idempotent; quick when already installed.
#
# torch is TORCH_SPEC (default torch==2.13.0), installed from wherever this pip resolves it. Which build that
# is depends on the index: from PyPI on Linux x86-64 it is the CUDA build (several GB with its CUDA
# libraries); an index configured for pip may hold another one. For the CPU-only build, name PyTorch's CPU
# index, which pip then uses (as --index-url) for torch alone:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "setup: no $PY here; install Python 3.10-3.12 with pip, or name one: PYTHON=/path/to/python3" >&2
  exit 1
fi
# A Python the system manages (PEP 668: Debian 12's, Ubuntu 24.04's) refuses pip installs outside a virtual
# environment, unless told to anyway (PIP_BREAK_SYSTEM_PACKAGES, or pip's own configuration): said here with the
# fix, before anything else.
if [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ] && ! "$PY" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(sys.prefix == sys.base_prefix and os.path.exists(marker))' \
   && [ "$("$PY" -m pip config get global.break-system-packages 2>/dev/null)" != "true" ]
then
  echo "setup: $PY is managed by the system (PEP 668) and refuses pip installs; make a virtual environment and" \
       "run from it: python3 -m venv .venv && . .venv/bin/activate (Debian, Ubuntu: apt install python3-venv)" >&2
  exit 1
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
torch_index=()
if [ -n "$TORCH_INDEX_URL" ]; then
  torch_index=(--index-url "$TORCH_INDEX_URL")
fi
# ${a[@]+...}: an empty array under `set -u` is an error in bash before 4.4 (macOS ships 3.2)
# Not quiet: a first install is a download of up to several GB, which would otherwise look like a hang.
echo "setup: $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL} (a first install downloads up to several GB)"
"$PY" -m pip install --progress-bar on --disable-pip-version-check ${torch_index[@]+"${torch_index[@]}"} "$TORCH_SPEC"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"

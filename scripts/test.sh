#!/usr/bin/env bash
# Set up, build the demo models (cached after the first run), and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" scripts/make_demo_model.py
"$PY" scripts/make_demo_model.py --model smollm2
exec "$PY" -m pytest -q "$@"

#!/usr/bin/env bash
# Set up, build the demo model (cached after the first run), and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" scripts/make_demo_model.py
exec "$PY" -m pytest -q "$@"

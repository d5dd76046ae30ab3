#!/usr/bin/env bash
# Bring up a head and two local workers serving a demo model, all from dist/tc.pyz, and show how to query it.
# Ctrl-C stops everything.
#   QUANT=int8 bash scripts/demo.sh     weights in int8 (fp16, int8 or int4; default fp16)
#   DEMO_MODEL=smollm2 bash scripts/demo.sh   SmolLM2-135M-Instruct (Llama) instead of the default
#                                       qwen: Qwen2.5-Coder-0.5B-Instruct (building SmolLM2 needs transformers)
#   API_PORT=8000 LISTEN_PORT=7001      ports (defaults shown)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
QUANT=${QUANT:-fp16}
DEMO_MODEL=${DEMO_MODEL:-qwen}
API_PORT=${API_PORT:-8000}
LISTEN_PORT=${LISTEN_PORT:-7001}

bash scripts/setup.sh
MODEL=$("$PY" scripts/make_demo_model.py --model "$DEMO_MODEL" | tail -n 1)
"$PY" build_zipapp.py
mkdir -p demo
cat > demo/topology.yaml <<YAML
# written by scripts/demo.sh: two workers on this machine, half of the layers each
model: $MODEL
quant: $QUANT
dtype: bf16
head:
  api: 127.0.0.1:$API_PORT
  listen: 127.0.0.1:$LISTEN_PORT
  threads: 2
nodes:
  - id: worker-1
    device: cpu
  - id: worker-2
    device: cpu
YAML

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
"$PY" dist/tc.pyz head demo/topology.yaml > demo/head.log 2>&1 & pids+=($!)
for id in worker-1 worker-2; do
  "$PY" dist/tc.pyz worker --join 127.0.0.1:$LISTEN_PORT --node-id $id --threads 2 > demo/$id.log 2>&1 & pids+=($!)
done
echo "starting: logs in demo/head.log, demo/worker-1.log, demo/worker-2.log"
# Python, not curl: a machine with only Python has no curl. The whole 503 body is read, as a hang-up at the status
# line is logged by the head as a client gone.
ready() {
  "$PY" -c 'import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health/ready", timeout=5) as reply:
        reply.read()
except urllib.error.HTTPError as not_ready:
    not_ready.read()
    sys.exit(1)
except Exception:
    sys.exit(1)' "$API_PORT"
}
for _ in $(seq 1 600); do
  if ready; then break; fi
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a process exited; see demo/*.log"; tail -n 20 demo/*.log; exit 1; }; done
  sleep 0.5
done
ready || { echo "not ready after 5 minutes; see demo/*.log"; exit 1; }
sed -n '/plan:/,/total/p' demo/head.log
cat <<TXT

TrueCluster is serving $(basename "$MODEL") ($QUANT) at http://127.0.0.1:$API_PORT/v1 . Try:

  curl http://127.0.0.1:$API_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$(basename "$MODEL")", "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}], "max_tokens": 128, "temperature": 0}'

or any OpenAI client with base_url="http://127.0.0.1:$API_PORT/v1". Ctrl-C stops the cluster.
TXT
wait

#!/usr/bin/env bash
# Issue 11's serving target in one device call: the bench workload through `fnvllm serve` as concurrent streaming
# requests vs offline `fnvllm bench` on the same random checkpoint; prints one JSON line (offline and served
# tok/s, their ratio, TTFT/TPOT/e2e p50/p90/p99) and checks that SIGTERM stops the server with exit 0.
#
#   bash benchmarks/serve_check.sh                      # H200: Qwen3-0.6B shape, 256 requests (carry .serve_wheels)
#   SERVE_SHAPE=tiny SERVE_REQUESTS=64 SERVE_MAX_INPUT=128 SERVE_MAX_OUTPUT=100 bash benchmarks/serve_check.sh  # CPU
#
# Logs and JSON go to $OUT. SERVE_ENGINE_FLAGS adds "--flag value" pairs to both engines. SERVE_TIMELINE=1 records
# both engines' per-step timelines ($OUT/offline_timeline.jsonl, $OUT/serve_timeline.jsonl). The GPU machine has no
# network: what it lacks of the [serve] extra is unpacked from the wheels in $SERVE_WHEELS (default .serve_wheels,
# git-ignored: carry it) into a temp folder on PYTHONPATH; benchmarks/serve_wheels.py says how to make that folder
# once on a machine with network.
set -euo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/serve_check}; mkdir -p "$OUT"
SHAPE=${SERVE_SHAPE:-qwen3-0.6b}
NUM=${SERVE_REQUESTS:-256}; MAX_IN=${SERVE_MAX_INPUT:-1024}; MAX_OUT=${SERVE_MAX_OUTPUT:-1024}
WORK=$(mktemp -d /tmp/fnvllm-serve-check.XXXXXX)

install_missing_deps() {  # what this python3 lacks of the [serve] extra, from the wheels in $SERVE_WHEELS
  python3 benchmarks/serve_wheels.py "${SERVE_WHEELS:-.serve_wheels}" "$WORK/site" \
    --need fastapi,starlette,pydantic,uvicorn,prometheus_client,httpx
  export PYTHONPATH=$WORK/site:$PYTHONPATH
}

wait_for_server() {  # sets PORT once the server printed its address and /health answers 200
  local deadline=$((SECONDS + ${SERVE_STARTUP_S:-300}))
  PORT=""
  while [ -z "$PORT" ] || ! python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2>/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited early:"; tail -30 "$OUT/serve.log"; exit 1; }
    [ $SECONDS -lt $deadline ] || { echo "server did not start in time:"; tail -30 "$OUT/serve.log"; kill "$SERVER_PID"; exit 1; }
    PORT=$(grep -oE 'listening on http://127\.0\.0\.1:[0-9]+' "$OUT/serve.log" | grep -oE '[0-9]+$' || true)
    sleep 0.5
  done
}

start_server() {  # `fnvllm serve` on a tokenizer-less checkpoint: token-id prompts in, token ids out
  ${SERVE_TIMELINE:+env FNVLLM_TIMELINE=$OUT/serve_timeline.jsonl} python3 -m fnvllm.cli serve "$CKPT" --host 127.0.0.1 --port 0 --served-model-name bench "${ENGINE[@]}" \
    --stream-interval-ms "${SERVE_STREAM_INTERVAL_MS:-0}" > "$OUT/serve.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
}

trap 'rm -rf "$WORK"' EXIT
install_missing_deps
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
CKPT=$WORK/ckpt
python3 -c "import sys, pathlib; from fnvllm.bench import write_checkpoint; write_checkpoint(sys.argv[1], pathlib.Path(sys.argv[2]))" \
  "$SHAPE" "$CKPT" 2>/dev/null
WORKLOAD=(--num-requests "$NUM" --max-input-len "$MAX_IN" --max-output-len "$MAX_OUT")
# The engine options `fnvllm bench` uses (its defaults; max_model_len as run_bench picks it), given to both sides.
MAX_LEN=$(python3 -c "import sys; from fnvllm.model.config import ModelConfig as M
print(min(M.from_pretrained(sys.argv[1]).max_position_embeddings, max(4096, $MAX_IN + $MAX_OUT)))" "$CKPT")
ENGINE=(--block-size 256 --max-num-batched-tokens 16384 --max-num-seqs 512 --max-model-len "$MAX_LEN"
        --gpu-memory-utilization 0.9 ${SERVE_ENGINE_FLAGS:-})

t0=$SECONDS
${SERVE_TIMELINE:+env FNVLLM_TIMELINE=$OUT/offline_timeline.jsonl} python3 -m fnvllm.cli bench --model "$CKPT" "${WORKLOAD[@]}" "${ENGINE[@]}" --json > "$OUT/offline.json" 2> "$OUT/offline.log" \
  || { echo "offline bench failed:"; tail -20 "$OUT/offline.log"; exit 1; }
echo "offline bench: $(( SECONDS - t0 )) s"

t0=$SECONDS
start_server
wait_for_server
echo "server up on port $PORT: $(( SECONDS - t0 )) s"
python3 -m fnvllm.serve.bench --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --json > "$OUT/served.json" 2> "$OUT/client.log" \
  || { echo "load client failed:"; tail -20 "$OUT/client.log"; tail -30 "$OUT/serve.log"; kill "$SERVER_PID"; exit 1; }
python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1]).read().decode())" \
  "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt" || true
kill -TERM "$SERVER_PID"
SERVER_RC=0; wait "$SERVER_PID" || SERVER_RC=$?
echo "served bench: $(( SECONDS - t0 )) s; server exit code after SIGTERM: $SERVER_RC"

python3 - "$OUT/offline.json" "$OUT/served.json" "$SERVER_RC" <<'EOF' | tee "$OUT/serve_check.json"
import json, sys
offline, served = (json.load(open(p)) for p in sys.argv[1:3])
print(json.dumps({
    "device": offline["device"], "backend": offline["backend"], "requests": served["requests"],
    "offline_tok_per_s": offline["tok_per_s"], "served_tok_per_s": served["tok_per_s"],
    "ratio": round(served["tok_per_s"] / offline["tok_per_s"], 3),
    "offline_tokens": offline["output_tokens"], "served_tokens": served["output_tokens"],
    "ttft_ms": served["ttft_ms"], "tpot_ms": served["tpot_ms"], "e2e_ms": served["e2e_ms"],
    "server_exit_code": int(sys.argv[3]),
}))
EOF
[ "$SERVER_RC" = 0 ]

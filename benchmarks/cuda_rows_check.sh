#!/usr/bin/env bash
# One device call on the H200 for cuda_skinny's tile kernels (fnvllm/kernels/cuda_skinny.py), in parts (ONLY):
#   tests    its GPU tests (every kernel eager and in a CUDA graph, the dispatchers);
#   kernels  every kernel variant checked and timed against the path without it (benchmarks/bench_cuda_skinny.py
#            kernels at ROWS), which proposes entries;
#   step     the whole decode step with the proposed entries (or ENTRIES) against the table as shipped, alternated
#            ROUNDS times, at the requests in LATENCY (default: the entries' tiles, 16, 32 and/or 64);
#   trigger  the small kernels triggering first at 2-64 rows against the shipped 17-64, alternated, at the
#            requests in TRIGGER_LATENCY (not in the default ONLY: about 3 minutes more).
# Logs go to $OUT; each part prints its summary (the step parts: ms per step, device and host ms per step).
#   ONLY="tests kernels step"  ROWS=16,32,64  LATENCY=(from the entries)  ROUNDS=2  TRIGGER_LATENCY=2,8,16
#   CK=/tmp/ck06 (written when missing)
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ONLY=${ONLY:-tests kernels step}; ROWS=${ROWS:-16,32,64}; LATENCY=${LATENCY:-}; ROUNDS=${ROUNDS:-2}
TRIGGER_LATENCY=${TRIGGER_LATENCY:-2,8,16}; CK=${CK:-/tmp/ck06}
want() { [[ " $ONLY " == *" $1 "* ]]; }
# which card: a call may get an H100 or an H200, and only numbers from one card compare
echo "GPU: $(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>&1 | tail -1)"

summary() { python3 benchmarks/step_summary.py "$OUT" "$@"; }  # the latency rows of the named runs' JSON reports

run_step() {  # $1: log name, $2: requests, then bench_cuda_skinny.py run options
  local name=$1 requests=$2; shift 2
  timeout 150 python3 benchmarks/bench_cuda_skinny.py run "$@" bench --model "$CK" --model-shape qwen3-0.6b \
    --latency "$requests" --profile --json > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}

if want tests; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_skinny.py > "$OUT/tests.log" 2>&1
  echo "cuda_skinny GPU tests rc=$?"; tail -1 "$OUT/tests.log"
fi
ENTRIES=${ENTRIES:-}
if want kernels && [ -z "$ENTRIES" ]; then
  timeout 200 python3 benchmarks/bench_cuda_skinny.py kernels --rows "$ROWS" > "$OUT/kernels.log" 2>&1
  echo "kernel bench rc=$?"; cat "$OUT/kernels.log"
  ENTRIES=$(sed -n 's/^proposed --entries //p' "$OUT/kernels.log")
  [ "$ENTRIES" = "(none)" ] && ENTRIES=""
fi
if want step || want trigger; then
  [ -d "$CK" ] || python3 -c "from pathlib import Path; from fnvllm.bench import write_checkpoint
write_checkpoint('qwen3-0.6b', Path('$CK'))"
fi
if want step; then
  echo "entries: ${ENTRIES:-(none): no step runs}"
  # the requests whose decode steps the entries touch: their tiles (gate_up=4x1@64 -> 64)
  LATENCY=${LATENCY:-$(echo "$ENTRIES" | tr ',' '\n' | sed -n 's/.*@//p' | sort -n -u | paste -sd, -)}
  if [ -n "$ENTRIES" ]; then
    echo "requests: $LATENCY"
    run_step warmup "$LATENCY" --entries "$ENTRIES"  # Triton's and NVRTC's caches
    names=()
    for r in $(seq "$ROUNDS"); do
      run_step "with_$r" "$LATENCY" --entries "$ENTRIES"
      run_step "without_$r" "$LATENCY" --entries ""
      names+=("with_$r" "without_$r")
    done
    summary "${names[@]}"
  fi
fi
if want trigger; then
  run_step trigger_warmup "$TRIGGER_LATENCY" --entries ""
  names=()
  for r in $(seq "$ROUNDS"); do
    run_step "trigger2_$r" "$TRIGGER_LATENCY" --entries "" --early-trigger-rows 2-64
    run_step "trigger17_$r" "$TRIGGER_LATENCY" --entries ""
    names+=("trigger2_$r" "trigger17_$r")
  done
  summary "${names[@]}"
fi

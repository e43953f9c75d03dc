#!/usr/bin/env bash
# One device call on the H200 for cuda_skinny's tile kernels (fnvllm/kernels/cuda_skinny.py): its GPU tests, every
# kernel variant checked and timed against the path without it (benchmarks/bench_cuda_skinny.py kernels), then the
# whole decode step with the proposed entries against without them, alternated, at the requests in LATENCY.
# Logs go to $OUT; the device ms per step of each run prints last. About 8 minutes on a fresh machine.
#   ROWS=16,32,64 (the kernel bench's rows)  LATENCY=32,64 (the step's requests)  ROUNDS=2
#   ENTRIES="gate_up=4x1@64,..." skips the kernel bench's proposal and measures these entries instead.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROWS=${ROWS:-16,32,64}; LATENCY=${LATENCY:-32,64}; ROUNDS=${ROUNDS:-2}
CK=${CK:-/tmp/ck06}
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_skinny.py > "$OUT/tests.log" 2>&1
echo "cuda_skinny GPU tests rc=$?"; tail -1 "$OUT/tests.log"
if [ -z "${ENTRIES:-}" ]; then
  timeout 200 python3 benchmarks/bench_cuda_skinny.py kernels --rows "$ROWS" > "$OUT/kernels.log" 2>&1
  echo "kernel bench rc=$?"; cat "$OUT/kernels.log"
  ENTRIES=$(sed -n 's/^proposed --entries //p' "$OUT/kernels.log")
  [ "$ENTRIES" = "(none)" ] && ENTRIES=""
fi
echo "entries: ${ENTRIES:-(none)}"
[ -z "$ENTRIES" ] && exit 0
[ -d "$CK" ] || python3 -c "from pathlib import Path; from fnvllm.bench import write_checkpoint; write_checkpoint('qwen3-0.6b', Path('$CK'))"
run_step() {  # $1: log name, $2: entries ("" for the table as shipped)
  timeout 150 python3 benchmarks/bench_cuda_skinny.py run --entries "$2" bench --model "$CK" \
    --model-shape qwen3-0.6b --latency "$LATENCY" --profile --json > "$OUT/$1.log" 2>&1
  echo "$1 rc=$?"
}
run_step warmup "$ENTRIES"  # Triton's and NVRTC's caches
for r in $(seq "$ROUNDS"); do
  run_step "with_$r" "$ENTRIES"
  run_step "without_$r" ""
done
python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("run          requests  ms/step  device ms/step  host ms/step")
for r in range(1, rounds + 1):
    for name in (f"with_{r}", f"without_{r}"):
        try:
            report = json.loads(open(f"{out}/{name}.log").read().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError) as e:
            print(f"{name:12s} no report ({type(e).__name__})")
            continue
        for row in report.get("latency", []):
            timeline = row.get("decode_timeline") or {}
            print(f"{name:12s} {row['requests']:8d}  {row['ms_per_step']:7.3f}  {timeline.get('mean_step_ms')!s:>14}  "
                  f"{timeline.get('mean_cpu_ms')!s:>12}")
EOF

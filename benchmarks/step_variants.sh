#!/usr/bin/env bash
# One device call: whole-decode-step variants (benchmarks/probe_step_variants.py) against base, alternated.
#   VARIANTS="base no_norms"  LATENCY=32,64  ROUNDS=2  CK=/tmp/ck06 (written when missing)  WARM=1 (one untimed run first)
# Logs go to $OUT (VARIANT_ROUND.log); the summary prints ms per step, device and host ms per step of each run.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-base no_norms}; LATENCY=${LATENCY:-32,64}; ROUNDS=${ROUNDS:-2}; CK=${CK:-/tmp/ck06}
echo "GPU: $(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>&1 | tail -1)"
[ -d "$CK" ] || python3 -c "from pathlib import Path; from fnvllm.bench import write_checkpoint
write_checkpoint('qwen3-0.6b', Path('$CK'))" > "$OUT/checkpoint.log" 2>&1
run() {  # $1 log name, $2 variant
  timeout 170 python3 benchmarks/probe_step_variants.py "$2" bench --model "$CK" --model-shape qwen3-0.6b \
    --latency "$LATENCY" --profile --json > "$OUT/$1.log" 2>&1
  echo "$1 rc=$?"
}
[ "${WARM:-1}" = 1 ] && run warmup base  # Triton's and NVRTC's caches
names=()
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do run "${v}_$r" "$v"; names+=("${v}_$r"); done
done
python3 - "$OUT" "${names[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
print("run                       requests  ms/step  device ms/step  host ms/step")
for name in names:
    try:
        report = json.loads(open(f"{out}/{name}.log").read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as e:
        print(f"{name:25s} no report ({type(e).__name__})")
        continue
    for row in report.get("latency", []):
        t = row.get("decode_timeline") or {}
        print(f"{name:25s} {row['requests']:8d}  {row['ms_per_step']:7.3f}  {t.get('mean_gpu_ms')!s:>14}  {t.get('mean_cpu_ms')!s:>12}")
PY

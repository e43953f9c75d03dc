#!/usr/bin/env bash
# One device call: whole-decode-step variants (benchmarks/probe_step_variants.py) against base, alternated.
#   VARIANTS="base no_norms"  SHAPE=qwen3-0.6b  LATENCY=32,64  ROUNDS=2  CK=/tmp/ck06 (written when missing)  WARM=1 (one untimed run first)
#   CONFIRM=0: after the rounds, the (up to) CONFIRM variants whose device ms per step beat base's mean by 1 % at
#   some batch run once more, each beside base (a second look at a first-round winner in the same call).
# Logs go to $OUT (VARIANT_ROUND.log); the summary prints ms per step, device and host ms per step of each run.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-base no_norms}; LATENCY=${LATENCY:-32,64}; ROUNDS=${ROUNDS:-2}; CK=${CK:-/tmp/ck06}
echo "GPU: $(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>&1 | tail -1)"
[ -d "$CK" ] || python3 -c "from pathlib import Path; from fnvllm.bench import write_checkpoint
write_checkpoint('${SHAPE:-qwen3-0.6b}', Path('$CK'))" > "$OUT/checkpoint.log" 2>&1
SHAPE=${SHAPE:-qwen3-0.6b}
safe() { printf '%s' "$1" | tr -c 'A-Za-z0-9_' '-'; }  # a variant as a file name
run() {  # $1 log name, $2 variant
  printf '%s\t%s\n' "$(safe "$1" | sed 's/_[^_]*$//')" "$2" >> "$OUT/variants.tsv"
  timeout 170 python3 benchmarks/probe_step_variants.py "$2" bench --model "$CK" --model-shape "$SHAPE" \
    --latency "$LATENCY" --profile --json > "$OUT/$(safe "$1").log" 2>&1
  echo "$1 rc=$?"
}
[ "${WARM:-1}" = 1 ] && run warmup base  # Triton's and NVRTC's caches
names=()
for r in $(seq "$ROUNDS"); do
  i=0
  for v in $VARIANTS; do  # (a variant listed twice, base say, gets two logs)
    i=$((i + 1)); run "${v}_${r}-$i" "$v"; names+=("$(safe "${v}_${r}-$i")")
  done
done
report() {  # $1: python code run over the named runs' (name, requests, device ms) rows
  python3 - "$OUT" "$1" "${names[@]}" <<'PY'
import json, sys
out, code, names = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
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
        ms = t.get("mean_gpu_ms", t.get("mean_step_ms"))  # (the CPU's timeline has no device time)
        if ms is not None:
            rows.append((name.rsplit("_", 1)[0], row["requests"], ms))
exec(code)
PY
}
# the winners: variants beating base's mean device ms by 1 % at some batch, best first
PICK='base = {}
for v, n, ms in rows:
    if v == "base": base.setdefault(n, []).append(ms)
gain = {}
for v, n, ms in rows:
    if v != "base" and n in base:
        gain[v] = max(gain.get(v, 0.0), 1 - ms / (sum(base[n]) / len(base[n])))
variant = dict(line.rstrip("\n").split("\t") for line in open(f"{out}/variants.tsv"))
with open(f"{out}/winners.txt", "w") as f:
    f.write(" ".join(variant[v] for v, g in sorted(gain.items(), key=lambda kv: -kv[1]) if g > 0.01))'
report "$PICK" > "$OUT/round_summary.txt"; cat "$OUT/round_summary.txt"
CONFIRM=${CONFIRM:-0}
if [ "$CONFIRM" -gt 0 ]; then
  winners=$(tr ' ' '\n' < "$OUT/winners.txt" | head -n "$CONFIRM")
  echo "confirming: ${winners:-(none)}"
  names=()
  for v in $winners; do
    run "${v}_c" "$v"; run "base_c${#names[@]}" base; names+=("$(safe "${v}_c")" "base_c${#names[@]}")
  done
  [ ${#names[@]} -gt 0 ] && report "pass"
fi

#!/usr/bin/env bash
# One device call: whole-decode-step variants (benchmarks/probe_step_variants.py) against base, alternated.
#   VARIANTS="base no_norms"  SHAPE=qwen3-0.6b  LATENCY=32,64  ROUNDS=2  CK=/tmp/ck06 (written when missing)  WARM=1 (one untimed run first)
#   CHECK=1: first tests/test_probe_variants.py (each launch-shape variant against its reference).
#   CONFIRM=0: after the rounds, the (up to) CONFIRM variants whose device ms per step beat base's mean by 1 % at
#   some batch run once more, each beside base (a second look at a first-round winner in the same call).
# Logs go to $OUT (VARIANT_ROUND.log); the summary prints ms per step, device and host ms per step of each run.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-base no_norms}; LATENCY=${LATENCY:-32,64}; ROUNDS=${ROUNDS:-2}; CK=${CK:-/tmp/ck06}
SHAPE=${SHAPE:-qwen3-0.6b}
echo "GPU: $(python3 -c 'import torch; print(torch.cuda.get_device_name())' 2>&1 | tail -1)"
[ -d "$CK" ] || python3 -c "from pathlib import Path; from fnvllm.bench import write_checkpoint
write_checkpoint('$SHAPE', Path('$CK'))" > "$OUT/checkpoint.log" 2>&1
safe() { printf '%s' "$1" | tr -c 'A-Za-z0-9_' '-'; }  # a variant as a file name
run() {  # $1 log name, $2 variant
  printf '%s\t%s\n' "$(safe "$1" | sed 's/_[^_]*$//')" "$2" >> "$OUT/variants.tsv"
  timeout 170 python3 benchmarks/probe_step_variants.py "$2" bench --model "$CK" --model-shape "$SHAPE" \
    --latency "$LATENCY" --profile --json > "$OUT/$(safe "$1").log" 2>&1
  echo "$1 rc=$?"
}
if [ "${CHECK:-1}" = 1 ]; then  # the variants' launch shapes against their references, at real shapes on a GPU
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_probe_variants.py > "$OUT/variant_tests.log" 2>&1
  echo "variant tests rc=$?: $(tail -1 "$OUT/variant_tests.log")"
fi
[ "${WARM:-1}" = 1 ] && run warmup base  # Triton's and NVRTC's caches
names=()
for r in $(seq "$ROUNDS"); do
  i=0
  for v in $VARIANTS; do  # (a variant listed twice, base say, gets two logs)
    i=$((i + 1)); run "${v}_${r}-$i" "$v"; names+=("$(safe "${v}_${r}-$i")")
  done
done
# every run's latency rows, and the winners: variants beating base's mean device ms by 1 % at some batch, best first
python3 benchmarks/step_summary.py "$OUT" "${names[@]}" --winners "$OUT/winners.txt" --variants "$OUT/variants.tsv" \
  > "$OUT/round_summary.txt"
cat "$OUT/round_summary.txt"
CONFIRM=${CONFIRM:-0}
if [ "$CONFIRM" -gt 0 ]; then
  winners=$(tr ' ' '\n' < "$OUT/winners.txt" | head -n "$CONFIRM")
  echo "confirming: ${winners:-(none)}"
  names=()
  for v in $winners; do
    run "${v}_c" "$v"; run "base_c${#names[@]}" base; names+=("$(safe "${v}_c")" "base_c${#names[@]}")
  done
  [ ${#names[@]} -gt 0 ] && python3 benchmarks/step_summary.py "$OUT" "${names[@]}"
fi

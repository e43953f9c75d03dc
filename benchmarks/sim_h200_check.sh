#!/usr/bin/env bash
# Timelines for the simulator's accuracy target: the real engine on two different workloads, each with
# FNVLLM_TIMELINE set, so a profile fitted on one can predict the other (benchmarks/sim_accuracy.py).
#
#   A: 768 bench-style requests, prompts U(100, 1536), outputs U(100, 768), all at t=0 with max_num_seqs 512:
#      full-budget prefill steps, then continuous batching (a finished request's slot is refilled, so decodes of
#      ~511 sequences share eager steps with new prompt chunks), then a decode tail from ~512 sequences down to 1.
#   B: the bench itself (256 requests, prompts U(100, 1024), outputs U(100, 1024)): what the target predicts.
#
# Per run, $OUT gets RUN.jsonl (the timeline: warm-up steps, then the timed run), RUN.json (the bench record:
# measured seconds, steps, num_blocks) and RUN.flags (the bench flags, which sim_accuracy.py parses with the
# bench's own parser). Then the accuracy report runs here too ($OUT/accuracy.txt); rerun it anywhere with
#   python benchmarks/sim_accuracy.py $OUT
# Env: SHAPE (default qwen3-0.6b; "tiny" for a CPU dry run), A_FLAGS / B_FLAGS (override the workloads),
# ONLY ("calibration" or "accuracy": run one part; default both, calibration first).
#
# Part "calibration": benchmarks/sim_calibration.py runs the calibration set (1 to 512 requests, decode- and
# prefill-heavy, the bench; each with and without overlapped steps) on one engine, fits $OUT/calibration/profile.json
# and prints the error per regime (fitted, held out, built-in h200). About 2-3 minutes on an H200:
#   ONLY=calibration bash benchmarks/sim_h200_check.sh
#
# Part "serve": benchmarks/sim_serve_check.py serves a Poisson load with `fnvllm serve` and simulates the same
# requests, printing measured vs simulated TTFT/TPOT p50/p90 (with $OUT/calibration/profile.json when the
# calibration part ran, else the built-in h200). It needs the [serve] extra (see serve_check.sh for the wheels).
# After it, when the calibration part ran, the CPU refit of both (sim_calibration.py --refit --served) writes the
# profile to ship, with its serving section, to $OUT/calibration/profile.json and h200_profile.py.txt:
#   ONLY=serve bash benchmarks/sim_h200_check.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPE=${SHAPE:-qwen3-0.6b}
A_FLAGS=${A_FLAGS:---num-requests 768 --max-input-len 1536 --max-output-len 768}
B_FLAGS=${B_FLAGS:-}
ONLY=${ONLY:-}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
if [[ -z $ONLY || $ONLY == calibration ]]; then
    quick=""; [[ $SHAPE == tiny ]] && quick="--quick"
    start=$(date +%s)
    # shellcheck disable=SC2086  # $quick is one optional word
    python3 benchmarks/sim_calibration.py --out "$OUT/calibration" --model-shape "$SHAPE" $quick 2>&1 \
        | tee "$OUT/calibration.txt"
    echo "calibration: rc=${PIPESTATUS[0]}, $(( $(date +%s) - start )) s"
fi
if [[ $ONLY == serve ]]; then
    profile=h200; [[ -f $OUT/calibration/profile.json ]] && profile=$OUT/calibration/profile.json
    quick=""; [[ $SHAPE == tiny ]] && quick="--quick"
    # shellcheck disable=SC2086  # $quick is one optional word
    python3 benchmarks/sim_serve_check.py --model-shape "$SHAPE" --hardware "$profile" --out "$OUT/serve" $quick 2>&1 \
        | tee "$OUT/sim_serve.txt"
    rc=${PIPESTATUS[0]}
    if [[ $rc == 0 && -f $OUT/calibration/profile.json ]]; then  # the profile to ship: offline fit + serving section
        python3 benchmarks/sim_calibration.py --out "$OUT/calibration" --refit --served "$OUT/serve" $quick 2>&1 \
            | tee "$OUT/sim_refit.txt"
        rc=${PIPESTATUS[0]}
    fi
    exit "$rc"
fi
[[ -n $ONLY && $ONLY != accuracy ]] && exit 0
for run in A B; do
    flags_var=${run}_FLAGS; flags=${!flags_var}
    echo "--model-shape $SHAPE $flags" > "$OUT/$run.flags"
    start=$(date +%s)
    # shellcheck disable=SC2086  # the flags are words
    FNVLLM_TIMELINE=$OUT/$run.jsonl python3 -m fnvllm.cli bench --json $(cat "$OUT/$run.flags") \
        2> "$OUT/$run.log" | tail -1 > "$OUT/$run.json"
    rc=${PIPESTATUS[0]}
    echo "run $run (bench $flags): rc=$rc, $(( $(date +%s) - start )) s incl. start-up"
    cat "$OUT/$run.json"; tail -3 "$OUT/$run.log"
done
python3 benchmarks/sim_accuracy.py "$OUT" --out-dir "$OUT" 2>&1 | tee "$OUT/accuracy.txt"

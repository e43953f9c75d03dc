#!/usr/bin/env bash
# One device call on the H200: kernels vs references and their timings, end-to-end backend agreement, the CUDA
# path of the model/LLM tests, a decode-step profile, then the throughput bench (triton, and flash when
# flash-attn-4 imports). Logs go to $OUT; a short table prints last.
#   ONLY="kernels attention equality pytest profile bench plain bench8b calibration"  (default: all but plain and
#   bench8b) picks the parts: plain = the bench with --no-overlap (one step at a time), bench8b = the Qwen3-8B shape,
#   calibration = the simulator's calibration set (benchmarks/sim_calibration.py): refits the h200 profile to this
#   engine and prints each regime's error; paste $OUT/calibration/h200_profile.py.txt into fnvllm/sim/hardware.py
#   and its table into BENCHMARKS.md whenever the engine's speed changed.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ONLY=${ONLY:-kernels attention equality pytest profile bench calibration}
want() { [[ " $ONLY " == *" $1 "* ]]; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import flash_attn.cute; print('flash-attn-4 importable')" 2>/dev/null || echo "flash-attn-4 not importable"
if want kernels; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -m gpu > "$OUT/kernels.log" 2>&1
  echo "gpu kernel tests rc=$?"; tail -2 "$OUT/kernels.log"
fi
if want attention; then
  timeout 300 python3 benchmarks/bench_attention.py --budget-s ${ATTN_BUDGET:-60} --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1
  echo "bench_attention rc=$?"; tail -28 "$OUT/attention.log"
fi
if want equality; then
  timeout 300 python3 benchmarks/gpu_equality.py --json "$OUT/equality.json" 2>&1 | tee "$OUT/equality.log" | grep -v Loading
fi
if want pytest; then
  timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_llm_equality.py tests/test_llm_api.py tests/test_engine_loop.py tests/test_model.py tests/test_sampler.py tests/test_overlap_executor.py > "$OUT/pytest_gpu.log" 2>&1
  echo "CUDA pytest rc=$?"; tail -2 "$OUT/pytest_gpu.log"
fi
if want profile; then
  timeout 240 python3 benchmarks/profile_decode.py --trace "$OUT/decode_trace.json" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; grep -v "^ \{20,\}" "$OUT/profile.log" | head -48 | cut -c1-160
fi
if want bench; then
  FNVLLM_TIMELINE=$OUT/timeline.jsonl timeout 240 python3 -m fnvllm.cli bench --model-shape qwen3-0.6b --json ${BENCH_FLAGS:-} 2>/dev/null | tail -1 | tee "$OUT/bench.json"
  if want plain; then
    FNVLLM_TIMELINE=$OUT/timeline_plain.jsonl timeout 240 python3 -m fnvllm.cli bench --model-shape qwen3-0.6b --no-overlap --json 2>/dev/null | tail -1 | tee "$OUT/bench_plain.json"
  fi
  if python3 -c "import flash_attn.cute" 2>/dev/null; then
    timeout 240 python3 -m fnvllm.cli bench --model-shape qwen3-0.6b --backend flash --json 2>/dev/null | tail -1 | tee "$OUT/bench_flash.json"
  fi
fi
if want bench8b; then
  timeout 300 python3 -m fnvllm.cli bench --model-shape qwen3-8b --json 2>/dev/null | tail -1 | tee "$OUT/bench8b.json"
fi
if want calibration; then
  timeout 360 python3 benchmarks/sim_calibration.py --out "$OUT/calibration" --model-shape qwen3-0.6b > "$OUT/calibration.log" 2>&1
  echo "calibration rc=$?"; grep -A40 "^regime" "$OUT/calibration.log" | cut -c1-160
fi

#!/usr/bin/env bash
# One device call on the H200: kernels vs references and their timings, end-to-end backend agreement, the CUDA
# path of the model/LLM tests, then the throughput bench. Logs go to $OUT; a short table prints last.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -m gpu > "$OUT/kernels.log" 2>&1; echo "gpu kernel tests rc=$?"; tail -2 "$OUT/kernels.log"
python3 benchmarks/bench_attention.py --budget-s ${ATTN_BUDGET:-90} --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1; echo "bench_attention rc=$?"; tail -25 "$OUT/attention.log"
python3 benchmarks/gpu_equality.py --json "$OUT/equality.json" 2>&1 | tee "$OUT/equality.log" | grep -v Loading
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_llm_equality.py tests/test_llm_api.py tests/test_engine_loop.py tests/test_model.py tests/test_sampler.py > "$OUT/pytest_gpu.log" 2>&1; echo "CUDA pytest rc=$?"; tail -2 "$OUT/pytest_gpu.log"
FNVLLM_TIMELINE=$OUT/timeline.jsonl python3 -m fnvllm.cli bench --model-shape qwen3-0.6b --json ${BENCH_FLAGS:-} 2>/dev/null | tail -1 | tee "$OUT/bench.json"

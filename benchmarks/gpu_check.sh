#!/usr/bin/env bash
# One device call: the model/LLM test files on the GPU (fp32 equality with transformers through the CUDA path),
# the demo, and a first end-to-end throughput number with the torch reference attention. Writes logs to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -m pytest tests/test_llm_equality.py tests/test_llm_api.py tests/test_model.py tests/test_sampler.py -q -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest_gpu.log"
python3 -m fnvllm.cli demo --device cuda 2>/dev/null | tail -2
python3 benchmarks/bench_llm.py --model-shape qwen3-0.6b --num-requests ${BENCH_REQUESTS:-64} --json 2>/dev/null | tail -1 | tee "$OUT/bench_llm.json"

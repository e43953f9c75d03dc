"""End-to-end throughput on the nano-vllm workload: a thin wrapper over ``fnvllm bench`` (same flags).

python benchmarks/bench_llm.py --model-shape qwen3-0.6b --num-requests 256
python benchmarks/bench_llm.py --model-shape tiny --num-requests 8 --max-input-len 128 --max-output-len 100
"""

from __future__ import annotations

import sys

from fnvllm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

"""End-to-end throughput of ``LLM.generate`` on the nano-vllm-style workload with random real-shape weights.

    python benchmarks/bench_llm.py --model-shape qwen3-0.6b --num-requests 256
    python benchmarks/bench_llm.py --model-shape tiny --num-requests 8 --max-input-len 128 --max-output-len 100

Writes a random-weight checkpoint of the shape (no hub access needed; throughput does not depend on weight
values with ignore_eos), runs the workload once to warm up on a few requests, then times the full run and prints
output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_workload


def write_checkpoint(shape: str, folder: Path) -> Path:
    """A random checkpoint of ``shape`` ("tiny", "qwen3-0.6b", "qwen3-8b") in ``folder``."""
    from fnvllm.testing.checkpoints import write_random_checkpoint, write_tiny_checkpoint

    if shape == "tiny":
        return write_tiny_checkpoint(folder, "qwen3", vocab_size=10240, hidden_size=128, num_layers=2)
    return write_random_checkpoint(folder, shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-0.6b", choices=["tiny", "qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()

    from fnvllm.llm import LLM

    folder = write_checkpoint(args.model_shape, Path(tempfile.mkdtemp(prefix="fnvllm-bench-")))
    llm = LLM(
        folder,
        load_tokenizer=False,
        block_size=args.block_size,
        attention_backend=args.attention_backend,
        max_num_batched_tokens=16384,
        max_num_seqs=512,
    )
    prompts, params = bench_workload(args.num_requests, args.max_input_len, args.max_output_len)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    result = {
        "model_shape": args.model_shape,
        "device": str(llm.executor.device),
        "backend": llm.executor.backend,
        "num_blocks": llm.executor.num_blocks,
        "requests": args.num_requests,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tok_per_s": round(tokens / seconds, 1),
        "steps": llm.stats.num_steps,
        "preemptions": llm.stats.num_preemptions,
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k:>18}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()

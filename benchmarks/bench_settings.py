"""Throughput under the sampling settings users send, and decode-step latency at small batches, in one process.

The bench workload (``fnvllm.workloads.bench_workload``) is generated once per sampling variant with one warm
``LLM`` (the checkpoint is written once to ``--checkpoint`` and reused by later runs, e.g. of another commit's
code with ``PYTHONPATH=that/tree``). Then the latency runs: N requests with prompts of 100-128 tokens and 256
output tokens each, warm (run once untimed), reported as milliseconds per decode step (wall / output tokens per
request). Uses only the public API, so it runs against older trees too.

    PYTHONPATH=$PWD python3 benchmarks/bench_settings.py --label head --json $OUT/settings_head.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import attrs

from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

try:
    from fnvllm.bench import write_checkpoint
except ImportError:  # a tree older than the module's rename (fnvllm.benchmark), measured for comparison
    from fnvllm.benchmark import write_checkpoint  # type: ignore[import-not-found,no-redef]
try:
    from fnvllm.workloads import bench_workload
except ImportError:  # a tree older than fnvllm.workloads, measured for comparison
    from fnvllm.benchmark import bench_workload  # type: ignore[attr-defined,no-redef]

VARIANTS: dict[str, dict[str, Any]] = {
    "temperature": {},
    "top_p_top_k": {"top_p": 0.95, "top_k": 20},
    "repetition": {"top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05},
    "min_p": {"min_p": 0.05},
    "logprobs": {"logprobs": 5},
}


def throughput(llm: LLM, extra: dict[str, Any], num_requests: int) -> float:
    """Output tok/s of the bench workload with ``extra`` added to every request's sampling params."""
    prompts, params = bench_workload(num_requests)
    params = [attrs.evolve(p, **extra) for p in params]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds


def step_ms(llm: LLM, batch: int, output_len: int = 256) -> float:
    """Milliseconds per decode step with ``batch`` requests (warm: the same run once untimed)."""
    rng = random.Random(batch)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 128))] for _ in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3 / output_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="head")
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--checkpoint", default="/tmp/fnvllm-settings-ckpt")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--json", default=None, help="append one JSON line per result here")
    args = parser.parse_args()
    folder = Path(args.checkpoint)
    if not (folder / "config.json").exists():
        write_checkpoint(args.model_shape, folder)
    llm = LLM(folder, load_tokenizer=False, max_model_len=2048)
    prompts, params = bench_workload(4)  # warm-up: graphs, kernels, allocator
    llm.generate(prompts, params, use_tqdm=False)
    results = []
    for name in filter(None, args.variants.split(",")):
        results.append(
            {"label": args.label, "what": name, "tok_s": round(throughput(llm, VARIANTS[name], args.num_requests))}
        )
        print(json.dumps(results[-1]), flush=True)
    for batch in map(int, filter(None, args.batches.split(","))):
        results.append({"label": args.label, "what": f"step_ms_{batch}", "ms": round(step_ms(llm, batch), 3)})
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    main()

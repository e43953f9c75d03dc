"""CPU threads against model size: output tok/s of small models at 1 and N torch threads, measured in one process.

    python benchmarks/cpu_threads.py                      # demo, tiny and two larger random shapes
    python benchmarks/cpu_threads.py --models demo tiny --repeats 3 --json
    python benchmarks/cpu_threads.py --busy 1              # with one spinning process beside it (another job)

For each model the same greedy workload (the demo's prompts for the demo model, random token ids otherwise) runs
at every thread count in turn, ``--repeats`` times, alternating, so machine load hits every count alike; the
table gives the best tok/s of each count and the ratio to one thread. ``fnvllm.executor.threads`` picks the count
for a model from these ratios (one thread below ``SMALL_MODEL_PARAMS`` matmul parameters).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fnvllm.executor.threads import SMALL_MODEL_PARAMS, matmul_params
from fnvllm.state import SamplingParams

# name -> write_tiny_checkpoint keywords (None: the embedded demo model). "tiny" is fnvllm bench's tiny shape.
SHAPES: dict[str, dict[str, Any] | None] = {
    "demo": None,
    "tiny": {"vocab_size": 10240, "hidden_size": 128, "num_layers": 2},
    "small": {"vocab_size": 10240, "hidden_size": 512, "num_layers": 6, "intermediate_size": 1536},
    "medium": {"vocab_size": 16384, "hidden_size": 768, "num_layers": 8, "intermediate_size": 2304},
}


def model_folder(name: str, root: Path) -> Path:
    """The checkpoint folder of ``name``: the embedded demo model, or a random checkpoint written under root."""
    from fnvllm.demo import model_path
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    shape = SHAPES[name]
    if shape is None:
        return model_path()
    heads = {"num_heads": max(4, shape["hidden_size"] // 64), "num_kv_heads": 2}
    return write_tiny_checkpoint(root / name, "qwen3", **heads, **shape)


def workload(name: str, num_prompts: int, max_tokens: int) -> tuple[list[Any], SamplingParams]:
    """The prompts and greedy sampling params of one timed run."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if name == "demo":
        from fnvllm.cli.demo import DEMO_PROMPTS

        return [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(num_prompts)], params
    return [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(num_prompts)], params


def measure(name: str, folder: Path, counts: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Best tok/s of the workload at each thread count, runs alternating between counts."""
    from fnvllm.llm import LLM

    llm = LLM(folder, load_tokenizer=name == "demo", device="cpu", num_blocks=256, block_size=16)
    prompts, params = workload(name, args.num_prompts, args.max_tokens)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    best = dict.fromkeys(counts, 0.0)
    for _ in range(args.repeats):
        for threads in counts:
            torch.set_num_threads(threads)
            start = time.perf_counter()
            tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
            best[threads] = max(best[threads], tokens / (time.perf_counter() - start))
    return {"model": name, "matmul_params": matmul_params(llm.model_config), "tok_per_s": best}


def spin() -> None:
    """Burn one core until killed: a stand-in for another job on the machine."""
    while True:
        pass


@contextlib.contextmanager
def busy(num_processes: int) -> Iterator[None]:
    """Run ``num_processes`` spinning processes for the duration of the block."""
    procs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(num_processes)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
            proc.join()


def main() -> None:
    """Parse flags, measure every model, print one row per model (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", nargs="+", type=int, default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per thread count (best kept)")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes to run beside the measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object per model")
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS"):
        print(f"note: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set; this script sets counts itself")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fnvllm-threads-") as root:
        folders = {name: model_folder(name, Path(root)) for name in args.models}
        with busy(args.busy):
            for name in args.models:
                rows.append(measure(name, folders[name], args.threads, args))
                print(json.dumps(rows[-1]) if args.json else f"measured {name}", flush=True)
            load = os.getloadavg()[0]
    print(f"\nload average {load:.1f} at the end, {os.cpu_count()} CPUs, {args.busy} spinning process(es) beside")
    print(f"fnvllm picks one thread below {SMALL_MODEL_PARAMS:,} matmul parameters")
    print(f"{'model':>8} {'params':>12} " + " ".join(f"{f'{t} thr tok/s':>14}" for t in args.threads) + "  ratios")
    for row in rows:
        rates = row["tok_per_s"]
        ratios = " ".join(f"{rates[t] / rates[args.threads[0]]:.2f}" for t in args.threads)
        cells = " ".join(f"{rates[t]:>14.1f}" for t in args.threads)
        print(f"{row['model']:>8} {row['matmul_params']:>12,} {cells}  {ratios}")


if __name__ == "__main__":
    main()

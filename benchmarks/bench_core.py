"""Core benchmark: the pure scheduler + commit on the nano-vllm workload, with an O(1) toy executor.

    python benchmarks/bench_core.py            # table
    python benchmarks/bench_core.py --json     # {"us_per_step_256": ..., "us_per_step_1024": ...}

Config: 4,300 blocks of 256 tokens, budget 16,384 tokens, max_num_seqs 512, prefix caching on. Reports the
mean microseconds of schedule + commit per step (the toy executor's time excluded), best of ``--repeats``.

The loop is written out here rather than run through the engine loop because the two pure calls are what is
timed, each on its own clock: the engine loop's output processing is not part of the core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fnvllm.state import CoreConfig, add_request, commit, initial_state, schedule
from fnvllm.testing.toy import CounterToyExecutor
from fnvllm.workloads import bench_workload

CONFIG = CoreConfig(block_size=256, num_blocks=4300, max_num_batched_tokens=16384, max_num_seqs=512, max_model_len=4096)


def time_core(num_requests: int) -> tuple[float, int, int]:
    """Run the workload to completion; returns (seconds in schedule+commit, steps, output tokens)."""
    prompts, params = bench_workload(num_requests)
    state = initial_state(CONFIG)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        state = add_request(state, str(i), prompt, p)
    executor = CounterToyExecutor()
    core = 0.0
    steps = tokens = 0
    while state.has_unfinished:
        t0 = time.process_time()
        state, plan = schedule(state)
        t1 = time.process_time()
        sampled = executor.execute(plan).token_ids
        t2 = time.process_time()
        state, out = commit(state, plan, sampled)
        core += (t1 - t0) + (time.process_time() - t2)
        steps += 1
        tokens += len(out.new_tokens)
    return core, steps, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; the best is reported")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    results = {}
    rows = []
    for n in args.sizes:
        best = min((time_core(n) for _ in range(args.repeats)), key=lambda r: r[0])
        seconds, steps, tokens = best
        results[f"us_per_step_{n}"] = round(seconds / steps * 1e6, 1)
        rows.append((n, steps, tokens, seconds, seconds / steps * 1e6))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'requests':>8} {'steps':>6} {'tokens':>8} {'core s':>8} {'us/step':>8}")
    for n, steps, tokens, seconds, us in rows:
        print(f"{n:>8} {steps:>6} {tokens:>8} {seconds:>8.3f} {us:>8.1f}")


if __name__ == "__main__":
    main()

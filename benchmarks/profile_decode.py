"""Where a decode step's time goes on the GPU: device kernels (torch.profiler) and host work (cProfile).

Loads the bench workload's first ``--num-requests`` requests on a random checkpoint, steps until every request
is decoding, then profiles ``--steps`` decode steps twice: once with torch.profiler (a table of the device time per
kernel, summed over the steps; a Chrome trace in ``--trace``), once with cProfile (host functions by cumulative
time). Also prints wall time per step split into schedule / execute / commit+route as the loop runs them.

    PYTHONPATH=$PWD python3 benchmarks/profile_decode.py --model-shape qwen3-0.6b --trace $OUT/decode_trace.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from fnvllm.bench import write_checkpoint
from fnvllm.executor.inputs import is_decode_only
from fnvllm.llm import LLM
from fnvllm.state import StepPlan, schedule
from fnvllm.workloads import bench_workload


def step_split(llm: LLM, steps: int) -> dict[str, float]:
    """Mean ms per step of schedule, engine.step (execute + commit) and routing, as a plain (not overlapped)
    EngineLoop.step runs them: a step in flight is committed first (``EngineLoop.drain``), then each step's calls
    are run here and handed back to the loop (``EngineLoop.adopt``: routing, stats)."""
    loop = llm.loop
    loop.drain()
    totals = {"schedule": 0.0, "execute+commit": 0.0, "route": 0.0}
    for _ in range(steps):
        t0 = time.perf_counter()
        state, plan = schedule(loop.state)
        t1 = time.perf_counter()
        state, out = loop.engine.step(state, plan)
        t2 = time.perf_counter()
        loop.adopt(state, plan, out)
        t3 = time.perf_counter()
        totals["schedule"] += t1 - t0
        totals["execute+commit"] += t2 - t1
        totals["route"] += t3 - t2
    return {k: 1e3 * v / steps for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps here")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    folder = write_checkpoint(args.model_shape, Path(tempfile.mkdtemp(prefix="fnvllm-prof-")))
    llm = LLM(folder, load_tokenizer=False, max_model_len=2048, enforce_eager=args.enforce_eager)
    prompts, params = bench_workload(args.num_requests)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        llm.loop.add(f"r{i}", p, sp)
    plans: list[StepPlan] = []
    llm.loop.on_step = lambda _state, plan, _out: plans.append(plan)
    while not plans or not is_decode_only(plans[-1]):
        llm.loop.step()
    llm.loop.on_step = None
    for _ in range(5):  # warm
        llm.loop.step()
    print(f"running {len(llm.state.num_computed)} sequences, decode only from here")
    split = step_split(llm, args.steps)
    print("host wall ms/step: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            llm.loop.step()
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    print(f"device time over {args.steps} decode steps (sort: {sort})")
    print(table)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        llm.loop.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(35)
    print(f"host functions over {args.steps} decode steps (cProfile, cumulative)")
    print(text.getvalue()[-9000:])


if __name__ == "__main__":
    main()

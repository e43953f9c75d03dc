"""Where the host's time goes in prefill (mixed) steps: the bench's 256 prompts with 3 output tokens each (mostly
mixed steps). Prints, per step, the host milliseconds spent in each part of the overlapped loop (speculate,
launch, collect = waiting for the device, commit + routing, reconcile), then the CUDA runtime calls that can
block the host (synchronizations, blocking copies, allocations) under torch.profiler.

    PYTHONPATH=$PWD python3 benchmarks/profile_mixed.py
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import fnvllm.engine.loop as loop_module
from fnvllm.bench import write_checkpoint
from fnvllm.engine.core import Engine
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams
from fnvllm.workloads import bench_workload

PARTS: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that adds its host milliseconds to PARTS[name]."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[name].append((time.perf_counter() - start) * 1e3)

    return wrapper


def main() -> None:
    """Profile the mixed steps of the bench's prompts on a random Qwen3-0.6B (needs a CUDA GPU)."""
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_mixed.py profiles CUDA launches: it needs a CUDA GPU")
    folder = write_checkpoint("qwen3-0.6b", Path(tempfile.mkdtemp(prefix="fnvllm-mixed-")))
    llm = LLM(folder, load_tokenizer=False, block_size=256, max_num_batched_tokens=16384, max_num_seqs=512,
              max_model_len=4096)  # fmt: skip
    prompts, _ = bench_workload(256, 1024, 1024)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=3)
    llm.generate(prompts[:64], params, use_tqdm=False)  # warm-up, mixed steps included
    loop_module.speculate = timed("speculate", loop_module.speculate)
    loop_module.reconcile = timed("reconcile", loop_module.reconcile)
    Engine.launch = timed("launch", Engine.launch)  # type: ignore[method-assign]
    Engine.collect = timed("collect (wait + commit)", Engine.collect)  # type: ignore[method-assign]
    llm.loop.processor.process = timed("route outputs", llm.loop.processor.process)  # type: ignore[method-assign]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"256 prompts, 3 tokens each: {time.perf_counter() - start:.3f} s")
    print(f"{'part':<26}{'calls':>6}  host ms per call (in order)")
    for name, values in PARTS.items():
        print(f"{name:<26}{len(values):>6}  " + " ".join(f"{v:.1f}" for v in values[:14]))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    events = list(prof.key_averages())
    runtime = sorted((e for e in events if e.key.startswith("cu")), key=lambda e: -e.cpu_time_total)
    print(f"{'runtime call':<48}{'count':>8}{'host ms':>12}")
    for e in runtime[:10]:
        print(f"{e.key[:47]:<48}{e.count:>8}{e.cpu_time_total / 1e3:>12.2f}")
    print(f"{'op (self host time)':<48}{'count':>8}{'host ms':>12}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"{e.key[:47]:<48}{e.count:>8}{e.self_cpu_time_total / 1e3:>12.2f}")


if __name__ == "__main__":
    main()

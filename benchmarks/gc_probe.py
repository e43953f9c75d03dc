"""Garbage-collector passes per decode step, by generation, under several collector thresholds.

Runs ``host_step.measure`` (overlapped decode steps of B requests, the engine's host phases timed) once per
threshold setting given on the command line, each as ``first,second,third``, and prints the host ms per step, the
collection ms per step and the passes per step of each generation. The engine build raises the first threshold
(``fnvllm.engine.build.YOUNG_GC_THRESHOLD``); this sets each setting after the build, so the rows compare them.
On a GPU the Qwen3-0.6B shape (120 steps), on the CPU the tiny one (20 steps, overlap forced on as host_step does):

    PYTHONPATH=$PWD python3 benchmarks/gc_probe.py 256 700,10,10 10000,10,10 50000,20,20
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import host_step

from fnvllm import LLM
from fnvllm.bench import write_checkpoint
from fnvllm.executor.model_executor import ModelExecutor

PASSES: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def gc_clock(clock: Any) -> Iterator[None]:
    """host_step's "gc" phase, and the passes and ms of each generation in PASSES."""
    started: dict[int, float] = {}

    def callback(phase: str, info: dict[str, int]) -> None:
        generation = info["generation"]
        if phase == "start":
            started[generation] = time.perf_counter()
            return
        seconds = time.perf_counter() - started.pop(generation)
        PASSES[f"gen{generation} passes"] += 1
        PASSES[f"gen{generation} ms"] += 1e3 * seconds
        clock.seconds["gc"] = clock.seconds.get("gc", 0.0) + seconds
        clock.calls["gc"] = clock.calls.get("gc", 0) + 1

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batch", type=int, help="decode rows")
    parser.add_argument("thresholds", nargs="+", help="collector thresholds, each as first,second,third")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    steps, warm = (120, 10) if on_gpu else (20, 3)
    folder = write_checkpoint("qwen3-0.6b" if on_gpu else "tiny", Path(tempfile.mkdtemp(prefix="fnvllm-gc-")))
    os.environ["FNVLLM_TIMELINE"] = str(Path(tempfile.mkdtemp(prefix="fnvllm-gc-tl-")) / "timeline.jsonl")
    options: dict[str, Any] = {"max_model_len": 2048, "max_num_seqs": args.batch}
    if not on_gpu:  # as host_step: room for every request's whole run, and the overlapped loop on the CPU
        options["num_blocks"] = args.batch * (math.ceil((100 + warm + steps + 64) / 16) + 1) + 64
        ModelExecutor.supports_overlap = property(lambda self: True)  # type: ignore[assignment,method-assign]
    llm = LLM(folder, load_tokenizer=False, **options)
    host_step.gc_clock = gc_clock
    for spec in args.thresholds:
        gc.set_threshold(*(int(x) for x in spec.split(",")))
        PASSES.clear()
        per_step, line = host_step.measure(llm, args.batch, steps, warm, 100)
        host = per_step["step"] - per_step.get("wait", 0.0)
        by_generation = ", ".join(f"{k} {v / steps:.3f}" for k, v in sorted(PASSES.items()))
        print(f"threshold {spec}: host {host:.3f} ms/step, gc {per_step.get('gc', 0.0):.3f} ms/step; per step: "
              f"{by_generation or 'no passes'}; {line}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

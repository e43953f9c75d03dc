"""Host cost of one decode step, per phase, at several batch sizes (issue 19 item 4: host time <= device time).

Runs the engine loop (``EngineLoop.step``, overlapped as on a GPU) over ``--steps`` decode steps of B requests
and times, per step, each host phase of the loop by wrapping the functions that run it (inclusive times; nested
phases are indented under their caller):

    step                      EngineLoop.step, the whole cycle
      speculate               plan N+1 from placeholders: commit + schedule (fnvllm.state.overlap)
      launch                  ModelExecutor.launch of N+1: feed, inputs, graph/forward, logits, sampler launches
      collect                 Engine.collect(_folded) of N: the device wait, the copy's tolist, the real commit
                              or the fold of the real tokens into the speculation
      route                   OutputProcessor.process
      reconcile               schedule(committed) and the comparison with the speculative plan
      deliver                 the trackers' deltas
      gc                      the garbage collector's passes during the step (gc.callbacks)

``wait`` (the host blocked on the device, inside collect) is device time, not host time: ``host`` = step - wait.
On the CPU there is no device: the forward, the logits and the sampler's kernels run on the host in ``launch``,
so the table also prints ``host w/o compute`` = step - forward - logits - sampler kernels (``Sampler.sample``),
the host work a GPU would still do. The loop is forced to overlap on the CPU too (``EngineLoop.overlap``), so that
the overlapped path's host work (speculate, feed, reconcile) is what is measured.

With ``FNVLLM_TIMELINE``-style timing on a GPU the table ends with the executor's own timeline means (gpu_ms,
cpu_ms per decode step). CPU (tiny model, ~1 minute):

    PYTHONPATH=$PWD python3 benchmarks/host_step.py --batches 1,16,64,256

GPU (H200, Qwen3-0.6B shape by default there, random weights; a table is printed after each batch size):

    PYTHONPATH=$PWD python3 benchmarks/host_step.py --batches 1,16,64,256

The sampling settings users send (issue 19's table: each must cost the host little more than temperature alone):
``--logprobs N``, ``--preset qwen3`` (top_p 0.95, top_k 20); ``--profile N`` prints a cProfile of the timed steps
(top N by tottime) before each table, ``--freeze-gc`` shows what the garbage collector's full passes cost. The
256-row comparison on the H200 (~2 minutes):

    for f in "" "--logprobs 5" "--preset qwen3" "--logprobs 5 --freeze-gc"; do
        PYTHONPATH=$PWD python3 benchmarks/host_step.py --batches 256 --steps 100 --profile 25 $f; done

Penalties (issue 19: a penalised batch cost the host 0.6-1.7 ms more per decode step than temperature alone):
``--repetition-penalty X``, ``--presence-penalty X``, ``--frequency-penalty X``. ``--penalty-host N`` times only
the sampling inputs' host work around the sampler (``prepare_sampling`` through the executor's memo,
``SlotHistory.penalties`` and ``record``) over N decode steps, no model; it imports whichever ``fnvllm`` is on
PYTHONPATH, so one script compares two trees (seconds, CPU):

    for t in /tmp/old-tree $PWD; do PYTHONPATH=$t python3 benchmarks/host_step.py --penalty-host 300 \
        --batches 64,256 --preset qwen3 --repetition-penalty 1.05; done

or, in one run, both trees in turns (``--rounds`` each, the lowest median per column kept) and the ratios:

    PYTHONPATH=$PWD python3 benchmarks/host_step.py --penalty-host 300 --batches 64,256 --preset qwen3 \
        --repetition-penalty 1.05 --baseline /tmp/old-tree --rounds 5

``--logprobs N --with-plain`` measures each batch size twice in one run, without and with logprobs, side by side,
and ends the table with each column's host ms per step over its plain column (the logprobs' host cost):

    PYTHONPATH=$PWD python3 benchmarks/host_step.py --batches 256 --logprobs 5 --with-plain --freeze-gc

The requests drop their deltas as ``LLM.generate``'s do. ``--checkpoint DIR`` reuses (or writes once) the random
checkpoint. Two parts alone: ``--output-path N`` (the logprobs' host path over N steps, no model, then the cost of
reading every output's logprobs) and ``--sampler-ops N`` (the host's us per call of ``Sampler.sample`` with and
without logprobs and of the logprob torch calls, at 256 rows x 151,936, the device free-running behind).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import math
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import fnvllm.engine.core as core_module
import fnvllm.engine.loop as loop_module
import fnvllm.executor.cuda_graphs as graphs_module
import fnvllm.executor.model_executor as executor_module
import fnvllm.state.overlap as overlap_module
from fnvllm.bench import write_checkpoint
from fnvllm.cli.bench import PRESETS
from fnvllm.engine.core import Engine
from fnvllm.engine.loop import EngineLoop
from fnvllm.engine.output import OutputProcessor, RequestTracker, discard_delta
from fnvllm.executor.cuda_graphs import DecodeGraphs
from fnvllm.executor.inputs import is_decode_only
from fnvllm.executor.model_executor import HostCopy, ModelExecutor
from fnvllm.executor.sampler import Sampler, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams, StepPlan

# (phase name, depth, owner, attribute): the functions wrapped, in the order the table prints them.
PHASES: tuple[tuple[str, int, Any, str], ...] = (
    ("step", 0, EngineLoop, "step"),
    ("speculate", 1, loop_module, "speculate"),
    ("spec.commit", 2, overlap_module, "commit"),
    ("spec.schedule", 2, overlap_module, "schedule"),
    ("launch", 1, ModelExecutor, "launch"),
    ("feed", 2, ModelExecutor, "_feed"),
    ("hidden_at_samples", 2, ModelExecutor, "_hidden_at_samples"),
    ("graph_sample", 3, ModelExecutor, "_graph_sample"),
    ("graph.run_plan", 3, DecodeGraphs, "run_plan"),
    ("stage_decode", 4, graphs_module, "stage_decode"),
    ("replay", 4, torch.cuda.CUDAGraph, "replay"),
    ("forward (eager)", 3, ModelExecutor, "_forward"),
    ("compute_logits", 2, None, "compute_logits"),  # the model instance's method, wrapped per run
    ("sample", 2, ModelExecutor, "_sample"),
    ("prepare_sampling", 3, executor_module, "prepare_sampling"),
    ("sampler.sample", 3, Sampler, "sample"),
    ("host_copy.start", 3, HostCopy, "start"),
    ("collect", 1, Engine, "collect"),
    ("collect", 1, Engine, "collect_folded"),  # the same phase when the commit folds into the speculation
    ("executor.collect", 2, ModelExecutor, "collect"),
    ("wait", 3, HostCopy, "wait"),
    ("fold", 2, core_module, "fold_speculation"),
    ("commit", 2, core_module, "commit"),
    ("route", 1, OutputProcessor, "process"),
    ("reconcile", 1, loop_module, "reconcile"),
    ("rec.schedule", 2, overlap_module, "schedule"),
    ("deliver", 1, loop_module, "deliver_all"),
    ("gc", 1, None, ""),  # the garbage collector's passes, timed by gc.callbacks (not a wrapped function)
)
DEVICE_WORK = ("forward (eager)", "compute_logits", "sampler.sample")  # on the CPU: the device's work, run here


class PhaseClock:
    """Accumulated seconds and calls per phase, filled by the wrappers ``install`` puts in place."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[str] = []

    def reset(self) -> None:
        """Forget what was timed so far."""
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, name: str, fn: Callable[..., Any], by_caller: bool = False) -> Callable[..., Any]:
        """``fn`` timed under ``name``; ``by_caller``: under "spec.<name>" or "rec.<name>" after the phase that
        called it (speculate or reconcile: the overlap module's commit and schedule serve both)."""
        clock = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = name
            if by_caller:
                label = ("spec." if "speculate" in clock.stack else "rec.") + name
            if label in clock.stack:  # a phase reached again from inside itself counts once
                return fn(*args, **kwargs)
            clock.stack.append(label)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds[label] = clock.seconds.get(label, 0.0) + time.perf_counter() - t0
                clock.calls[label] = clock.calls.get(label, 0) + 1
                clock.stack.pop()

        return timed


@contextmanager
def gc_clock(clock: PhaseClock) -> Iterator[None]:
    """Time the garbage collector's passes as the phase "gc" (wherever they fall inside the step)."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            clock.seconds["gc"] = clock.seconds.get("gc", 0.0) + time.perf_counter() - started.pop()
            clock.calls["gc"] = clock.calls.get("gc", 0) + 1

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


@contextmanager
def install(clock: PhaseClock, llm: LLM) -> Iterator[None]:
    """Wrap every phase's function (``PHASES``) for the duration; ``spec.*`` and ``rec.*`` share one function
    (``fnvllm.state.overlap``'s schedule), told apart by their caller."""
    saved: list[tuple[Any, str, Any]] = []
    wrapped_overlap: set[str] = set()
    for name, _, owner, attr in PHASES:
        if not attr:
            continue
        target = llm.executor.model if owner is None else owner
        if target is overlap_module and attr in wrapped_overlap:
            continue
        original = getattr(target, attr, None)
        if original is None:
            continue
        saved.append((target, attr, target.__dict__.get(attr, original) if owner is not None else None))
        by_caller = target is overlap_module
        setattr(target, attr, clock.wrap(attr if by_caller else name, original, by_caller))
        if target is overlap_module:
            wrapped_overlap.add(attr)
    try:
        yield
    finally:
        for target, attr, original in reversed(saved):
            if original is None:
                delattr(target, attr)
            else:
                setattr(target, attr, original)


def measure(
    llm: LLM,
    batch: int,
    steps: int,
    warm: int,
    prompt_len: int,
    sampling: dict[str, Any] | None = None,
    profile: int = 0,
) -> tuple[dict[str, float], str]:
    """Per-step ms per phase over ``steps`` decode steps of ``batch`` requests; also the timeline means line.
    ``sampling``: SamplingParams fields on top of temperature 0.6 (``--logprobs``, ``--preset``)."""
    loop = llm.loop
    loop.overlap = True  # the overlapped loop's host work, on the CPU too (its launch runs the step at once)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=warm + steps + 64, **(sampling or {}))
    base = len(loop.state.requests) + loop.stats.num_steps * 1000
    trackers = []  # dropping their deltas, as LLM.generate's do (the bench's path: no delta is built)
    for i in range(batch):
        ids = tuple((7 * i + j) % 5000 + 10 for j in range(prompt_len))
        trackers.append(RequestTracker(i, f"b{batch}-{base}-{i}", None, ids, params, None, discard_delta))
    loop.add_many([(t.request_id, t.prompt_ids, t.params, t) for t in trackers])
    plans: list[StepPlan] = []
    loop.on_step = lambda _state, plan, _out: plans.append(plan)
    while not plans or not is_decode_only(plans[-1]) or plans[-1].num_seqs != batch:
        loop.step()
    for _ in range(warm):
        loop.step()
    loop.on_step = None
    timeline = llm.executor.timeline
    if timeline is not None:
        timeline.records.clear()
    clock = PhaseClock()
    profiler = cProfile.Profile() if profile else None
    with install(clock, llm), gc_clock(clock):
        if profiler is not None:
            profiler.enable()
        for _ in range(steps):
            loop.step()
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        print(f"B={batch}: cProfile of {steps} steps, top {profile} by tottime")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    per_step = {k: 1e3 * v / steps for k, v in clock.seconds.items()}
    calls = {k: n / steps for k, n in clock.calls.items()}
    line = "calls/step: " + ", ".join(
        f"{k} {calls.get(k, 0.0):.2f}" for k in ("spec.schedule", "rec.schedule", "spec.commit", "commit", "fold", "gc")
    )
    if timeline is not None:
        decode = [r for r in timeline.records if r["num_prefill_tokens"] == 0]
        if decode:
            gpu = sum(r["gpu_ms"] for r in decode) / len(decode)
            cpu = sum(r["cpu_ms"] for r in decode) / len(decode)
            line += f"; timeline: gpu_ms {gpu:.3f}, cpu_ms {cpu:.3f} per decode step ({len(decode)} steps)"
    for t in trackers:
        loop.abort(t.request_id)
    while loop.has_unfinished:
        loop.step()
    return per_step, line


def print_table(results: dict[str, tuple[dict[str, float], str]], on_gpu: bool) -> None:
    """One column per measured run ("B=256", or "B=256 plain" / "B=256 logprobs=5" when settings are compared),
    one row per phase (ms per step), then host = step - wait (on the CPU also without the device's work), and,
    where a batch size has a plain column, each column's host ms per step over that plain one."""
    labels = list(results)
    width = max(10, *(len(label) + 2 for label in labels))
    header = f"{'phase (ms/step)':<24}" + "".join(f"{label:>{width}}" for label in labels)
    print(header)
    print("-" * len(header))
    printed: set[str] = set()
    for name, depth, _, _ in PHASES:
        if name in printed or not any(name in results[c][0] for c in labels):
            continue
        printed.add(name)
        label = "  " * depth + name
        print(f"{label:<24}" + "".join(f"{results[c][0].get(name, 0.0):>{width}.3f}" for c in labels))
    print("-" * len(header))
    host = {c: results[c][0].get("step", 0.0) - results[c][0].get("wait", 0.0) for c in labels}
    print(f"{'host (step - wait)':<24}" + "".join(f"{host[c]:>{width}.3f}" for c in labels))
    if not on_gpu:  # the device's work ran on the host: what a GPU would leave
        host = {c: host[c] - sum(results[c][0].get(k, 0.0) for k in DEVICE_WORK) for c in labels}
        print(f"{'host w/o compute':<24}" + "".join(f"{host[c]:>{width}.3f}" for c in labels))
    plain = {c.split()[0]: host[c] for c in labels if c.endswith(" plain")}
    if plain and len(plain) < len(labels):
        over = [host[c] - plain[c.split()[0]] if c.split()[0] in plain else None for c in labels]
        cells = "".join(" " * width if v is None else f"{v:>+{width}.3f}" for v in over)
        print(f"{'host over plain':<24}{cells}")
    for c in labels:
        print(f"{c}: {results[c][1]}")


def output_path(steps: int, logprobs: int, rows: int = 256) -> None:
    """The logprobs' host path alone, no model (``--output-path``): ``rows`` requests ending at steps spread evenly
    over ``steps``, each step's logprob tensors through the executor's conversion, ``Engine``'s output and the
    trackers (a request's entries are built when it finishes); prints the per-step ms (mean, p50, max) and the
    garbage collector's share. The bench's shape without its device: where the host's time per step goes."""
    import random

    from fnvllm.engine.output import OutputProcessor
    from fnvllm.executor.base import ExecuteResult
    from fnvllm.executor.logprob_rows import LogprobView
    from fnvllm.executor.model_executor import _host_logprobs
    from fnvllm.executor.sampler import Logprobs
    from fnvllm.state.request import FinishedRequest, StepOutput

    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, logprobs=logprobs, ignore_eos=True, max_tokens=steps + 1)
    ends = {f"r{i}": rng.randint(steps // 10, steps) for i in range(rows)}
    processor = OutputProcessor()
    trackers = [RequestTracker(i, rid, None, (1, 2, 3), params, None) for i, rid in enumerate(ends)]
    for tracker in trackers:
        processor.add(tracker)
    clock = PhaseClock()
    times: list[float] = []
    with gc_clock(clock):
        for step in range(steps + 1):
            ids = tuple(rid for rid, end in ends.items() if end >= step)
            num = len(ids)
            lp = Logprobs(torch.randn(num, logprobs), torch.randint(0, 150_000, (num, logprobs)), torch.randn(num))
            plan = StepPlan(step, 16, ids, ((1,),) * num, (0,) * num, ((0,),) * num, (True,) * num)
            finished = tuple(FinishedRequest(rid, 3, (), "length") for rid in ids if ends[rid] == step)
            t0 = time.perf_counter()
            tokens = list(range(num))
            result = ExecuteResult(tuple(tokens), _host_logprobs(lp, tokens, (logprobs,) * num))
            out = Engine._output(plan, StepOutput(step, ids, tuple(tokens), finished), result)
            processor.process(None, out)  # type: ignore[arg-type]  # no stop strings: the state is not read
            times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outputs = [t.result() for t in trackers]
    num_entries = sum(len(o.logprobs.entries()) for o in outputs if isinstance(o.logprobs, LogprobView))
    read_s = time.perf_counter() - t0
    times.sort()
    mean = 1e3 * sum(times) / len(times)
    gc_ms = 1e3 * clock.seconds.get("gc", 0.0) / len(times)
    print(f"output path, {rows} rows, logprobs {logprobs}, {len(times)} steps: {mean:.3f} ms/step mean, "
          f"p50 {1e3 * times[len(times) // 2]:.3f}, max {1e3 * times[-1]:.1f}; gc {gc_ms:.3f} ms/step")  # fmt: skip
    print(f"then reading every output's logprobs (built on first read): {1e3 * read_s:.1f} ms for {num_entries} "
          f"entries, {1e6 * read_s / max(num_entries, 1):.2f} us each")  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a call runs on the host (allocations, views, the rest) and, with ``triton_launches``,
    its Triton launches: on a GPU each non-view op is a launch or an allocator call, so the counts say what a
    change saves without a GPU (``--sampler-ops`` on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs = self.views = self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name.startswith(("empty", "zeros", "ones", "full", "new_empty", "new_zeros")):
            self.allocs += 1
        elif func.is_view or name in ("view", "_unsafe_view", "slice", "select", "as_strided", "alias"):
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def triton_launches() -> Iterator[list[int]]:
    """A one-element list counting Triton kernel launches (compiled or interpreted) inside the block; torch ops
    inside a launch (the interpreter's copies) are hidden from an ``OpCounter``."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    count = [0]
    originals = [(cls, cls.run) for cls in (jit.JITFunction, interpreter.InterpretedFunction)]

    def counted(run: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(run)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            count[0] += 0 if kwargs.get("warmup") else 1
            with _disable_current_modes():  # the interpreter's own torch calls are not the launch's host ops
                return run(self, *args, **kwargs)

        return wrapper

    for cls, run in originals:
        cls.run = counted(run)  # type: ignore[method-assign]
    try:
        yield count
    finally:
        for cls, run in originals:
            cls.run = run  # type: ignore[method-assign]


def round1_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, num_top: int, chunk: int) -> Any:
    """The logprobs as round 1 computed them (h-logp e56110f), for the side by side: an (L,) allocation, three
    launches (``logprob_candidates``: chunk summaries, combine, gather), torch.topk of the candidates, a gather
    and a subtraction; three tensors for the host copy."""
    from fnvllm.executor.sampler import Logprobs
    from fnvllm.kernels.sampling import logprob_candidates

    sampled = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    lse, values, ids = logprob_candidates(logits, rows, max(num_top, 1), chunk, tokens, sampled)
    top = values.topk(num_top, dim=-1)
    return Logprobs(top.values - lse[:, None], ids.gather(1, top.indices), sampled)


def sampler_ops(
    iters: int, rows: int = 256, vocab: int = 151_936, logprobs: int = 5, kernels: bool | None = None
) -> None:
    """Per call of the sampler's pieces (``--sampler-ops N``): the host ops it runs (aten ops that launch or
    allocate, views, Triton launches: counted on the CPU too, where the Triton kernels run interpreted) and, on
    a GPU, the host's us per call with the device running freely behind. Pieces: ``Sampler.sample`` of ``rows``
    temperature rows without and with logprobs, ``compute_logprobs`` now and as round 1 did it, and the step's
    host copy (now: the samples and one packed logprobs tensor; round 1: the samples and three tensors). No
    model: random bf16 logits of ``vocab`` tokens (on the CPU: 8 x 4096, the counts do not depend on the size).
    A piece whose host time is far above its launch count x ~5 us waits for the device."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported: run on the CPU
        rows, vocab = min(rows, 8), min(vocab, 4096)
    from fnvllm.executor.model_executor import PinnedRing
    from fnvllm.executor.sampler import _logprob_chunk, compute_logprobs

    device = torch.device("cuda" if on_gpu else "cpu")
    logits = torch.randn(rows, vocab, device=device).to(torch.bfloat16)
    plain = [SamplingParams(temperature=0.6)] * rows
    asking = [SamplingParams(temperature=0.6, logprobs=logprobs)] * rows
    batches = {
        k: prepare_sampling(p, [0] * rows, [None] * rows, vocab, device) for k, p in (("plain", plain), ("lp", asking))
    }
    kernels = True if kernels is None else kernels  # the Triton kernels (interpreted on a CPU)
    sampler = Sampler(seed=0, kernels=kernels)
    out = sampler.sample(logits, batches["lp"])
    tokens, lp_rows, now_lp = out.packed[0], batches["lp"].logprob_rows, out.logprobs
    assert lp_rows is not None and now_lp is not None
    chunk = _logprob_chunk(vocab, logprobs) or 1024
    old_lp = round1_logprobs(logits, tokens, lp_rows, logprobs, chunk)
    if kernels:  # the packed logprobs against the stable-sort reference (equal logits: the lowest id first)
        from fnvllm.kernels.sampling import logprob_top_ref

        want = logprob_top_ref(logits, lp_rows, logprobs, tokens)
        got = (now_lp.top_logprobs, now_lp.top_ids, now_lp.sampled_logprobs)
        worst = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got[::2], want[::2], strict=True))
        same = bool(torch.equal(got[1], want[1]))
        print(f"check: logprob_top vs reference: ids {'equal' if same else 'DIFFER'}, max |logprob diff| {worst:.2e}")
    ring = PinnedRing(rows) if on_gpu else None

    def copy(tensors: list[torch.Tensor]) -> None:
        HostCopy.start(tensors, ring).release()

    pieces: dict[str, Callable[[], object]] = {
        "sampler.sample plain": lambda: sampler.sample(logits, batches["plain"]),
        f"sampler.sample logprobs={logprobs}": lambda: sampler.sample(logits, batches["lp"]),
        "  compute_logprobs (now)": lambda: compute_logprobs(
            logits, tokens, lp_rows, logprobs, kernels, sampler._scratch
        ),
        "  compute_logprobs (round 1)": lambda: round1_logprobs(logits, tokens, lp_rows, logprobs, chunk),
        f"host copy now ({1 + len(now_lp.copied())} tensors)": lambda: copy([out.packed, *now_lp.copied()]),
        f"host copy round 1 ({1 + len(old_lp.copied())} tensors)": lambda: copy([out.packed, *old_lp.copied()]),
    }
    print(f"sampler ops: {rows} rows x {vocab} on {device}, per call: host ops and (GPU) host us, mean of {iters}")
    print(f"{'piece':<34}{'aten':>6}{'alloc':>6}{'view':>6}{'triton':>7}{'host us':>10}{'w/ device':>11}")
    for name, fn in pieces.items():
        fn()
        counter = OpCounter()
        with triton_launches() as launches, counter:
            fn()
        host = total = float("nan")
        if on_gpu:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
        print(
            f"{name:<34}{counter.ops:>6}{counter.allocs:>6}{counter.views:>6}{launches[0]:>7}"
            f"{1e6 * host / iters:>10.1f}{1e6 * total / iters:>11.1f}",
            flush=True,
        )


def penalty_plan(
    step: int, batch: int, params: tuple[Any, ...], slots: tuple[int, ...], context: int = 100, outputs: int = 0
) -> StepPlan:
    """Decode step ``step`` of ``batch`` rows: context ``context`` + step, ``outputs`` + step outputs, the same
    params and slots (also ``bench_penalties.py``'s steps)."""
    ctx = context + step
    return StepPlan(
        step=step,
        block_size=16,
        seq_ids=tuple(f"r{i}" for i in range(batch)),
        input_tokens=((5,),) * batch,
        start_positions=(ctx - 1,) * batch,
        block_tables=((0,),) * batch,
        sample=(True,) * batch,
        params=params,
        num_generated=(outputs + step,) * batch,
        histories=(None,) * batch,
        slots=slots,
    )


def penalty_host(steps: int, batches: list[int], sampling: dict[str, Any]) -> dict[str, list[float]]:
    """The sampling inputs' host work of a decode step alone (``--penalty-host N``), no model: per step, what
    ``ModelExecutor._sample`` runs on the host before and after the sampler (``prepare_sampling`` through the
    executor's ``SamplingMemo``, ``SlotHistory.penalties`` and ``SlotHistory.record``) over N decode steps of B
    rows whose params tuple and slots stay the same (the core's decode steps without joins or leaves), on the
    CPU. Prints us per step (median of the steps) per batch size, then the aten ops per step of ``penalties`` and
    ``record`` (ops / allocations; each a launch or an allocator call on a GPU, ~5 us of host each there), and
    returns the us columns per batch. Runs against whichever ``fnvllm`` is on PYTHONPATH, so one script compares
    two trees (``--baseline``)."""
    import statistics

    from fnvllm.executor.history import SlotHistory
    from fnvllm.executor.sampler import SamplingMemo

    vocab, device = 151_936, torch.device("cpu")
    print(f"penalty host: sampling {sampling}, {steps} steps, us per step (median): prepare, penalties, record, all")
    print(f"{'':8}{'prepare':>10}{'penalties':>10}{'record':>10}{'all':>10}   aten ops/allocs: penalties, record")
    found = {}
    for batch in batches:
        params = tuple(SamplingParams(temperature=0.6, **sampling) for _ in range(batch))
        history = SlotHistory(batch, 2048, vocab, device)
        history.in_use = True
        memo = SamplingMemo()
        sampled = torch.zeros(batch, dtype=torch.int64)
        slots = tuple(range(batch))[::-1]
        rows = tuple(range(batch))
        times: list[tuple[float, float, float]] = []
        counters = (OpCounter(), OpCounter())
        for step in range(steps + 10):
            plan = penalty_plan(step, batch, params, slots)
            if step >= steps:  # the last 10 steps: the ops they run (outside the timed ones)
                with counters[0]:
                    pen = history.penalties(plan, rows)
                prepare_sampling(params, plan.num_generated, plan.histories, vocab, device, pen, memo)
                with counters[1]:
                    history.record(plan, rows, sampled)
                continue
            t0 = time.perf_counter()
            pen = history.penalties(plan, rows)
            t1 = time.perf_counter()
            prepare_sampling(params, plan.num_generated, plan.histories, vocab, device, pen, memo)
            t2 = time.perf_counter()
            history.record(plan, rows, sampled)
            t3 = time.perf_counter()
            times.append((t2 - t1, t1 - t0, t3 - t2))
        cols = [1e6 * statistics.median(t[k] for t in times) for k in range(3)]
        total = 1e6 * statistics.median(sum(t) for t in times)
        found[f"B={batch}"] = [*cols, total]
        ops = "  ".join(f"{c.ops / 10:.1f}/{c.allocs / 10:.1f}" for c in counters)
        print(f"  B={batch:<5}{cols[0]:>10.1f}{cols[1]:>10.1f}{cols[2]:>10.1f}{total:>10.1f}   {ops}", flush=True)
    penalised_copy_ops()
    return found


def penalised_copy_ops(rows: int = 4, vocab: int = 512) -> None:
    """The host calls of the penalised rows' copy as the GPU runs it, counted on the CPU (Triton interpreted):
    ``float_rows`` + ``penalize_`` (two launches) against ``penalised_rows`` (one), when this tree has it."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported: run on the CPU
    from fnvllm.kernels import penalties

    logits = torch.randn(rows, vocab).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (rows, 16), dtype=torch.int32)
    meta = torch.tensor([list(range(rows)), [16] * rows, [8] * rows])
    factors = torch.tensor([[1.05], [0.0], [0.0]]).expand(3, rows).contiguous()
    counts = torch.zeros(2, vocab, dtype=torch.int32)
    calls = {"float_rows + penalize_": lambda: penalties.penalize_(penalties.float_rows(logits), tokens, meta,
                                                                   factors, counts)}  # fmt: skip
    if hasattr(penalties, "penalised_rows"):
        calls["penalised_rows"] = lambda: penalties.penalised_rows(logits, None, tokens, meta, factors)
    for name, call in calls.items():
        with triton_launches() as launches, OpCounter() as counter:
            call()
        print(f"  penalised copy, {name}: {launches[0]} launches, {counter.ops} aten ops, {counter.allocs} allocs, "
              f"{counter.views} views")  # fmt: skip


def penalty_host_ab(baseline: str, rounds: int, argv: list[str]) -> None:
    """``--penalty-host N --baseline DIR``: this script's ``--penalty-host`` run ``rounds`` times against the
    ``fnvllm`` of DIR and of this tree in turn (subprocesses, PYTHONPATH each), then each column's best (lowest)
    median over the rounds, side by side, and this tree's over the baseline's (the CPU is shared: the lowest of
    several rounds is the least disturbed)."""
    import subprocess

    here = str(Path(__file__).resolve().parents[1])
    trees = {"baseline": str(Path(baseline).resolve()), "this tree": here}
    best: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "FNVLLM_PENALTY_HOST_JSON": "1"}
            out = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True, check=True)
            if r == 0:
                print(f"== {name} ({tree}), round 1:\n" + "".join(
                    line + "\n" for line in out.stdout.splitlines() if not line.startswith("{")), end="")  # fmt: skip
            got = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
            kept = best.setdefault(name, got)
            for batch, cols in got.items():
                kept[batch] = [min(a, b) for a, b in zip(kept[batch], cols, strict=True)]
    print(f"\npenalty host, best of {rounds} rounds, us per step: prepare, penalties, record, all (baseline -> this)")
    for batch, old in best["baseline"].items():
        new = best["this tree"][batch]
        cells = "  ".join(f"{o:6.1f} -> {n:6.1f} ({n / o:.2f}x)" for o, n in zip(old, new, strict=True))
        print(f"  {batch:<6}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default=None, help="default: qwen3-0.6b on a GPU, tiny on the CPU")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint folder to reuse (written there if absent)")
    parser.add_argument("--batches", default="1,16,64,256", help="comma-separated request counts")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    parser.add_argument("--warm", type=int, default=10, help="untimed decode steps first")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--freeze-gc", action="store_true", help="gc.freeze() once the engine is built")
    parser.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token")
    parser.add_argument(
        "--with-plain", action="store_true", help="with --logprobs: also measure each batch without them, side by side"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a checkpoint's own sampling")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="HF repetition penalty (1 = off)")
    parser.add_argument("--presence-penalty", type=float, default=None, help="OpenAI presence penalty (0 = off)")
    parser.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI frequency penalty (0 = off)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile the timed steps: print the top N by tottime")
    parser.add_argument("--sampler-ops", type=int, default=0, help="only the sampler's pieces' host time, N calls")
    parser.add_argument("--output-path", type=int, default=0, help="only the logprobs' host path over N steps")
    parser.add_argument(
        "--penalty-host", type=int, default=0, help="only the sampling inputs' host work (no model) over N steps"
    )
    parser.add_argument("--baseline", default=None, help="with --penalty-host: a tree to compare, in turns")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: turns per tree (best kept)")
    args = parser.parse_args()
    if args.sampler_ops:
        sampler_ops(args.sampler_ops, logprobs=args.logprobs or 5)
        return
    if args.output_path:
        output_path(args.output_path, args.logprobs or 5)
        return
    sampling: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    if args.logprobs is not None:
        sampling["logprobs"] = args.logprobs
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    batches = [int(b) for b in args.batches.split(",")]
    if args.penalty_host and args.baseline:
        argv = [a for a in sys.argv[1:]]
        at = argv.index("--baseline")
        penalty_host_ab(args.baseline, args.rounds, argv[:at] + argv[at + 2 :])
        return
    if args.penalty_host:
        found = penalty_host(args.penalty_host, batches, sampling)
        if os.environ.get("FNVLLM_PENALTY_HOST_JSON"):
            print(json.dumps(found))
        return
    runs = [("", sampling)]
    if args.logprobs is not None and args.with_plain:  # side by side, same engine and run: the logprobs' host cost
        runs = [
            (" plain", {k: v for k, v in sampling.items() if k != "logprobs"}),
            (f" logprobs={args.logprobs}", sampling),
        ]
    on_gpu = torch.cuda.is_available()
    shape = args.model_shape or ("qwen3-0.6b" if on_gpu else "tiny")
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(
        f"host_step: {shape} on {device}, {args.steps} decode steps per batch, overlap forced on, sampling {sampling}",
        flush=True,
    )
    folder = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="fnvllm-host-"))
    if not (folder / "config.json").exists():
        write_checkpoint(shape, folder)
    timeline_path = Path(tempfile.mkdtemp(prefix="fnvllm-host-tl-")) / "timeline.jsonl"
    os.environ["FNVLLM_TIMELINE"] = str(timeline_path)
    options: dict[str, Any] = {"max_model_len": 2048, "max_num_seqs": max(batches)}
    if not on_gpu:  # room for every request's whole run: a preemption would turn overlap off
        per_request = math.ceil((args.prompt_len + args.warm + args.steps + 64) / 16) + 1
        options["num_blocks"] = max(batches) * per_request + 64
    if not on_gpu:  # the executor overlaps on a GPU only; on the CPU its launch simply runs the step at once
        ModelExecutor.supports_overlap = property(lambda self: True)  # type: ignore[assignment,method-assign]
    llm = LLM(folder, load_tokenizer=False, **options)
    if args.freeze_gc:
        gc.freeze()
    results: dict[str, tuple[dict[str, float], str]] = {}
    for b in batches:  # a table after each batch size, so that a later failure still leaves the earlier ones
        for suffix, settings in runs:
            results[f"B={b}{suffix}"] = measure(llm, b, args.steps, args.warm, args.prompt_len, settings, args.profile)
        print_table(results, on_gpu)
        print(flush=True)


if __name__ == "__main__":
    main()

"""Timers around rank 0's executor for ``tp_profile.py``: host time per phase of a step, CUDA events per phase.

``Phases.attach(executor)`` wraps, for the measured steps only (``detach`` restores them), the methods one step
goes through on rank 0 — ``execute``; the plan's ``post`` (TP); ``_hidden_at_samples`` (input preparation and the
forward's launch) and the graph ``run`` inside it; ``compute_logits``; ``prepare_sampling`` and ``Sampler.sample``;
the guard's ``wait`` (at TP=1 a guard that synchronizes the stream is lent, so the wait is timed the same way).
Nothing in the engine changes: a wrapper calls the original and notes the clock around it.
"""

from __future__ import annotations

import statistics
import time
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import fnvllm.executor.model_executor as model_executor

HOST = ("send", "forward", "logits", "sample", "wait")  # the phases inside execute, in order
GPU = ("replay", "forward", "logits", "sample")  # phases with CUDA events around them


class _SyncGuard:
    """A TP=1 stand-in for rank 0's guard: ``wait`` blocks until the stream is done (what ``tolist`` would do)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def loaded(self) -> None:
        """Nothing to wait for."""

    def wait(self, tensor: torch.Tensor) -> None:
        """Block until the step's kernels are done."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class Phases:
    """Per-step host seconds and CUDA events of each phase, for the steps run through ``run``."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.is_tp = hasattr(executor, "ranks")
        self.local = executor.local if self.is_tp else executor
        self.cuda = self.local.device.type == "cuda"
        self.steps: list[dict[str, Any]] = []
        self._now: dict[str, Any] | None = None
        self._undo: list[Callable[[], None]] = []

    @classmethod
    def attach(cls, executor: Any) -> Phases:
        """Wrap the executor's phases (see the module docstring)."""
        p = cls(executor)
        p._wrap(executor, "execute", "execute")
        p._wrap(p.local, "_hidden_at_samples", "forward")
        if p.local.graphs is not None:
            p._wrap(p.local.graphs, "run", "replay")
        p._wrap(p.local.model, "compute_logits", "logits")
        p._wrap(model_executor, "prepare_sampling", "sample")
        p._wrap(p.local.sampler, "sample", "sample")
        if p.is_tp:
            p._wrap(executor.ranks, "post", "send")
            p._wrap(executor.ranks, "wait", "wait")
        else:
            guard = p.local.guard
            p.local.guard = _SyncGuard(p.local.device)
            p._wrap(p.local.guard, "wait", "wait")
            p._undo.append(lambda: setattr(p.local, "guard", guard))
        return p

    def detach(self) -> None:
        """Put every wrapped method back."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def run(self, step: Callable[[], Any], num_steps: int) -> None:
        """Run ``step`` ``num_steps`` times, timing each."""
        for _ in range(num_steps):
            self._now = {"host": defaultdict(float), "start": {}, "end": {}, "events": {}}
            begin = time.perf_counter()
            step()
            self._now["wall"] = time.perf_counter() - begin
            self.steps.append(self._now)
        self._now = None

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace ``owner.name`` by a timed call (on the instance, or on its class when it has slots)."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            now = self._now
            if now is None:
                return original(*args, **kwargs)
            events = self._record() if self.cuda and label in GPU else None
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                now["host"][label] += end - begin
                now["start"].setdefault(label, begin)
                now["end"][label] = end
                if events is not None:
                    events[1].record()
                    now["events"].setdefault(label, [events[0], events[1]])[1] = events[1]

        self._install(owner, name, timed)

    def _install(self, owner: Any, name: str, timed: Callable[..., Any]) -> None:
        if isinstance(owner, types.ModuleType):  # a module global (prepare_sampling)
            original = getattr(owner, name)
            setattr(owner, name, timed)
            self._undo.append(lambda: setattr(owner, name, original))
            return
        try:
            setattr(owner, name, timed)
            self._undo.append(lambda: delattr(owner, name))
        except AttributeError:  # a slotted (attrs) class: patch the class, for this one instance
            cls, own = type(owner), vars(type(owner)).get(name)
            unbound = getattr(cls, name)

            def on_class(this: Any, *args: Any, **kwargs: Any) -> Any:
                return timed(*args, **kwargs) if this is owner else unbound(this, *args, **kwargs)

            setattr(cls, name, on_class)
            self._undo.append(lambda: setattr(cls, name, own) if own is not None else delattr(cls, name))

    def _record(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start, torch.cuda.Event(enable_timing=True)


def _ms(values: list[float]) -> float:
    return round(statistics.fmean(values) * 1e3, 3) if values else 0.0


def summarize(phases: Phases, batch: int) -> dict[str, Any]:
    """Mean ms per step of each host phase and GPU phase, and the link between rank 0 and its workers."""
    steps = phases.steps
    host = {label: _ms([s["host"].get(label, 0.0) for s in steps]) for label in ("execute", *HOST)}
    host["outside"] = round(_ms([s["wall"] for s in steps]) - host["execute"], 3)
    host["rest"] = round(host["execute"] - sum(host[label] for label in HOST), 3)
    record: dict[str, Any] = {"batch": batch, "steps": len(steps), "wall_ms": _ms([s["wall"] for s in steps])}
    record["host_ms"] = host
    if phases.cuda:
        torch.cuda.synchronize()
        gpu = {label: _gpu_ms(steps, label) for label in GPU}
        gpu["step"] = round(statistics.fmean(_span(s) for s in steps), 3)
        gpu["idle"] = round(record["wall_ms"] - gpu["step"], 3)
        record["gpu_ms"] = gpu
    if phases.is_tp:
        gaps = [s["end"]["logits"] - s["start"]["send"] for s in steps if "send" in s["start"] and "logits" in s["end"]]
        record["rank0_post_to_launched_ms"] = _ms(gaps)
    return record


def _gpu_ms(steps: list[dict[str, Any]], label: str) -> float:
    times = [s["events"][label][0].elapsed_time(s["events"][label][1]) for s in steps if label in s["events"]]
    return round(statistics.fmean(times), 3) if times else 0.0


def _span(step: dict[str, Any]) -> float:
    """GPU ms from the step's first phase start to its last phase end (forward start -> sample end)."""
    events = step["events"]
    first = events.get("forward", events.get("replay"))
    last = events.get("sample", events.get("logits"))
    return first[0].elapsed_time(last[1]) if first and last else 0.0

"""Per-step timeline: GPU time, host time and the device's idle gap between steps, one JSON line per step.

Opt-in: ``FNVLLM_TIMELINE=path.jsonl`` (or ``StepTimeline(path)`` handed to the executor). The first line is a
header (model config, block size, device; the executor passes it); then one record per executed step::

    {"step": 12, "num_seqs": 256, "num_tokens": 256, "num_decode_seqs": 256, "num_prefill_tokens": 0,
     "context_tokens": 151040, "attn_pairs": 151040, "num_samples": 256, "gpu_ms": 4.81, "cpu_ms": 0.93,
     "gap_ms": 0.41, "graph": true, "end_s": 12.345678}

The shape fields are ``fnvllm.state.plan.StepShape``'s, the counts the simulator prices: attn_pairs = (query, key)
pairs attention computes, causal (a row of q tokens from position s: q*s + q*(q+1)/2); num_samples = rows
sampled. Computing them costs a few C-level passes over the plan's rows (~10 us at 512 rows), once per step.

gpu_ms: device time of the step (CUDA events around its forward + sampling; on the CPU, host time).
cpu_ms: host time of one loop cycle outside the device wait: from the previous step's tokens reaching the host
    to this step's wait for its own (schedule / commit / output routing, input preparation, kernel launches;
    with overlapped steps, also planning and launching the step after this one).
gap_ms: device idle time between the previous step's end and this step's start (what overlap hides).
end_s: when the step's tokens reached the host, in seconds since the timeline was created (to line steps up
    with outside events, e.g. a server's request arrivals).
The simulator fits its cost model to these records (``fnvllm simulate calibrate``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

import torch

from fnvllm.state import StepPlan
from fnvllm.state.plan import step_shape

FLUSH_EVERY_S = 0.25  # the timeline file is flushed at most this often while steps run (and at close)


class StepTimeline:
    """Records one JSON line per step to ``path``; ``summary()`` aggregates what was recorded."""

    def __init__(self, path: str | Path | None, header: dict[str, Any], device: torch.device) -> None:
        self.device = device
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = open(path, "w") if path else None  # noqa: SIM115 (closed in close())
        if self._file is not None:
            self._file.write(json.dumps(header) + "\n")
        self._last_return: float | None = None
        self._last_end: torch.cuda.Event | None = None
        self._created = time.perf_counter()
        self._flushed = self._created
        self._spare_events: list[torch.cuda.Event] = []  # timing events whose readings were taken, for reuse

    def event(self) -> torch.cuda.Event:
        """A timing event: a spare one when there is one (creating two per step costs the host more than
        recording them)."""
        return self._spare_events.pop() if self._spare_events else torch.cuda.Event(enable_timing=True)

    def write(self, record: dict[str, Any]) -> None:
        """Keep ``record`` and append it to the file, which is flushed at most every ``FLUSH_EVERY_S`` seconds of
        steps (a flush per step is a system call per step) and at ``close``."""
        self.records.append(record)
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        now = time.perf_counter()
        if now - self._flushed >= FLUSH_EVERY_S:
            self._file.flush()  # a server killed by a signal still leaves all but its last moments of steps
            self._flushed = now

    @classmethod
    def from_env(cls, header: dict[str, Any], device: torch.device) -> StepTimeline | None:
        """A timeline writing to $FNVLLM_TIMELINE, or None when it is unset."""
        path = os.environ.get("FNVLLM_TIMELINE")
        return cls(path, header, device) if path else None

    def begin(self) -> _StepTimer:
        """Start timing one step (call at the top of ``execute``)."""
        return _StepTimer(self)

    def close(self) -> None:
        """Flush and close the file."""
        if self._file is not None:
            self._file.close()  # flushes
            self._file = None

    def summary(self) -> dict[str, Any]:
        """Mean gpu/cpu/gap ms of decode-only and mixed steps, and the totals."""
        out: dict[str, Any] = {"steps": len(self.records)}
        for kind, rows in (
            ("decode", [r for r in self.records if r["num_prefill_tokens"] == 0]),
            ("mixed", [r for r in self.records if r["num_prefill_tokens"] > 0]),
        ):
            if rows:
                out[kind] = {
                    "steps": len(rows),
                    **{
                        f"mean_{k}": round(sum(r[k] for r in rows) / len(rows), 3)
                        for k in ("gpu_ms", "cpu_ms", "gap_ms")
                    },
                    "total_gpu_s": round(sum(r["gpu_ms"] for r in rows) / 1e3, 3),
                }
        return out


class _StepTimer:
    """Timing of one step, between ``StepTimeline.begin`` and ``finish``."""

    def __init__(self, timeline: StepTimeline) -> None:
        self.timeline = timeline
        self.t_enter = time.perf_counter()
        self.t_wait: float | None = None
        self.host_ms = 0.0
        self.is_cuda = timeline.device.type == "cuda"
        self.start = self.end = None
        if self.is_cuda:
            self.start = timeline.event()
            self.end = timeline.event()
            self.start.record()

    def launched(self) -> None:
        """All device work of the step is enqueued: record the end event and the host time so far."""
        if self.end is not None:
            self.end.record()
        self.host_ms = (time.perf_counter() - self.t_enter) * 1e3

    def waiting(self) -> None:
        """The host starts waiting for the step's results."""
        self.t_wait = time.perf_counter()

    def finish(self, plan: StepPlan, graph: bool) -> None:
        """The step's results are on the host: write its record."""
        tl, now = self.timeline, time.perf_counter()
        t_wait = self.t_wait if self.t_wait is not None else self.t_enter + self.host_ms / 1e3
        cycle_ms = self.host_ms if tl._last_return is None else max(0.0, t_wait - tl._last_return) * 1e3
        outside_ms = 0.0 if tl._last_return is None else max(0.0, self.t_enter - tl._last_return) * 1e3
        if self.start is not None and self.end is not None:
            self.end.synchronize()
            gpu_ms = self.start.elapsed_time(self.end)
            gap_ms = 0.0 if tl._last_end is None else tl._last_end.elapsed_time(self.start)
            tl._spare_events.append(self.start)  # read: reusable
            if tl._last_end is not None:
                tl._spare_events.append(tl._last_end)
            tl._last_end = self.end
        else:
            gpu_ms, gap_ms = (now - self.t_enter) * 1e3, outside_ms
        record = {"step": plan.step, **step_shape(plan, graph_max_seqs=0).to_record()}  # graph: set below
        record.update(gpu_ms=round(gpu_ms, 4), cpu_ms=round(cycle_ms, 4), gap_ms=round(gap_ms, 4))
        record["graph"] = graph
        record["end_s"] = round(now - tl._created, 6)
        tl.write(record)
        tl._last_return = time.perf_counter()

"""Recorder: what a simulation notes per request and per step, cheaply enough for 100,000 requests.

Per request (indexed like the workload; NaN until it happens): arrival, first scheduled (the start of the step
that first admitted it), first token and finish (the end of the step that sampled them), tokens generated.
Per step: start and end time, device time, batch size and tokens, running / waiting requests and KV blocks in use
after the step. Inter-token latencies are kept as (seconds, count) pairs: in a decode step every sequence that
also got a token in the previous step has the same latency, so one pair covers the whole batch.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Protocol

from fnvllm.sim.cost import StepShape
from fnvllm.sim.workloads import SimRequest
from fnvllm.state import EngineState, StepOutput, StepPlan

_NAN = math.nan


class Clocked(Protocol):
    """An executor with a simulated clock, the last step's device time and the last plan's shape."""

    clock: float
    last_device_s: float
    last_shape: StepShape | None


class Recorder:
    """Collects per-request times and per-step samples of one simulation (see the module docstring)."""

    def __init__(self, requests: Sequence[SimRequest], num_blocks: int) -> None:
        n = len(requests)
        self.num_blocks = num_blocks
        self.arrival = [r.arrival_s for r in requests]
        self.prompt_len = [r.prompt_len for r in requests]
        self.output_len = [r.output_len for r in requests]
        self.first_scheduled = [_NAN] * n
        self.first_token = [_NAN] * n
        self.finish = [_NAN] * n
        self.num_output = [0] * n
        self.itl: list[tuple[float, int]] = []
        self.num_preemptions = self.num_hit_tokens = self.num_admitted_tokens = self.num_generated = 0
        self.step_start, self.step_end, self.device_s = array("d"), array("d"), array("d")
        self.num_seqs, self.num_tokens = array("l"), array("l")
        self.num_running, self.num_waiting, self.kv_blocks = array("l"), array("l"), array("l")
        self._last_token: dict[str, float] = {}
        self._last_emit = _NAN  # end of the last step that emitted tokens

    def step(
        self,
        before: EngineState,
        after: EngineState,
        plan: StepPlan,
        output: StepOutput,
        start: float,
        ex: Clocked,
        num_held: int = 0,
    ) -> int:
        """Note one committed step that began at ``start`` and ended at ``ex.clock``; returns how many requests
        finished in it. ``num_held``: arrived requests the loop has not added to the core yet (they wait too)."""
        end = ex.clock
        if after.waiting is not before.waiting:  # schedule hands back the same tuple when nothing was admitted
            self._admissions(before, after, plan, start)
        self.num_preemptions += len(plan.preempted)
        self._tokens(output, end)
        for f in output.finished:
            index = int(f.request_id)
            self.finish[index], self.num_output[index] = end, len(f.output)
            self._last_token.pop(f.request_id, None)
        self.step_start.append(start)
        self.step_end.append(end)
        self.device_s.append(ex.last_device_s)
        self.num_seqs.append(plan.num_seqs)
        self.num_tokens.append(ex.last_shape.num_tokens if ex.last_shape is not None and plan.num_seqs else 0)
        self.num_running.append(len(after.running))
        self.num_waiting.append(len(after.waiting) + num_held)
        self.kv_blocks.append(self.num_blocks - after.pool.num_free)
        return len(output.finished)

    def _admissions(self, before: EngineState, after: EngineState, plan: StepPlan, start: float) -> None:
        """First-scheduled times and prefix-cache hits of the requests admitted by ``plan`` (an admitted row
        starts after its cached prefix)."""
        admitted = _admitted(before.waiting, after.waiting, bool(plan.preempted))
        if not admitted:
            return
        rows = _plan_rows(plan, admitted)
        for rid in admitted:
            index, row = int(rid), rows[rid]
            if math.isnan(self.first_scheduled[index]):
                self.first_scheduled[index] = start
            self.num_hit_tokens += plan.start_positions[row]
            self.num_admitted_tokens += self.prompt_len[index] + plan.num_generated[row]

    def _tokens(self, output: StepOutput, end: float) -> None:
        """First-token times and inter-token latencies of the tokens emitted at ``end``."""
        ids = output.seq_ids
        if not ids:
            return
        self.num_generated += len(ids)
        lasts = list(map(self._last_token.get, ids))
        self._last_token.update(dict.fromkeys(ids, end))
        previous, self._last_emit = self._last_emit, end
        same = lasts.count(previous)  # the usual case: every row also got a token in the last emitting step
        if same:
            self.itl.append((end - previous, same))
        if same == len(ids):
            return
        for rid, last in zip(ids, lasts, strict=True):
            if last is None:
                self.first_token[int(rid)] = end
            elif last != previous:
                self.itl.append((end - last, 1))


def _admitted(before: tuple[str, ...], after: tuple[str, ...], preempted: bool) -> Sequence[str]:
    """The requests that left waiting. Admission takes a prefix of the queue and never shares a step with a
    preemption, so that prefix is read off in O(admitted); anything else falls back to a set difference."""
    k = len(before) - len(after)
    if not preempted and k > 0 and before[k : k + 1] == after[:1]:
        return before[:k]
    return tuple(set(before).difference(after))


def _plan_rows(plan: StepPlan, ids: Sequence[str]) -> dict[str, int]:
    """Row index in ``plan`` of each of ``ids``. Admitted rows are usually the plan's last rows, so those are
    tried first (O(admitted)) before a full scan."""
    k, n = len(ids), plan.num_seqs
    tail = dict(zip(plan.seq_ids[n - k :], range(n - k, n), strict=True))
    if len(tail) == k and all(rid in tail for rid in ids):
        return tail
    return {rid: i for i, rid in enumerate(plan.seq_ids)}

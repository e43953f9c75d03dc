"""Recorder: what a simulation notes per request and per step, cheaply enough for 100,000 requests.

Per request (indexed like the workload; NaN until it happens): arrival, first scheduled (the start of the step
that first admitted it), first token and finish (the end of the step that sampled them), tokens generated.
Per step: start and end time, device time, batch size and tokens, running / waiting requests and KV blocks in use
after the step. Inter-token latencies are kept as (seconds, count) pairs: in a decode step every sequence that
also got a token in the previous step has the same latency, so one pair covers the whole batch.

``RunRecorder`` is the other side: it records a real engine run (configuration, requests, steps) so that
``fnvllm simulate --check`` can replay it (``fnvllm.sim.check``).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

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

    def __init__(self, requests: Sequence[SimRequest], num_blocks: int, deferred: bool = False) -> None:
        n = len(requests)
        self.deferred = deferred  # a step's tokens reach the clients at the next step (served timing); see step
        self._pending: StepOutput | None = None
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
        after: EngineState,
        plan: StepPlan,
        output: StepOutput,
        start: float,
        ex: Clocked,
        num_held: int = 0,
    ) -> int:
        """Note one committed step that began at ``start`` and ended at ``ex.clock``; returns how many requests
        finished in it. ``num_held``: arrived requests the loop has not added to the core yet (they wait too).
        ``deferred``: the step's tokens are noted at the next step (or ``flush``), and the previous step's at
        ``ex.clock`` (when the served loop delivers them)."""
        end = ex.clock
        if plan.num_admitted:
            self._admissions(plan, start)
        self.num_preemptions += len(plan.preempted)
        if self.deferred:
            num_finished = self.flush(end)
            self._pending = output
        else:
            num_finished = self._emit(output, end)
        self.step_start.append(start)
        self.step_end.append(end)
        self.device_s.append(ex.last_device_s)
        self.num_seqs.append(plan.num_seqs)
        self.num_tokens.append(ex.last_shape.num_tokens if ex.last_shape is not None and plan.num_seqs else 0)
        self.num_running.append(len(after.running))
        self.num_waiting.append(len(after.waiting) + num_held)
        self.kv_blocks.append(self.num_blocks - after.pool.num_free)
        return num_finished

    def flush(self, end: float) -> int:
        """Note the tokens of the step held back (``deferred``) as emitted at ``end``; returns how many requests
        finished in it (0 when none was held)."""
        pending, self._pending = self._pending, None
        return self._emit(pending, end) if pending is not None else 0

    def _emit(self, output: StepOutput, end: float) -> int:
        """Note a step's tokens and finished requests as emitted at ``end``; returns how many finished."""
        self._tokens(output, end)
        for f in output.finished:
            index = int(f.request_id)
            self.finish[index], self.num_output[index] = end, len(f.output)
            self._last_token.pop(f.request_id, None)
        return len(output.finished)

    def delay_delivery(self, seconds: float, per_in_flight: float = 0.0) -> None:
        """Every request's tokens reach its client ``seconds`` + ``per_in_flight`` x (requests in flight when it
        arrived, ``in_flight_at_arrival``) after the step that emitted them (a server's own latency, which grows
        with the streams it serves): first-token and finish times move by it (TTFT and end-to-end latency grow;
        TPOT and ITL do not)."""
        for name, value in (("seconds", seconds), ("per_in_flight", per_in_flight)):
            if value < 0 or math.isnan(value):
                raise ValueError(f"{name} must be a number >= 0, got {value}")
        if per_in_flight:
            delays = [seconds + per_in_flight * n for n in self.in_flight_at_arrival()]
        else:
            delays = [seconds] * len(self.first_token)
        self.first_token = [t + d for t, d in zip(self.first_token, delays, strict=True)]
        self.finish = [t + d for t, d in zip(self.finish, delays, strict=True)]

    def in_flight_at_arrival(self) -> list[int]:
        """Per request, the requests running or waiting after the first step that ended at or after its arrival
        (0 when none did: it arrived to an idle engine after the last step)."""
        ends, running, waiting = self.step_end, self.num_running, self.num_waiting
        out = []
        for arrival in self.arrival:
            k = bisect.bisect_left(ends, arrival)
            out.append(running[k] + waiting[k] if k < len(ends) else 0)
        return out

    def _admissions(self, plan: StepPlan, start: float) -> None:
        """First-scheduled times and prefix-cache hits of the requests admitted by ``plan``
        (``StepPlan.admitted_starts``: an admitted row starts after its cached prefix)."""
        generated = plan.num_generated[plan.num_continuing :]
        for (rid, hit), num_generated in zip(plan.admitted_starts().items(), generated, strict=True):
            index = int(rid)
            if math.isnan(self.first_scheduled[index]):
                self.first_scheduled[index] = start
            self.num_hit_tokens += hit
            self.num_admitted_tokens += self.prompt_len[index] + num_generated

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


# ---- recording a real engine run, for `fnvllm simulate --check` -------------------------------------------------

RUN_CONFIG_FIELDS = (
    "block_size",
    "num_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
)


def run_path(timeline: str | Path) -> Path:
    """Where the run record of a timeline lives by default: ``steps.jsonl`` -> ``steps.run.json``."""
    return Path(timeline).with_suffix(".run.json")


class RunRecorder:
    """Records what a timeline lacks to replay an engine run in the simulator: the core's configuration, whether
    the loop overlapped its steps, the device's name, every request (arrival, prompt, max_tokens and the tokens it
    really generated) and, per step, its end time and its rows new since the step before.

    Use it beside ``FNVLLM_TIMELINE`` (the timeline has the per-step device and host times)::

        recorder = RunRecorder(llm.engine.config, llm.loop.overlap, torch.cuda.get_device_name())
        llm.loop.on_step = recorder.on_step
        recorder.arrive(prompts, [p.max_tokens for p in params])
        outputs = llm.generate(prompts, params)
        recorder.finish([len(o.token_ids) for o in outputs])
        recorder.write(run_path(timeline_path))

    ``model_name`` names the model in a profile fitted from the run. Times are seconds of ``clock``
    (``time.perf_counter`` by default) since the recorder was made. ``arrive`` may be called several times
    (requests arriving over time), ``finish`` once per ``arrive``, in order.
    """

    def __init__(
        self,
        config: Any,
        overlap: bool,
        device_name: str = "",
        clock: Callable[[], float] = time.perf_counter,
        keep_prompts: bool = True,
        model_name: str = "",
    ) -> None:
        self.config = {name: getattr(config, name) for name in RUN_CONFIG_FIELDS}
        self.model_name = model_name
        self.overlap, self.device_name, self.clock, self.keep_prompts = overlap, device_name, clock, keep_prompts
        self._start = clock()
        self.requests: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self._num_finished = 0

    def now(self) -> float:
        """Seconds since the recorder was made."""
        return self.clock() - self._start

    def arrive(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> None:
        """Requests that arrive now (in the order the engine gets them)."""
        t = self.now()
        for prompt, limit in zip(prompts, max_tokens, strict=True):
            request: dict[str, Any] = {"arrival_s": t, "prompt_len": len(prompt), "max_tokens": int(limit)}
            if self.keep_prompts:
                request["prompt"] = [int(i) for i in prompt]
            self.requests.append(request)

    def on_step(self, state: Any, plan: StepPlan, output: Any) -> None:
        """The engine loop's ``on_step`` hook: note the step's end and its new rows."""
        self.steps.append({"step": plan.step, "end_s": self.now(), "num_new_seqs": plan.num_admitted})

    def finish(self, output_lens: Sequence[int]) -> None:
        """Tokens generated by the requests of the earliest ``arrive`` not finished yet (in its order)."""
        first = self._num_finished
        if first + len(output_lens) > len(self.requests):
            raise ValueError(f"finish got {len(output_lens)} lengths; {len(self.requests) - first} requests remain")
        for request, n in zip(self.requests[first:], output_lens, strict=False):
            request["output_len"] = int(n)
        self._num_finished += len(output_lens)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values."""
        run = {"config": self.config, "overlap": self.overlap, "device_name": self.device_name}
        run["model_name"] = self.model_name
        return {"run": run, "requests": self.requests, "steps": self.steps}

    def write(self, path: str | Path) -> None:
        """Write the record as JSON."""
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

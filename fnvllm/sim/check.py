"""Check mode: replay a recorded engine run in the simulator and report how far the prediction is.

A run is a timeline (``FNVLLM_TIMELINE``: per-step device, host and gap times) plus its run record
(``RunRecorder``: configuration, loop mode, requests, and which steps belong to the run). ``check_run`` simulates
the same requests (same arrival times, prompts and generated lengths) under the same configuration with a
profile, and compares:

- end to end: the run's wall time (first arrival to the last step's end) against the simulated one;
- per step: each step's measured wall time (device + gap) against the simulated step of the same rank, when the
  simulator planned the same steps (same batch sizes, tokens, contexts), else only the totals;
- the cost model alone on the measured step shapes (``prediction_error``): the error left once scheduling
  differences are taken out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.sim.calibrate import prediction_error
from fnvllm.sim.checks import SimInputError, check_bool_field, check_count, check_mapping, check_real_in
from fnvllm.sim.cost import CostModel, StepShape
from fnvllm.sim.executor import SimExecutor
from fnvllm.sim.hardware import HardwareProfile
from fnvllm.sim.loop import simulate
from fnvllm.sim.model import ModelShape
from fnvllm.sim.recorder import RUN_CONFIG_FIELDS
from fnvllm.sim.timeline import header_model, read_timeline, record_new_seqs, record_shape
from fnvllm.sim.workloads import SimRequest
from fnvllm.state import CoreConfig, EngineState, StepOutput, StepPlan

__all__ = ["CheckResult", "RunRecord", "check_run", "fit_request_us", "format_check", "read_run", "run_records"]


@attrs.frozen
class RunRecord:
    """A run record as read back: core options, loop mode, device name, requests and steps (see RunRecorder)."""

    config: Mapping[str, Any]
    overlap: bool
    device_name: str
    requests: Sequence[Mapping[str, Any]]
    steps: Sequence[Mapping[str, Any]]
    model_name: str = ""


def read_run(path: str | Path) -> RunRecord:
    """A run record written by ``RunRecorder.write``; SimInputError naming what is missing or malformed."""
    try:
        data = check_mapping(json.loads(Path(path).read_text()), f"run record {path}")
        run = check_mapping(data["run"], "run")
        config = check_mapping(run["config"], "run config")
        missing = [k for k in RUN_CONFIG_FIELDS if k not in config]
        if missing:
            raise SimInputError(f"run config lacks {missing}")
        requests, steps = list(data["requests"]), list(data["steps"])
        for i, request in enumerate(requests):
            _check_request(check_mapping(request, f"request {i}"), i)
        for step in steps:
            check_count(check_mapping(step, "step")["step"], "step", 0, 1 << 62)
            check_real_in(step["end_s"], "step end_s", 0.0, 1e12)
        if not requests or not steps:
            raise SimInputError("the run holds no requests or no steps")
        overlap = check_bool_field(run["overlap"], "run overlap")
        names = (str(run.get("device_name", "")), str(run.get("model_name", "")))
        return RunRecord(dict(config), overlap, names[0], requests, steps, names[1])
    except (KeyError, TypeError) as e:
        raise SimInputError(f"run record {path} lacks or mistypes {e}") from None
    except json.JSONDecodeError as e:
        raise SimInputError(f"run record {path} is not JSON: {e}") from None


def _check_request(request: Mapping[str, Any], index: int) -> None:
    """SimInputError naming the field of a recorded request that is missing or out of range."""
    if "output_len" not in request:
        raise SimInputError(f"request {index} has no output_len (RunRecorder.finish was not called for it)")
    check_real_in(request["arrival_s"], f"request {index} arrival_s", 0.0, 1e12)
    check_count(request["prompt_len"], f"request {index} prompt_len", 1, 1 << 31)
    check_count(request["output_len"], f"request {index} output_len", 0, 1 << 31)


def run_records(records: Sequence[Mapping[str, Any]], run: RunRecord) -> list[dict[str, Any]]:
    """The timeline records of ``run``'s steps, in step order, each with the run's loop mode and its new rows.

    The first step's gap and host cycle are measured from the step before it, which may belong to another run
    (or be minutes earlier): they are cut to the time from the run's first arrival to that step's end, the part
    that belongs to this run."""
    by_step = {int(s["step"]): s for s in run.steps}
    chosen = [dict(r) for r in records if r.get("step") is not None and int(r["step"]) in by_step]
    chosen.sort(key=lambda r: int(r["step"]))
    for record in chosen:
        record["overlap"] = run.overlap
        record["num_new_seqs"] = int(by_step[int(record["step"])]["num_new_seqs"])
    if chosen:
        first = chosen[0]
        first["first_in_run"] = True  # its times hold the run's start-up: the fits leave it out
        since_arrival_ms = (float(by_step[int(first["step"])]["end_s"]) - _first_arrival(run)) * 1e3
        first["gap_ms"] = min(float(first.get("gap_ms", 0.0)), max(since_arrival_ms - float(first["gpu_ms"]), 0.0))
        if "cpu_ms" in first:
            first["cpu_ms"] = min(float(first["cpu_ms"]), max(since_arrival_ms, 0.0))
    return chosen


def _first_arrival(run: RunRecord) -> float:
    """When the run's first request arrived (the recorder's clock)."""
    return min(float(r["arrival_s"]) for r in run.requests)


def fit_request_us(
    runs: Sequence[tuple[RunRecord, Sequence[Mapping[str, Any]]]], model: ModelShape, profile: HardwareProfile
) -> float:
    """The host time to take in one request (``HardwareProfile.request_us``), from runs whose requests arrive
    together: the time from the arrival to the first step's end, less that step's predicted wall time, per
    request (least squares through 0, >= 0). ``runs``: each run with its ``run_records``. 0 without such runs."""
    cost = CostModel(model, profile)
    num, den = 0.0, 0.0
    for run, records in runs:
        t0 = _first_arrival(run)
        burst = sum(1 for r in run.requests if float(r["arrival_s"]) == t0)
        if not records or burst < 2:
            continue
        first = records[0]
        end = next(float(s["end_s"]) for s in run.steps if int(s["step"]) == int(first["step"]))
        shape = record_shape(first)
        setup_us = ((end - t0) - cost.wall_s(shape, record_new_seqs(first), False)) * 1e6  # after idle: plain
        num, den = num + setup_us * burst, den + burst * burst
    return max(num / den, 0.0) if den else 0.0


@attrs.frozen
class CheckResult:
    """The comparison of one run: wall seconds measured and predicted, whether the simulator planned the engine's
    steps, per-step error statistics, and the cost model alone on the measured shapes."""

    measured_s: float
    predicted_s: float
    num_requests: int
    num_steps: int
    num_predicted_steps: int
    same_plans: str
    step_errors: Mapping[str, float]
    cost_model_only: Mapping[str, float]

    @property
    def error(self) -> float:
        """Relative end-to-end error (predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s else 0.0


def check_run(
    timeline: str | Path, run_file: str | Path, profile: HardwareProfile, model: ModelShape | None = None
) -> CheckResult:
    """Replay ``run_file``'s run with ``profile`` and compare with ``timeline`` (see the module docstring)."""
    header, records = read_timeline(timeline)
    run = read_run(run_file)
    model = model if model is not None else header_model(header)
    measured_steps = run_records(records, run)
    if not measured_steps:
        raise SimInputError(f"{timeline} holds none of the run's steps (is it the run's timeline?)")
    t0 = _first_arrival(run)
    requests = [_sim_request(r, t0) for r in run.requests if int(r["output_len"]) > 0]
    requests.sort(key=lambda r: r.arrival_s)
    config = CoreConfig(**{k: run.config[k] for k in RUN_CONFIG_FIELDS}, vocab_size=model.vocab)
    executor = SimExecutor(CostModel(model, profile, run.overlap))
    predicted: list[tuple[StepShape, float]] = []

    def on_step(state: EngineState, plan: StepPlan, output: StepOutput) -> None:
        if not plan.is_empty and executor.last_shape is not None:
            predicted.append((executor.last_shape, executor.last_device_s + executor.last_gap_s))

    result = simulate(requests, config, executor, on_step=on_step)
    measured = max(float(s["end_s"]) for s in run.steps) - t0
    same = same_plans(measured_steps, [shape for shape, _ in predicted])
    errors = _step_errors(measured_steps, [wall for _, wall in predicted]) if same == "yes" else {}
    return CheckResult(
        measured_s=measured,
        predicted_s=result.end_s,
        num_requests=len(requests),
        num_steps=len(measured_steps),
        num_predicted_steps=len(predicted),
        same_plans=same,
        step_errors=errors,
        cost_model_only=prediction_error(measured_steps, model, profile),
    )


def _sim_request(request: Mapping[str, Any], t0: float) -> SimRequest:
    """A recorded request as the simulator's: its arrival since the first, its prompt, its generated length."""
    prompt = request.get("prompt")
    return SimRequest(
        float(request["arrival_s"]) - t0,
        int(request["prompt_len"]),
        int(request["output_len"]),
        prompt=tuple(prompt) if prompt is not None else None,
    )


def same_plans(measured: Sequence[Mapping[str, Any]], predicted: Sequence[StepShape]) -> str:
    """ "yes", or where the simulated steps first differ from the engine's (batch, tokens, decodes, context)."""
    keys = ("num_seqs", "num_tokens", "num_decode_seqs", "context_tokens")
    for i, (record, shape) in enumerate(zip(measured, predicted, strict=False)):
        if any(int(record[k]) != getattr(shape, k) for k in keys):
            return f"no: step {i} differs (engine {[record[k] for k in keys]}, simulator {shape})"
    if len(measured) != len(predicted):
        return f"no: engine {len(measured)} steps, simulator {len(predicted)}"
    return "yes"


def _step_errors(measured: Sequence[Mapping[str, Any]], predicted_wall: Sequence[float]) -> dict[str, float]:
    """Mean, mean absolute, p50, p90 and max absolute relative error of each step's wall time."""
    errors = []
    for record, wall in zip(measured, predicted_wall, strict=True):
        m = (float(record["gpu_ms"]) + float(record.get("gap_ms", 0.0))) / 1e3
        if m > 0:
            errors.append((wall - m) / m)
    if not errors:
        return {}
    a = sorted(abs(e) for e in errors)

    def pick(q: float) -> float:
        return a[min(len(a) - 1, math.floor(q * len(a)))]

    return {
        "mean": sum(errors) / len(errors),
        "mean_abs": sum(a) / len(a),
        "p50_abs": pick(0.5),
        "p90_abs": pick(0.9),
        "max_abs": a[-1],
    }


def format_check(result: CheckResult, label: str = "") -> str:
    """The comparison as a few lines of text."""
    c = result.cost_model_only
    lines = [
        f"{label + ': ' if label else ''}{result.num_requests} requests, {result.num_steps} steps measured, "
        f"{result.num_predicted_steps} simulated",
        f"end to end: measured {result.measured_s:.3f} s, predicted {result.predicted_s:.3f} s ({result.error:+.1%})",
        f"simulator planned the engine's steps: {result.same_plans}",
    ]
    e = result.step_errors
    if e:
        lines.append(
            f"per-step wall error: mean {e['mean']:+.1%}, mean |err| {e['mean_abs']:.1%}, p50 {e['p50_abs']:.1%}, "
            f"p90 {e['p90_abs']:.1%}, max {e['max_abs']:.1%}"
        )
    lines.append(
        f"cost model on the measured steps: {c['predicted_s']:.3f} s vs {c['measured_s']:.3f} s "
        f"({c['total_error']:+.1%}), mean per-step error {c['mean_step_error']:.1%}"
    )
    return "\n".join(lines)

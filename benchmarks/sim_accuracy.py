"""The simulator's accuracy target: fit a profile on one workload's GPU timeline, predict another's bench time.

    python benchmarks/sim_accuracy.py OUT_DIR [--base h200] [--out-dir DIR] [--json result.json]

OUT_DIR holds what ``benchmarks/sim_h200_check.sh`` writes: for runs A and B, ``RUN.jsonl`` (the engine's
timeline under FNVLLM_TIMELINE), ``RUN.json`` (the ``fnvllm bench --json`` record) and ``RUN.flags`` (its bench
flags). For each direction (fit A -> predict B, the target; and fit B -> predict A):

1. Fit a profile on the fitting run's whole timeline, as ``fnvllm simulate calibrate RUN.jsonl --base BASE`` does.
2. Simulate the predicted run end to end with that profile: the same requests (``fnvllm.workloads``' draw), the
   same engine options (the bench's flags and defaults, its num_blocks), and ``run_bench``'s 4-request warm-up
   first (its prompts are the workload's first four, so the timed run starts with their blocks in the prefix
   cache, as in the engine). The timed requests arrive ``IDLE_GAP_S`` after the warm-up's, so the timed part is
   the simulated time from that arrival to the end.
3. Print measured vs predicted: the bench's wall seconds (the target's number), the timeline's sum of device time
   and gaps over the timed steps, the prediction and its error; whether the simulator planned exactly the
   engine's steps (same batch sizes, tokens and contexts); per-step error statistics (device + gap, by kind);
   and the profile's error on the measured step shapes alone (``prediction_error``: cost model only).

The timed steps of a timeline are its last ``steps`` records by step index (``RUN.json``'s count; the warm-up's
steps come first in the file). Imports no torch: it runs on the development machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.sim import CostModel, HardwareProfile, SimExecutor, SimRequest, fit_profile, prediction_error, simulate
from fnvllm.sim.cost import StepShape
from fnvllm.sim.hardware import load_profile, save_profile
from fnvllm.sim.model import ModelShape
from fnvllm.sim.timeline import header_model, read_timeline
from fnvllm.state import CoreConfig, EngineState, StepOutput, StepPlan
from fnvllm.workloads import bench_workload

RUNS = ("A", "B")
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 8  # run_bench's warm-up: the first 4 prompts, 8 tokens each
IDLE_GAP_S = 1e4  # the timed requests arrive this long after t=0 (the warm-up takes well under a second)
# Base profile for a CPU dry run (its "roofline" only gives the fit columns shaped like the work).
CPU = HardwareProfile(name="cpu-dev", mem_bandwidth_gbs=10.0, matmul_tflops=0.08, memory_gib=8.0, graph_max_seqs=0)


@attrs.frozen
class Run:
    """One engine run: its timeline (all records, and the timed ones), bench record, bench flags and model."""

    name: str
    header: Mapping[str, Any]
    records: Sequence[Mapping[str, Any]]
    timed: Sequence[Mapping[str, Any]]
    bench: Mapping[str, Any]
    flags: argparse.Namespace
    model: ModelShape


@attrs.frozen
class Prediction:
    """The simulated timed part of a run: per-step shapes, device and gap seconds, and the total."""

    shapes: Sequence[StepShape]
    device_s: Sequence[float]
    gap_s: Sequence[float]
    total_s: float


def bench_flags(text: str) -> argparse.Namespace:
    """``text`` (the words after ``fnvllm bench``) parsed by the bench's own parser, defaults included and the
    shape-dependent ones resolved as the bench resolves them; the engine flags (``ec_<field>``) also under their
    field names (``block_size``, ``max_num_seqs`` ...)."""
    from fnvllm.cli import bench

    parser = argparse.ArgumentParser(prog="fnvllm")
    bench.register(parser.add_subparsers())
    flags = parser.parse_args(["bench", *text.split()])
    bench.resolve_workload(flags)
    for name, value in list(vars(flags).items()):
        if name.startswith("ec_"):
            setattr(flags, name.removeprefix("ec_"), value)
    return flags


def load_run(folder: Path, name: str) -> Run:
    """Run ``name`` of ``folder``; ValueError naming a missing or empty file."""
    for suffix in ("jsonl", "json", "flags"):
        if not (folder / f"{name}.{suffix}").is_file():
            raise ValueError(f"{folder / f'{name}.{suffix}'} is missing (run benchmarks/sim_h200_check.sh)")
    header, records = read_timeline(folder / f"{name}.jsonl")
    lines = (folder / f"{name}.json").read_text().strip().splitlines()
    if not lines:
        raise ValueError(f"{folder / f'{name}.json'} is empty: the bench run failed (see {name}.log)")
    bench = json.loads(lines[-1])
    last = max(int(r["step"]) for r in records)
    timed = [r for r in records if int(r["step"]) > last - int(bench["steps"])]
    flags = bench_flags((folder / f"{name}.flags").read_text())
    return Run(name, header, records, timed, bench, flags, header_model(header, name=flags.model_shape))


def core_config(run: Run) -> CoreConfig:
    """The engine's scheduling options of ``run``: the bench's flags, ``run_bench``'s max_model_len rule, the
    engine's num_blocks, and EngineConfig's default prefix caching (the bench has no flag for it)."""
    f = run.flags
    max_len = f.max_model_len or min(run.model.max_len, max(4096, f.max_input_len + f.max_output_len))
    return CoreConfig(
        block_size=f.block_size,
        num_blocks=int(run.bench["num_blocks"]),
        max_num_batched_tokens=f.max_num_batched_tokens,
        max_num_seqs=f.max_num_seqs,
        max_model_len=max_len,
        enable_prefix_caching=True,
        vocab_size=run.model.vocab,
    )


def bench_requests(run: Run) -> list[SimRequest]:
    """The warm-up requests at t=0, then the bench workload at IDLE_GAP_S (all with their explicit prompts)."""
    f = run.flags
    prompts, params = bench_workload(f.num_requests, f.max_input_len, f.max_output_len)
    warmup = [SimRequest(0.0, len(p), WARMUP_TOKENS, prompt=tuple(p)) for p in prompts[:WARMUP_REQUESTS]]
    timed = [
        SimRequest(IDLE_GAP_S, len(p), s.max_tokens, prompt=tuple(p)) for p, s in zip(prompts, params, strict=True)
    ]
    return warmup + timed


def predict(run: Run, profile: HardwareProfile) -> Prediction:
    """Simulate ``run``'s workload with ``profile``; the steps that start at or after IDLE_GAP_S."""
    executor = SimExecutor(CostModel(run.model, profile))
    steps: list[tuple[StepShape, float, float]] = []

    def on_step(state: EngineState, plan: StepPlan, output: StepOutput) -> None:
        # a step that ends after IDLE_GAP_S began there or later: the warm-up ended long before, then the clock jumped
        if not plan.is_empty and executor.last_shape is not None and executor.clock > IDLE_GAP_S:
            steps.append((executor.last_shape, executor.last_device_s, executor.last_gap_s))

    result = simulate(bench_requests(run), core_config(run), executor, on_step=on_step)
    shapes, device, gap = zip(*steps, strict=True) if steps else ((), (), ())
    return Prediction(shapes, device, gap, result.end_s - IDLE_GAP_S)


def same_plans(measured: Sequence[Mapping[str, Any]], predicted: Sequence[StepShape]) -> str:
    """ "yes", or where the simulated steps first differ from the engine's (batch, tokens, context, pairs)."""
    keys = ("num_seqs", "num_tokens", "num_decode_seqs", "context_tokens")
    for i, (record, shape) in enumerate(zip(measured, predicted, strict=False)):
        if any(int(record[k]) != getattr(shape, k) for k in keys):
            return f"no: timed step {i} differs (engine {[record[k] for k in keys]}, simulator {shape})"
    if len(measured) != len(predicted):
        return f"no: engine {len(measured)} timed steps, simulator {len(predicted)}"
    return "yes"


def _stats(errors: Sequence[float]) -> str:
    """Mean absolute, median, p90 and max of relative errors, as text."""
    if not errors:
        return "none"
    a = sorted(abs(e) for e in errors)
    pick = lambda q: a[min(len(a) - 1, math.floor(q * len(a)))]  # noqa: E731
    mean = sum(errors) / len(errors)
    spread = f"p50 {pick(0.5):.1%}, p90 {pick(0.9):.1%}, max {a[-1]:.1%}"
    return f"mean |err| {sum(a) / len(a):.1%} (mean {mean:+.1%}), {spread}"


def step_errors(measured: Sequence[Mapping[str, Any]], p: Prediction) -> dict[str, str]:
    """Per-step relative error of device + gap time, over all steps and by kind (when the plans line up)."""
    out: dict[str, list[float]] = {"all": [], "graph": [], "eager": []}
    for record, device, gap in zip(measured, p.device_s, p.gap_s, strict=False):
        m = (float(record["gpu_ms"]) + float(record.get("gap_ms", 0.0))) / 1e3
        if m > 0:
            error = (device + gap - m) / m
            out["all"].append(error)
            out["graph" if record["graph"] else "eager"].append(error)
    return {f"{kind} ({len(v)} steps)": _stats(v) for kind, v in out.items()}


def base_profile(name: str, run: Run) -> HardwareProfile:
    """``--base``: "auto" is the H200 profile for a CUDA timeline and the CPU one otherwise."""
    if name != "auto":
        return load_profile(name)
    return load_profile("h200") if str(run.header.get("device", "")).startswith("cuda") else CPU


def check(fit: Run, target: Run, base: HardwareProfile, out_dir: Path) -> dict[str, Any]:
    """Fit on ``fit``, predict ``target``; prints the report and returns its numbers."""
    profile = fit_profile(fit.records, fit.model, base, source=f"{fit.name}.jsonl")
    path = out_dir / f"profile_{fit.name}.json"
    save_profile(profile, path)
    p = predict(target, profile)
    wall = float(target.bench["seconds"])
    timeline_s = sum((float(r["gpu_ms"]) + float(r.get("gap_ms", 0.0))) / 1e3 for r in target.timed)
    shapes_only = prediction_error(target.timed, target.model, profile)
    result = {
        "fit": fit.name,
        "predicted_run": target.name,
        "profile": str(path),
        "measured_bench_s": wall,
        "measured_timeline_s": timeline_s,
        "predicted_s": p.total_s,
        "error_vs_bench": (p.total_s - wall) / wall,
        "error_vs_timeline": (p.total_s - timeline_s) / timeline_s,
        "same_plans": same_plans(target.timed, p.shapes),
        "step_errors": step_errors(target.timed, p),
        "cost_model_only": shapes_only,
    }
    _print(result, fit, target)
    return result


def _print(r: Mapping[str, Any], fit: Run, target: Run) -> None:
    print(
        f"\n== fit on {fit.name} ({len(fit.records)} steps) -> predict {target.name} ({len(target.timed)} timed steps)"
    )
    print(f"   profile: {r['profile']} (same as `fnvllm simulate calibrate {fit.name}.jsonl --base ...`)")
    print(
        f"   measured: bench {r['measured_bench_s']:.3f} s wall, timeline {r['measured_timeline_s']:.3f} s "
        f"(device + gaps)\n   predicted: {r['predicted_s']:.3f} s -> error {r['error_vs_bench']:+.2%} vs bench, "
        f"{r['error_vs_timeline']:+.2%} vs timeline"
    )
    print(f"   simulator planned the engine's steps: {r['same_plans']}")
    for kind, text in r["step_errors"].items():
        print(f"   per-step error, {kind}: {text}")
    c = r["cost_model_only"]
    print(
        f"   cost model on the measured shapes: {c['predicted_s']:.3f} s vs {c['measured_s']:.3f} s "
        f"({c['total_error']:+.2%}), mean per-step error {c['mean_step_error']:.1%}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Both directions, A -> B first (the target)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="the $OUT of benchmarks/sim_h200_check.sh")
    parser.add_argument("--base", default="auto", help="base profile: auto (h200 on CUDA, else CPU), h200, a JSON")
    parser.add_argument("--out-dir", default=None, help="where the fitted profiles go (default: a temp folder)")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="fnvllm-simacc-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        runs = {name: load_run(folder, name) for name in RUNS}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a, b = runs["A"], runs["B"]
    for run in (a, b):
        bench = run.bench
        print(f"{run.name}: bench {bench['requests']} requests, {bench['seconds']} s, {bench['steps']} steps,")
        print(f"   num_blocks {bench['num_blocks']}, device {run.header.get('device')}, model {run.model}")
    results = [check(a, b, base_profile(args.base, a), out_dir), check(b, a, base_profile(args.base, b), out_dir)]
    target = results[0]["error_vs_bench"]
    verdict = "met (<= 5 %)" if abs(target) <= 0.05 else "met at 10 %" if abs(target) <= 0.10 else "NOT met"
    print(f"\nTARGET (fit on A, predict the bench B): {target:+.2%} vs the bench's wall time: {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

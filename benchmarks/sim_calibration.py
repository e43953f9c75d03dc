"""The simulator's calibration set: run the engine across regimes, fit a profile, print the error per regime.

    PYTHONPATH=$PWD python3 benchmarks/sim_calibration.py --out /tmp/cal [--model-shape qwen3-0.6b]
    PYTHONPATH=$PWD python3 benchmarks/sim_calibration.py --out /tmp/cal --model-shape tiny --quick   # CPU dry run

One engine (a random checkpoint of the shape, ``fnvllm bench``'s engine options) runs every regime of the set
back to back under one FNVLLM_TIMELINE, each with a ``RunRecorder`` (``REGIME.run.json``: its requests, loop mode
and steps):

    decode-N   N in 1, 16, 64, 256 requests: prompts U(100, 300), outputs U(200, 400)   (host-bound at low N)
    prefill-N  N in 16, 64, 512 requests: prompts U(1000, 2000), outputs U(4, 16)       (FLOP-bound, mixed steps)
    long-128   128 requests: prompts U(3000, 3900), outputs U(4, 16)                   (attention-heavy prefill)
    bench      the nano-vllm bench (256 requests, prompts and outputs U(100, 1024))

each with overlapped steps and without (``-plain``). Then it fits a profile on every run's steps
(``fit_profile``: device, host-cycle and plain-gap models; named after the GPU, recording the model) and replays
every run in the simulator (``fnvllm simulate --check``), printing per regime the measured and predicted wall
time and the error: with the fitted profile, with that regime's runs held out of the fit (the honest number:
the fit must carry across regimes, not memorise them), and with the built-in ``h200`` profile. Last, a table.

With ``--served DIR`` (a served run written by ``benchmarks/sim_serve_check.py --out DIR``), the profile also gets
its ``serving`` section, fitted on that run's timeline and latencies, and the served TTFT / TPOT errors are printed
(``fnvllm simulate --serve`` uses it). The whole fit is one CPU command once both folders exist:

    PYTHONPATH=$PWD python3 benchmarks/sim_calibration.py --out /tmp/cal --refit --served /tmp/serve

Writes to --out: steps.jsonl (the timeline), REGIME.run.json, profile.json (the fitted profile: ship it as the
``h200`` profile in fnvllm/sim/hardware.py when the error is good), report.json. About 2-3 minutes on an H200
for the Qwen3-0.6B shape (writing the checkpoint, CUDA-graph capture, ~1 minute of runs, the fits and replays).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from fnvllm.sim import HardwareProfile, ModelShape, fit_profile, load_profile, save_profile
from fnvllm.sim.calibrate import base_for, device_profile_name
from fnvllm.sim.check import CheckResult, RunRecord, check_run, fit_request_us, read_run, run_records
from fnvllm.sim.hardware import PrecisionOverheads, builtin_for_device, precision_key
from fnvllm.sim.recorder import RunRecorder
from fnvllm.sim.timeline import header_model, read_timeline

DECODE = ((100, 300), (200, 400))  # (prompt range, output range)
PREFILL = ((1000, 2000), (4, 16))
LONG = ((3000, 3900), (4, 16))  # long prompts: a prefill step's attention grows with their square
BENCH = ((100, 1024), (100, 1024))


@attrs.frozen
class Regime:
    """One calibration run: a name, its requests' count and length ranges, and the loop mode."""

    name: str
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    overlap: bool

    @property
    def family(self) -> str:
        """The regime without its loop mode (what a held-out fit leaves out: both modes)."""
        return self.name.removesuffix("-plain")


def regimes(quick: bool) -> list[Regime]:
    """The calibration set; ``quick`` (a CPU dry run): a few small requests per regime, short lengths."""
    families = [(f"decode-{n}", n, *DECODE) for n in (1, 16, 64, 256)]
    families += [(f"prefill-{n}", n, *PREFILL) for n in (16, 64, 512)]
    families.append(("long-128", 128, *LONG))
    families.append(("bench", 256, *BENCH))
    out = []
    for name, n, prompts, outputs in families:
        if quick:
            n, prompts, outputs = min(n, 6), (prompts[0] // 20 + 2, prompts[1] // 20 + 4), (2, outputs[1] // 40 + 3)
        out += [Regime(name, n, prompts, outputs, True), Regime(f"{name}-plain", n, prompts, outputs, False)]
    return out


WARM_UP_TOKENS = 16  # outputs of the untimed warm-up run of each regime (its prefill shapes and first decodes)


def regime_requests(regime: Regime, rng: random.Random, vocab: int) -> tuple[list[list[int]], list[Any]]:
    """The prompts (random ids) and sampling params of one regime, drawn from ``rng``."""
    from fnvllm.state import SamplingParams

    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(*regime.prompt_range))] for _ in range(regime.num_requests)
    ]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(*regime.output_range)) for _ in prompts
    ]
    return prompts, params


def warm_up(llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], vocab: int) -> None:
    """Run a regime's shapes once, untimed: prompts of the same lengths (other ids, so the timed run finds nothing
    in the prefix cache) and at most WARM_UP_TOKENS outputs. A new step shape can cost a compile (seen on the H200:
    0.56 s and 1.3 s in the first step of the first two regimes run), which a warm engine does not pay."""
    shifted = [[(i + 1) % vocab for i in prompt] for prompt in prompts]
    short = [attrs.evolve(p, max_tokens=min(p.max_tokens, WARM_UP_TOKENS)) for p in params]
    llm.generate(shifted, short, use_tqdm=False)


def run_regimes(
    llm: Any, set_: Sequence[Regime], out: Path, device_name: str, model_name: str, seed: int = 0
) -> list[Path]:
    """Run each regime on ``llm`` with a RunRecorder, after an untimed warm-up of its shapes (``warm_up``);
    returns the run record paths. Prompts are random ids from each regime's own seed, so no regime hits another's
    prefix cache."""
    from fnvllm.executor.base import supports_overlap

    vocab = llm.model_config.vocab_size
    paths = []
    for index, regime in enumerate(set_):
        prompts, params = regime_requests(regime, random.Random(seed * 1000 + index), vocab)
        while llm.loop.has_unfinished:  # nothing in flight when the loop mode changes
            llm.loop.step()
        llm.loop.overlap = regime.overlap and supports_overlap(llm.executor)
        warm_up(llm, prompts, params, vocab)
        # random prompts share no prefix: the replay's own unique prompts behave the same, and the files stay small
        recorder = RunRecorder(
            llm.engine.config, llm.loop.overlap, device_name, keep_prompts=False, model_name=model_name
        )
        llm.loop.on_step = recorder.on_step
        start = time.perf_counter()
        recorder.arrive(prompts, [p.max_tokens for p in params])
        outputs = llm.generate(prompts, params, use_tqdm=False)
        recorder.finish([len(o.token_ids) for o in outputs])
        llm.loop.on_step = None
        path = out / f"{regime.name}.run.json"
        recorder.write(path)
        paths.append(path)
        print(
            f"ran {regime.name}: {len(prompts)} requests, {len(recorder.steps)} steps, "
            f"{time.perf_counter() - start:.2f} s, overlap {llm.loop.overlap}",
            flush=True,
        )
    return paths


def build_engine(shape: str, folder: Path, quick: bool, load_format: str = "auto", **precision: Any) -> Any:
    """An LLM of a random checkpoint of ``shape`` with ``fnvllm bench``'s engine options (smaller on CPU) and
    ``precision`` (``kv_cache_dtype``, ``quantization``: the engine's options); ``load_format`` "dummy": only the
    checkpoint's config is written and the engine fills the weights (no 16 GB write for the Qwen3-8B shape)."""
    from fnvllm.bench import write_checkpoint
    from fnvllm.llm import LLM
    from fnvllm.state import SamplingParams

    checkpoint = write_checkpoint(shape, folder, config_only=load_format == "dummy")
    options: dict[str, Any] = {"block_size": 256, "max_num_batched_tokens": 16384, "max_num_seqs": 512}
    if load_format != "auto":
        options["load_format"] = load_format
    options["max_model_len"] = 4096
    options.update(precision)
    if quick:
        options.update(block_size=16, max_num_batched_tokens=512, max_num_seqs=64, max_model_len=512)
    llm = LLM(checkpoint, load_tokenizer=False, **options)
    warm = [[1, 2, 3, 4, 5] * 4] * 4
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # graphs, kernels, caches
    return llm


def fit_and_check(
    out: Path, runs: Sequence[Path], set_: Sequence[Regime], device_name: str, pooled: Sequence[Path] = ()
) -> list[dict[str, Any]]:
    """Fit the profile on every run (and once per held-out family), replay every run; returns the report rows.
    ``pooled``: folders of earlier runs of this script (the same engine) whose runs join the fit and the checks
    (their rows carry ``run`` 1, 2, ...; out's 0): the GPU machine's host speed varies between runs, so a profile
    fitted on runs of several is not tied to one run's host."""
    header, records = read_timeline(out / "steps.jsonl")
    model = header_model(header, name=read_run(runs[0]).model_name or "model")
    device = device_name or str(header.get("device", ""))
    base = base_for(device)
    name = device_profile_name(device)
    checked = [(0, regime, path, out / "steps.jsonl") for regime, path in zip(set_, runs, strict=True)]
    for k, folder in enumerate(pooled, start=1):
        present = [r for r in set_ if (folder / f"{r.name}.run.json").exists()]
        checked += [(k, r, folder / f"{r.name}.run.json", folder / "steps.jsonl") for r in present]
    timelines = {out / "steps.jsonl": records}
    for folder in pooled:
        pooled_header, timelines[folder / "steps.jsonl"] = read_timeline(folder / "steps.jsonl")
        other = header_model(pooled_header)
        if (other.kv_cache_dtype, other.quantization) != (model.kv_cache_dtype, model.quantization):
            raise ValueError(f"--pool {folder} ran at another precision than {out}: fit it with --precision-of")
    run_data = {path: read_run(path) for _, _, path, _ in checked}
    chosen = {path: run_records(timelines[timeline], run_data[path]) for _, _, path, timeline in checked}
    profile = _fit(list(run_data.items()), chosen, model, base, name, exclude=None)
    save_profile(attrs.evolve(profile, calibrated_from=str(out / "steps.jsonl")), out / "profile.json")
    builtin = load_profile(builtin_name(device))
    families = {r.family: r for r in set_}  # one fit per family: a regime and its -plain twin leave out the same runs
    if len(families) < 2:  # nothing left to fit on without it: the held-out column repeats the fit (said below)
        print("held-out fits need two regime families or more; the held-out column is the fit itself")
    held_out = {
        family: _fit(list(run_data.items()), chosen, model, base, f"{name}-without-{family}", regime)
        if len(families) > 1
        else profile
        for family, regime in families.items()
    }
    rows = []
    for k, regime, path, timeline in checked:
        results = {
            "fitted": check_run(timeline, path, profile, model),
            "held_out": check_run(timeline, path, held_out[regime.family], model),
            "builtin": check_run(timeline, path, builtin, model),
        }
        rows.append({**_row(regime, results), "run": k})
    return rows


def fit_precision(
    folder: Path, set_: Sequence[Regime], device_name: str
) -> tuple[str, PrecisionOverheads, list[dict[str, Any]]]:
    """Fit and check the runs of ``folder`` (this script's --out of a run at another precision: FP8 cache and/or
    weights, as its timeline's header says) as ``fit_and_check`` does; returns the precision's key, its fitted
    overheads and the report rows."""
    header, _ = read_timeline(folder / "steps.jsonl")
    model = header_model(header)
    key = precision_key(model.kv_cache_dtype, model.quantization)
    if key is None:
        raise ValueError(f"{folder}'s runs are at the model's dtype: not another precision")
    present = [r for r in set_ if (folder / f"{r.name}.run.json").exists()]
    rows = fit_and_check(folder, [folder / f"{r.name}.run.json" for r in present], present, device_name)
    fitted = load_profile(folder / "profile.json")
    entry = PrecisionOverheads(fitted.eager, fitted.graph, str(folder / "steps.jsonl"))
    return key, entry, rows


def check_folders(profile: HardwareProfile, folders: Sequence[Path], set_: Sequence[Regime]) -> list[dict[str, Any]]:
    """Replay every run of ``set_`` found in ``folders`` (this script's --out folders) with ``profile``, no fit:
    each folder's runs priced with the model of its own timeline's header (its precision included: a bf16 fit
    checked on FP8 runs is an out-of-sample test of the cost model's FP8 terms). Rows as ``fit_and_check``'s, with
    ``run`` the folder's index and ``checked`` its error."""
    rows = []
    for k, folder in enumerate(folders):
        header, _ = read_timeline(folder / "steps.jsonl")
        present = [r for r in set_ if (folder / f"{r.name}.run.json").exists()]
        for regime in present:
            path = folder / f"{regime.name}.run.json"
            model = header_model(header, name=read_run(path).model_name or "model")
            result = check_run(folder / "steps.jsonl", path, profile, model)
            rows.append({**_row(regime, {"checked": result}), "run": k})
    return rows


def print_checks(rows: Sequence[dict[str, Any]], profile: HardwareProfile, folders: Sequence[Path]) -> None:
    """``check_folders``' rows, one line each (``regime@k``: the k-th folder's), and the worst |error| of each
    folder."""
    print(f"\nprofile {profile.name!r} ({profile.calibrated_from or 'built in'}) replaying {len(rows)} runs")
    print(f"{'regime':<22} {'reqs':>5} {'steps':>6} {'measured s':>10} {'predicted':>10} {'error':>7} {'plans':>5}")
    for r in rows:
        print(
            f"{r['regime'] + '@' + str(r['run']):<22} {r['requests']:>5} {r['steps']:>6} {r['measured_s']:>10.3f} "
            f"{r['checked_s']:>10.3f} {r['checked_error']:>+7.1%} {'same' if r['same_plans'] else 'diff':>5}"
        )
    for k, folder in enumerate(folders):
        errors = [abs(r["checked_error"]) for r in rows if r["run"] == k]
        if errors:
            print(f"worst |error| of {folder}: {max(errors):.1%} over {len(errors)} runs")


def _fit(
    runs: Sequence[tuple[Path, RunRecord]],
    chosen: dict[Path, list[dict[str, Any]]],
    model: ModelShape,
    base: HardwareProfile,
    name: str,
    exclude: Regime | None,
) -> HardwareProfile:
    """The profile fitted on every run but ``exclude``'s family: step overheads, then request intake time."""
    kept = [(path, run) for path, run in runs if exclude is None or not _same_family(path, exclude)]
    records = [r for path, _ in kept for r in chosen[path]]
    profile = fit_profile(records, model, base, name=name)
    profile = attrs.evolve(profile, **engine_graph_limits(profile, runs[0][1].config))
    request_us = fit_request_us([(run, chosen[path]) for path, run in kept], model, profile)
    return attrs.evolve(profile, request_us=request_us)


def engine_graph_limits(profile: HardwareProfile, config: Mapping[str, Any]) -> dict[str, int]:
    """The CUDA-graph limits of the engine that ran (its config: graphs for decode steps up to max_num_seqs rows,
    and mixed steps up to the engine's default mixed_graph_tokens within the token budget), where the fit saw
    smaller ones (the regimes reach 256 rows, and mixed graphs only now and then); nothing for an engine that ran
    no graphs, or no mixed ones."""
    from fnvllm.config import EngineConfig

    if not profile.graph_max_seqs:
        return {}
    limits = {"graph_max_seqs": max(profile.graph_max_seqs, int(config["max_num_seqs"]))}
    if profile.graph_mixed_tokens:
        default = int(attrs.fields(EngineConfig).mixed_graph_tokens.default)
        mixed = min(default, int(config["max_num_batched_tokens"]))
        limits["graph_mixed_tokens"] = max(profile.graph_mixed_tokens, mixed)
    return limits


def _same_family(path: Path, regime: Regime) -> bool:
    return path.name.removesuffix(".run.json").removesuffix("-plain") == regime.family


def _row(regime: Regime, results: dict[str, CheckResult]) -> dict[str, Any]:
    """A report row: the run's size, measured time, each result's prediction and error (``KEY_s``, ``KEY_error``)
    and, from the first result, whether it planned the same steps and its mean per-step error."""
    fitted = next(iter(results.values()))
    row: dict[str, Any] = {"regime": regime.name, "requests": fitted.num_requests, "steps": fitted.num_steps}
    row["measured_s"] = fitted.measured_s
    for key, result in results.items():
        row[f"{key}_s"] = result.predicted_s
        row[f"{key}_error"] = result.error
    row["same_plans"] = fitted.same_plans == "yes"
    row["step_mean_abs_error"] = fitted.step_errors.get("mean_abs") if fitted.step_errors else None
    return row


def _label(row: Mapping[str, Any]) -> str:
    """A report row's regime, with its run's number when it comes from a pooled folder (``--pool``)."""
    return row["regime"] if not row.get("run") else f"{row['regime']}@{row['run']}"


def print_table(rows: Sequence[dict[str, Any]], device: str = "NVIDIA H200") -> None:
    """The per-regime errors, one line each, the worst |error| of each profile and, for a device with a built-in
    profile (``builtin_name``), whether the fit may replace it (its worst error on these runs is within 10 % or the
    built-in's worst; the held-out column is the honest number for runs it was not fitted on)."""
    name = builtin_name(device)
    print(
        f"\n{'regime':<19} {'reqs':>5} {'steps':>6} {'measured s':>10} {'fitted':>8} {'held-out':>9} "
        f"{name:>8} {'plans':>5} {'step |err|':>10}"
    )
    for r in rows:
        step = f"{r['step_mean_abs_error']:.1%}" if r["step_mean_abs_error"] is not None else "-"
        print(
            f"{_label(r):<19} {r['requests']:>5} {r['steps']:>6} {r['measured_s']:>10.3f} "
            f"{r['fitted_error']:>+8.1%} {r['held_out_error']:>+9.1%} {r['builtin_error']:>+8.1%} "
            f"{'same' if r['same_plans'] else 'diff':>5} {step:>10}"
        )
    for key in ("fitted", "held_out", "builtin"):
        worst = max(abs(r[f"{key}_error"]) for r in rows)
        modes = ", ".join(
            f"{mode} {max(abs(r[f'{key}_error']) for r in rows if r['regime'].endswith('-plain') == plain):.1%}"
            for mode, plain in (("overlapped", False), ("plain", True))
            if any(r["regime"].endswith("-plain") == plain for r in rows)
        )
        label = key if key != "builtin" else f"built-in {name}"
        print(f"worst |error| {label}: {worst:.1%} ({modes}; target <= 10 %: {'met' if worst <= 0.10 else 'NOT met'})")
    print("held-out: the profile fitted without the regime's family (both loop modes): leave one regime out")
    fitted = max(abs(r["fitted_error"]) for r in rows)
    builtin = max(abs(r["builtin_error"]) for r in rows)
    bound = "10 %" if fitted <= 0.10 else f"the built-in's {builtin:.1%}"
    verdict = f"yes (worst fitted {fitted:.1%} <= {bound} on these runs)"
    if fitted > max(builtin, 0.10):
        verdict = f"no (worst fitted {fitted:.1%} > the built-in {name}'s {builtin:.1%} on these runs)"
    if builtin_for_device(device) is None:
        verdict = f"n/a (a {device} run: no built-in profile of that device)"
    print(f"ship the fitted profile as the built-in {name}: {verdict}")


def builtin_name(device: str) -> str:
    """The built-in profile a run on ``device`` is compared with and may replace: the device's own
    (``builtin_for_device``: "h100" for an "NVIDIA H100 80GB HBM3"), else "h200"."""
    return builtin_for_device(device) or "h200"


def ship_snippet(
    profile: HardwareProfile,
    rows: Sequence[dict[str, Any]],
    commit: str,
    served: Sequence[str] = (),
    name: str = "h200",
    precision_rows: Mapping[str, Sequence[dict[str, Any]]] | None = None,
) -> str:
    """The fitted profile as the Python literal of fnvllm/sim/hardware.py's built-in ``name`` (H200 = ...), with
    its provenance comment (the per-regime errors fitted / held out, ``served``: the served runs' lines of
    ``served_lines``, and ``precision_rows``: each precision's report rows, whose worst errors it adds)."""
    errors = ", ".join(f"{_label(r)} {r['fitted_error']:+.1%} / {r['held_out_error']:+.1%}" for r in rows)
    for key, precision in (precision_rows or {}).items():
        worst = [max(abs(r[f"{k}_error"]) for r in precision) for k in ("fitted", "held_out")]
        errors += f"; {key} overheads, worst over its {len(precision)} runs: {worst[0]:.1%} / {worst[1]:.1%}"
    head = (
        f"{SHIPPED_BY} on {time.strftime('%Y-%m-%d')} (commit {commit or 'unknown'}): "
        f"{profile.model and profile.model.get('name')} shape, block 256, budget 16384, max_num_seqs 512, CUDA graphs, "
        f"overlapped and plain loops. Error per regime, fitted / held out (leave one regime out): {errors}."
    )
    if served:
        head += " Served (TTFT p50 / p90, TPOT p50 / p90 errors): " + "; ".join(served) + "."
    comment = "\n".join(f"# {line}" for line in textwrap.wrap(head, 116))
    literal = repr(_shipped_provenance(attrs.evolve(profile, name=name), commit))
    return f"{comment}\n{name.upper()} = {literal}"


def _shipped_provenance(profile: HardwareProfile, commit: str) -> HardwareProfile:
    """``profile`` with every ``calibrated_from`` (its own, its serving section's, each precision's) naming the
    script and commit that fitted it, not this machine's run folders, which mean nothing in the repository."""
    stamp = f"({time.strftime('%Y-%m-%d')}, commit {commit or 'unknown'})"
    serving = profile.serving and attrs.evolve(
        profile.serving, calibrated_from=f"benchmarks/sim_serve_check.py {stamp}: served_timeline.jsonl"
    )
    precisions = {
        key: attrs.evolve(p, calibrated_from=f"benchmarks/sim_calibration.py --precision-of {stamp}")
        for key, p in profile.precisions.items()
    }
    return attrs.evolve(
        profile, calibrated_from="benchmarks/sim_calibration.py", serving=serving, precisions=precisions
    )


def add_serving(out: Path, served: Path) -> list[str]:
    """Fit the serving section of out/profile.json on the served run in ``served`` (its timeline and the clients'
    latencies: ``sim_serve_check.analyse``, which prints the served errors with and without it, and checks the
    section on the check runs beside it, out of sample) and write the profile back with it; returns
    ``served_lines`` of the tables."""
    from benchmarks.sim_serve_check import analyse

    print(f"\nserved run {served}:")
    tables = analyse(served, str(out / "profile.json"))
    profile = load_profile(served / "profile_served.json")
    save_profile(attrs.evolve(profile, calibrated_from=str(out / "steps.jsonl")), out / "profile.json")
    return served_lines(tables)


def served_lines(tables: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """One line per served run of ``sim_serve_check.analyse``'s tables: the fitted one, the out-of-sample checks
    (``rate-R``), then each run with the latency fitted on every rate (the shipped profile), each with its TTFT and
    TPOT p50 / p90 errors."""
    lines = []
    for name, rows in tables.items():
        if name != "served_fit" and not name.startswith(("rate-", "all_rates")):
            continue
        err = {(r["metric"], r["p"]): r["error"] for r in rows}
        if name.startswith("all_rates"):
            label = f"latency fitted on every rate, {name.removeprefix('all_rates').strip() or 'fitted run'}"
        else:
            label = "fitted run" if name == "served_fit" else f"{name.removeprefix('rate-')}/s out of sample"
        lines.append(
            f"{label} {err['ttft', 'p50']:+.1%} / {err['ttft', 'p90']:+.1%}, "
            f"{err['tpot', 'p50']:+.1%} / {err['tpot', 'p90']:+.1%}"
        )
    return lines


BUILTIN_FILE = Path(__file__).resolve().parent.parent / "fnvllm" / "sim" / "hardware.py"
SHIPPED_BY = "Fitted by benchmarks/sim_calibration.py"


def ship(snippet: str, name: str = "h200", path: Path = BUILTIN_FILE) -> None:
    """Write ``snippet`` (``ship_snippet``) over the built-in profile ``name`` in ``path`` (fnvllm/sim/hardware.py:
    its ``NAME = HardwareProfile(...)`` statement, found by parsing the file, and the comment lines right above
    it) and format the file with ruff when it is installed."""
    import ast
    import shutil
    import subprocess

    text = path.read_text()
    lines = text.splitlines(keepends=True)
    target = name.upper()
    spans = [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.parse(text).body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == target for t in node.targets)
    ]
    if not spans:
        raise ValueError(f"{path} has no built-in {name!r} profile to replace (no {target} = ...)")
    first, last = spans[0][0] - 1, spans[0][1]  # 0-based first line, exclusive end
    while first > 0 and lines[first - 1].startswith("#"):
        first -= 1  # the comment lines above the literal
    path.write_text("".join(lines[:first]) + snippet.rstrip() + "\n" + "".join(lines[last:]))
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff:
        subprocess.run([ruff, "format", "--quiet", str(path)], check=False)
    print(f"wrote the fitted profile into {path} as the built-in {name} (review and commit it)")


def _commit() -> str:
    """The repository's HEAD commit ("" outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the set, fit, check, print."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="output folder (default: a new temporary one)")
    parser.add_argument("--model-shape", default="qwen3-0.6b", choices=["tiny", "qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--quick", action="store_true", help="a few small requests per regime (a CPU dry run)")
    parser.add_argument("--refit", action="store_true", help="only fit and check the runs already in --out")
    parser.add_argument(
        "--served",
        default=None,
        help="a served run's folder (benchmarks/sim_serve_check.py --out): fit the profile's serving section on it",
    )
    parser.add_argument(
        "--pool",
        action="append",
        default=[],
        help="with --refit: another run's --out folder whose runs join the fit and the checks (repeatable)",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="the engine's KV cache storage (default auto)"
    )
    parser.add_argument("--quantization", default=None, choices=["fp8"], help="the engine's FP8 linears (default none)")
    parser.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights made by the engine"
    )
    parser.add_argument("--regimes", default=None, help="comma-separated regime names to run (default: every one)")
    parser.add_argument(
        "--precision-of",
        action="append",
        default=[],
        metavar="FOLDER",
        help="with --refit: also fit the runs of FOLDER (an --out of this script run with --kv-cache-dtype fp8 and/or "
        "--quantization fp8) and keep their overheads in the profile's precisions (repeatable)",
    )
    parser.add_argument(
        "--check-with",
        default=None,
        metavar="PROFILE",
        help="with --refit: no fit; replay the runs of --out and every --pool with this profile (a built-in name or "
        "a JSON), each folder's runs at its own precision",
    )
    parser.add_argument(
        "--ship",
        action="store_true",
        help="write the fitted profile over fnvllm/sim/hardware.py's built-in profile of the device (h200 or h100: "
        "what NAME_profile.py.txt holds)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fnvllm-calibration-"))
    out.mkdir(parents=True, exist_ok=True)
    set_ = regimes(args.quick)
    if args.regimes:
        chosen = args.regimes.split(",")
        unknown = sorted(set(chosen) - {r.name for r in set_})
        if unknown:
            parser.error(f"--regimes: unknown {unknown}; known: {[r.name for r in set_]}")
        set_ = [r for r in set_ if r.name in chosen]
    if args.check_with is not None:
        if not args.refit:
            parser.error("--check-with replays recorded runs: it needs --refit")
        folders = [out, *map(Path, args.pool)]
        profile = load_profile(args.check_with)
        rows = check_folders(profile, folders, set_)
        (out / "check.json").write_text(json.dumps(rows, indent=1) + "\n")
        print_checks(rows, profile, folders)
        return 0
    if args.refit:
        set_ = [r for r in set_ if (out / f"{r.name}.run.json").exists()]  # a folder from before a regime existed
        runs = [out / f"{r.name}.run.json" for r in set_]
        device_name = read_run(runs[0]).device_name
    else:
        import torch

        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(f"torch {torch.__version__} on {device_name}; writing to {out}", flush=True)
        os.environ["FNVLLM_TIMELINE"] = str(out / "steps.jsonl")
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="fnvllm-calibration-ckpt-") as folder:
            precision = {"kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
            llm = build_engine(args.model_shape, Path(folder), args.quick, args.load_format, **precision)
            print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
            runs = run_regimes(llm, set_, out, device_name, args.model_shape)
            llm.executor.timeline.close()
            llm.close()
    rows = fit_and_check(out, runs, set_, device_name, [Path(p) for p in args.pool])
    (out / "report.json").write_text(json.dumps(rows, indent=1) + "\n")
    print_table(rows, device_name)
    served = add_serving(out, Path(args.served)) if args.served else []
    precisions, precision_rows = {}, {}
    for folder in map(Path, args.precision_of):
        key, entry, precision_rows[key] = fit_precision(folder, set_, device_name)
        print(f"\nprecision {key} ({folder}):")
        print_table(precision_rows[key], device_name)
        precisions[key] = entry
    if precisions:
        save_profile(attrs.evolve(load_profile(out / "profile.json"), precisions=precisions), out / "profile.json")
    name = builtin_name(device_name)
    snippet = ship_snippet(load_profile(out / "profile.json"), rows, _commit(), served, name, precision_rows)
    (out / f"{name}_profile.py.txt").write_text(snippet + "\n")
    if args.ship:
        ship(snippet, name)
    print(f"\nprofile: {out / 'profile.json'} (fnvllm simulate --hardware {out / 'profile.json'} ...)")
    print(f"as fnvllm/sim/hardware.py's {name.upper()}: {out / f'{name}_profile.py.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

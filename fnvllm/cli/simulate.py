"""``fnvllm simulate``: the engine's own scheduler on a simulated GPU; ``calibrate`` and ``sweep`` sub-actions.

fnvllm simulate --workload poisson --rate 50 --num-requests 5000 --model-shape qwen3-8b --plot run.png
fnvllm simulate calibrate timeline.jsonl --out h200.json      # fit overheads to a GPU engine's step log
fnvllm simulate --workload bench --hardware h200.json         # predict with the fitted profile
fnvllm simulate --check steps.jsonl --hardware h200.json      # replay a recorded run; end-to-end and per-step error
fnvllm simulate sweep grid.yaml --out table.csv --plot grid.png [--ray [ADDRESS]]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import attrs

from fnvllm.cli import CLIError

# SimSpec field -> (flag, help). Every field is a flag; the defaults are SimSpec's.
_SPEC_FLAGS: dict[str, tuple[str, str]] = {
    "workload": ("--workload", "bench | poisson | shared-prefix | TRACE.jsonl (default poisson)"),
    "num_requests": ("--num-requests", "requests (default 256 for bench, 1000 otherwise; a trace: its first N)"),
    "rate": ("--rate", "Poisson arrivals per second; inf = all at t=0 (default 20)"),
    "prompt_mean": ("--prompt-mean", "mean prompt length, log-normal (shared-prefix: of the suffix) (default 512)"),
    "output_mean": ("--output-mean", "mean output length, log-normal (default 256)"),
    "len_sigma": ("--len-sigma", "sigma of the log-normal lengths; 0 = fixed (default 0.8)"),
    "num_prefixes": ("--num-prefixes", "shared-prefix: distinct system prompts (default 8)"),
    "prefix_len": ("--prefix-len", "shared-prefix / trace: tokens of a shared prefix (default 1024)"),
    "num_priorities": ("--num-priorities", "priorities drawn uniformly in [0, N) (default 1)"),
    "seed": ("--seed", "seed of the workload and EOS draws (default 0)"),
    "eos_prob": ("--eos-prob", "chance each token is an EOS; 0 = every request runs to its length (default 0)"),
    "model": (
        "--model-shape",
        "qwen3-0.6b | qwen3-8b | qwen3-30b-a3b | qwen1.5-moe-a2.7b | mixtral-8x7b | gemma-3-1b | gemma-3-4b | phi-4 "
        "(fnvllm.sim.NAMED_SHAPES) | a checkpoint folder or config.json (default: the profile's model, else "
        "qwen3-0.6b)",
    ),
    "hardware": ("--hardware", "h200 | h100 | a profile JSON from `fnvllm simulate calibrate` (default h200)"),
    "policy": ("--policy", "fcfs | priority | sjf (shortest max_tokens) | spf (shortest prompt) (default fcfs)"),
    "block_size": ("--block-size", "tokens per KV block (default 16)"),
    "num_blocks": ("--num-blocks", "KV blocks (default: what fits in the profile's memory)"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "memory fraction for sizing the KV cache (default 0.9)"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "token budget per step (default 8192)"),
    "max_num_seqs": ("--max-num-seqs", "cap on running sequences (default 256)"),
    "max_model_len": ("--max-model-len", "cap on prompt + output (default: the model's)"),
    "enable_prefix_caching": ("--no-prefix-caching", "turn the prefix cache off"),
    "overlap": ("--no-overlap", "simulate an engine that does not overlap host work with the device"),
    "serve": ("--serve", "simulate `fnvllm serve`: the profile's serving overheads and per-request latency"),
    "kv_cache_dtype": ("--kv-cache-dtype", "auto | fp8: the KV cache's storage, as the engine's option (default auto)"),
    "quantization": ("--quantization", "fp8: FP8 decoder linears, as the engine's option (default: the model's)"),
}


def _add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SimSpec field (typed from its default)."""
    from fnvllm.sim.spec import SimSpec

    types = {"num_requests": int, "num_blocks": int, "max_model_len": int, "model": str, "quantization": str}
    for field in attrs.fields(SimSpec):
        flag, text = _SPEC_FLAGS[field.name]
        if field.default is True:
            parser.add_argument(flag, dest=field.name, action="store_false", help=text)
        elif field.default is False:
            parser.add_argument(flag, dest=field.name, action="store_true", help=text)
        else:
            kind = types.get(field.name, type(field.default))
            parser.add_argument(flag, dest=field.name, type=kind, default=field.default, help=text)


def _spec(args: argparse.Namespace) -> Any:
    """The SimSpec of the flags, every value checked by SimSpec itself (CLIError naming the flag, exit 2)."""
    from fnvllm.sim.spec import SimSpec

    values = {f.name: getattr(args, f.name) for f in attrs.fields(SimSpec)}
    try:
        return SimSpec.from_dict(values)
    except ValueError as e:
        raise CLIError(_flag_message(str(e)), 2) from e


def _flag_message(message: str) -> str:
    """A SimSpec error as the CLI user sees it: ``rate must ...`` -> ``--rate must ...``."""
    name = message.split(" ", 1)[0]
    flag = _SPEC_FLAGS.get(name, (None,))[0]
    return f"{flag}{message[len(name) :]}" if flag and not flag.startswith("--no-") else message


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate one workload and print its metrics (table or JSON); optionally plot and write the timeline."""
    from fnvllm.sim.metrics import format_table, json_text
    from fnvllm.sim.spec import run_spec

    if args.check:
        return run_check(args)
    spec = _spec(args)
    bars: list[Progress] = []
    timeline = open(args.timeline, "w") if args.timeline else nullcontext(None)  # noqa: SIM115
    with timeline as stream:
        result, summary = _user_errors(
            run_spec,
            spec,
            progress=lambda n: bars[0].advance(n) if bars else None,
            timeline=stream,
            on_requests=lambda n: (
                bars.append(Progress(n, sys.stderr, "simulate", "requests")) if args.progress else None
            ),
        )
    for bar in bars:
        bar.close()
    print(json_text(summary) if args.json else format_table(summary))
    if args.plot:
        from fnvllm.sim.plot import plot_run

        title = f"{spec.workload} on {spec.model or 'the profile model'} / {spec.hardware}"
        _user_errors(plot_run, result.recorder, args.plot, title)
    return 0


def run_check(args: argparse.Namespace) -> int:
    """``--check TIMELINE``: replay a recorded run with ``--hardware`` and print end-to-end and per-step error."""
    from fnvllm.sim.check import check_run, format_check
    from fnvllm.sim.hardware import load_profile
    from fnvllm.sim.metrics import json_text
    from fnvllm.sim.model import load_shape
    from fnvllm.sim.recorder import run_path

    run = Path(args.run) if args.run else run_path(args.check)
    if not run.is_file():
        raise CLIError(f"--check needs the run record {str(run)!r} (RunRecorder.write); pass --run FILE", 2)
    profile = _user_errors(load_profile, args.hardware)
    model = _user_errors(load_shape, args.model) if args.model else None
    result = _user_errors(check_run, args.check, run, profile, model)
    if args.json:
        print(json_text({**attrs.asdict(result), "error": result.error}))
    else:
        print(format_check(result, f"{args.check} with {profile.name}"))
    return 0


def _user_errors(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``func``; a bad option or request surfaces as a one-line CLIError (exit code 2)."""
    from fnvllm.state import InvalidConfigError, InvalidRequestError

    try:
        return func(*args, **kwargs)
    except (ValueError, InvalidConfigError, InvalidRequestError, OSError) as e:
        raise CLIError(str(e).splitlines()[0] if str(e) else type(e).__name__, 2) from e


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit a profile's overheads to a timeline log, write it, and report how well it predicts."""
    from fnvllm.sim.calibrate import base_for, device_profile_name, fit_profile, prediction_error
    from fnvllm.sim.check import fit_request_us, read_run, run_records
    from fnvllm.sim.hardware import load_profile, save_profile
    from fnvllm.sim.model import load_shape
    from fnvllm.sim.recorder import run_path
    from fnvllm.sim.timeline import header_model, read_timeline

    header, records = _user_errors(read_timeline, args.log)
    run_file, run = run_path(args.log), None
    if run_file.is_file():  # a recorded run: its loop mode and new rows per step, and the device's name
        run = _user_errors(read_run, run_file)
        records = run_records(records, run) or records
        header = {**header, "device_name": run.device_name or header.get("device_name")}
        header["model_name"] = run.model_name or header.get("model_name")
    if args.model_shape:
        model = _user_errors(load_shape, args.model_shape)
    elif "model" in header:
        model = _user_errors(header_model, header, str(header.get("model_name") or "logged"))
    else:
        raise CLIError(f"{args.log} has no header line with the model; pass --model-shape", 2)
    device = str(header.get("device_name") or header.get("device") or "")
    base = base_for(device) if args.base == "auto" else _user_errors(load_profile, args.base)
    name = args.name or (device_profile_name(device) if device else None)
    profile = _user_errors(
        fit_profile, records, model, base, source=str(args.log), name=name, context_terms=args.context_terms
    )
    if run is not None:  # the time to take in a request, from the run's start
        profile = attrs.evolve(profile, request_us=fit_request_us([(run, records)], model, profile))
    if args.served:  # a served run's timeline: the profile's serving section (the server's latency is not in it)
        from fnvllm.sim.calibrate import fit_serving

        _, served = _user_errors(read_timeline, args.served)
        serving = _user_errors(fit_serving, served, model, profile, str(args.served), args.context_terms)
        profile = attrs.evolve(profile, serving=serving)
    out = Path(args.out) if args.out else Path(args.log).with_suffix(".profile.json")
    _user_errors(save_profile, profile, out)
    print(f"wrote {out}: profile {profile.name!r} for model {model.name!r} (base {base.name})")
    print(f"  eager {profile.eager}\n  graph {profile.graph}\n  graph_max_seqs {profile.graph_max_seqs}")
    for label, path in (("fit", args.log), *(("check", c) for c in args.check)):
        recs = records if path == args.log else _user_errors(read_timeline, path)[1]
        err = _user_errors(prediction_error, recs, model, profile)
        print(
            f"{label} {path}: {err['num_steps']} steps, measured {err['measured_s']:.3f} s, predicted "
            f"{err['predicted_s']:.3f} s ({err['total_error']:+.1%}), mean per-step error {err['mean_step_error']:.1%}"
        )
    return 0


def run_sweep_action(args: argparse.Namespace) -> int:
    """Run a grid of simulations and write the table (and a plot of one metric)."""
    from fnvllm.sim.sweep import expand_grid, load_grid, run_sweep, write_table

    if args.workers is not None and not 1 <= args.workers <= 4096:
        raise CLIError(f"--workers must be in [1, 4096], got {args.workers}", 2)
    grid = _user_errors(load_grid, args.grid)
    points, axes = _user_errors(expand_grid, grid)
    metric, x = args.metric or grid.get("metric", "ttft_p99_ms"), args.x or grid.get("x") or (axes or [None])[0]
    use_ray = args.ray is not None
    address = args.ray or None
    progress = Progress(len(points), sys.stderr)
    try:
        rows = _user_errors(run_sweep, points, args.workers, address, use_ray=use_ray, on_done=progress.done)
    finally:
        progress.close()
    out = args.out or str(Path(args.grid).with_suffix(".csv"))
    write_table(rows, out)
    errors = [row for row in rows if "error" in row]
    print(f"{len(rows)} points ({len(errors)} failed) -> {out}")
    for row in errors:
        print(f"  failed: {row['error']}")
    if args.plot and x is not None:
        from fnvllm.sim.plot import plot_sweep

        _user_errors(plot_sweep, rows, axes, metric, x, args.plot)
    return 1 if errors and len(errors) == len(rows) else 0


class Progress:
    """Progress of a long job on ``stream``: a tqdm bar on a terminal; elsewhere (a log, a pipe, CI) a plain line
    for the first finished item, then at most one per ``interval_s`` seconds, and one for the last."""

    def __init__(
        self,
        total: int,
        stream: Any,
        label: str = "sweep",
        unit: str = "points",
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.stream, self.label, self.unit = total, stream, label, unit
        self.interval_s, self.clock = interval_s, clock
        self.num_done = self.num_failed = 0
        self.start = self._last_line = clock()
        self.bar = None
        if stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=label, unit=unit.rstrip("s"), file=stream)

    def advance(self, count: int = 1, failed: int = 0) -> None:
        """``count`` more items finished (``failed`` of them failed)."""
        self.num_done += count
        self.num_failed += failed
        if self.bar is not None:
            self.bar.update(count)
            return
        now = self.clock()
        if self.num_done in (count, self.total) or now - self._last_line >= self.interval_s:
            self._last_line = now
            failed_text = f", {self.num_failed} failed" if self.num_failed else ""
            print(
                f"{self.label}: {self.num_done}/{self.total} {self.unit} done{failed_text}, "
                f"{now - self.start:.0f} s elapsed",
                file=self.stream,
                flush=True,
            )

    def done(self, row: dict[str, Any]) -> None:
        """One sweep point finished (``row`` has an ``error`` when it failed)."""
        self.advance(1, int("error" in row))

    def close(self) -> None:
        """Close the bar (if any)."""
        if self.bar is not None:
            self.bar.close()


def _add_actions(parser: argparse.ArgumentParser) -> None:
    """The ``calibrate`` and ``sweep`` sub-actions."""
    actions = parser.add_subparsers(dest="action", metavar="[ACTION]")
    cal = actions.add_parser("calibrate", help="fit a hardware profile to a GPU engine's FNVLLM_TIMELINE log")
    cal.add_argument("log", help="timeline JSONL (a header line with the model, then one record per step)")
    cal.add_argument(
        "--base",
        default="auto",
        help="profile whose ceilings the fit keeps (auto: the device's built-in, h100 or h200, else h200 for a CUDA "
        "timeline, a CPU one for a CPU one)",
    )
    cal.add_argument("--name", default=None, help="the profile's name (default: the device the timeline ran on)")
    cal.add_argument("--model-shape", default=None, help="model shape, if the log has no header")
    cal.add_argument("--out", "-o", default=None, help="profile JSON to write (default LOG.profile.json)")
    cal.add_argument("--check", action="append", default=[], help="another log to report the prediction error on")
    cal.add_argument(
        "--served",
        default=None,
        help="the timeline of a `fnvllm serve` run: fit the profile's serving section (--serve) on it too",
    )
    cal.add_argument(
        "--context-terms",
        action="store_true",
        help="also fit host and gap time per context token (host_context_us, gap_context_us; default: 0)",
    )
    cal.set_defaults(func=run_calibrate)
    sweep = actions.add_parser("sweep", help="run a grid of simulations (local processes, or Ray)")
    sweep.add_argument("grid", help="grid file (YAML or JSON): simulation options, lists are axes")
    sweep.add_argument("--out", "-o", default=None, help="table to write, .csv or .json (default GRID.csv)")
    sweep.add_argument("--plot", default=None, help="PNG of the metric across the grid (needs matplotlib)")
    sweep.add_argument("--metric", default=None, help="metric to plot (default the grid's, else ttft_p99_ms)")
    sweep.add_argument("--x", default=None, help="axis for the plot's x (default the grid's, else its first axis)")
    sweep.add_argument("--workers", type=int, default=None, help="local processes (default: CPU count)")
    sweep.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", help="run on Ray")
    sweep.set_defaults(func=run_sweep_action)


def register(sub: Any) -> None:
    """Add the ``simulate`` subcommand (with its ``calibrate`` and ``sweep`` actions)."""
    parser = sub.add_parser("simulate", help="simulate serving with the real scheduler and a GPU cost model")
    _add_spec_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    parser.add_argument("--plot", default=None, help="PNG of KV usage, queues, tokens per step and latency CDFs")
    parser.add_argument("--timeline", default=None, help="write the predicted per-step timeline (JSONL)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress (bar or lines)")
    parser.add_argument(
        "--check",
        default=None,
        metavar="TIMELINE",
        help="replay a recorded run (its FNVLLM_TIMELINE file and run record) with --hardware; print the error",
    )
    parser.add_argument("--run", default=None, help="the run record of --check (default TIMELINE.run.json)")
    parser.set_defaults(func=run_simulate)
    _add_actions(parser)

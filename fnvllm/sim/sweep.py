"""Sweeps: run a grid of simulations in parallel (local processes, or a Ray cluster) and tabulate them.

A grid file (YAML or JSON) holds SimSpec fields; a list value is an axis, the grid is their product:

    workload: poisson
    num_requests: 2000
    rate: [10, 20, 40]
    policy: [fcfs, sjf]
    max_num_batched_tokens: [2048, 8192]
    metric: ttft_p99_ms     # optional: what the plot shows (default ttft_p99_ms)
    x: rate                 # optional: the plot's x axis (default: the first axis)

Each point runs in its own process (``run_point`` is a plain function, so Ray and multiprocessing can both ship
it); a point whose options are invalid gets an ``error`` column instead of stopping the sweep.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from fnvllm.sim.checks import MAX_POINTS, SimInputError, check_mapping, check_text
from fnvllm.sim.metrics import json_text
from fnvllm.sim.spec import SimSpec, run_spec
from fnvllm.state import InvalidConfigError, InvalidRequestError

PLOT_KEYS = ("metric", "x")


def load_grid(path: str | Path) -> dict[str, Any]:
    """A grid file as a dict (YAML when the extension is .yaml/.yml, else JSON); SimInputError (one line) for a
    file that does not parse or is not a mapping of option names."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise SimInputError(
                "reading a YAML grid needs PyYAML (pip install pyyaml), or write the grid as JSON"
            ) from None
        try:
            grid = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SimInputError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    else:
        try:
            grid = json.loads(text)
        except json.JSONDecodeError as e:
            raise SimInputError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(grid, dict):
        raise SimInputError(f"{path}: a grid is a mapping of simulation options to values or lists of values")
    return dict(check_mapping(grid, f"grid {path}"))


def expand_grid(grid: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every point of the grid (the product of its list-valued options, in file order) and the axis names.
    Each point is validated as a SimSpec, so a misspelt option or a bad value fails before anything runs; an
    empty axis, or more than MAX_POINTS points, is refused before the product is built."""
    check_mapping(grid, "grid")
    for key in PLOT_KEYS:
        if key in grid:
            check_text(grid[key], f"grid {key}")
    options = {k: v for k, v in grid.items() if k not in PLOT_KEYS}
    axes = [k for k, v in options.items() if isinstance(v, list)]
    size = 1
    for axis in axes:
        if not options[axis]:
            raise SimInputError(f"grid axis {axis!r} is an empty list; give it at least one value")
        size *= len(options[axis])
        if size > MAX_POINTS:
            raise SimInputError(f"the grid has more than {MAX_POINTS} points (axes {axes}); split it")
    fixed = {k: v for k, v in options.items() if k not in axes}
    points = [
        {**fixed, **dict(zip(axes, values, strict=True))} for values in itertools.product(*(options[a] for a in axes))
    ]
    for point in points:
        try:
            SimSpec.from_dict(point)
        except SimInputError as e:
            where = ", ".join(f"{a}={point[a]!r}" for a in axes)
            raise type(e)(f"grid point {where}: {e}" if axes else f"grid: {e}") from None
    return points, axes


def run_point(point: Mapping[str, Any]) -> dict[str, Any]:
    """Simulate one grid point; returns the point's options, its metrics and the wall time (or an error)."""
    start = time.perf_counter()
    try:
        _, summary = run_spec(SimSpec.from_dict(point))
    except (ValueError, InvalidConfigError, InvalidRequestError) as e:
        return {**point, "error": str(e)}
    return {**point, **summary, "wall_s": time.perf_counter() - start}


def run_sweep(
    points: Sequence[Mapping[str, Any]],
    workers: int | None = None,
    ray_address: str | None = None,
    use_ray: bool = False,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every point; rows come back in grid order, and ``on_done(row)`` hears of each as it finishes (in
    completion order: progress). Local processes by default (``workers`` of them, default the CPU count; 1 runs
    in this process); ``use_ray`` sends each point to Ray as a task instead (``ray_address`` None: a local Ray
    instance, or the cluster in RAY_ADDRESS)."""
    if use_ray:
        return _run_ray(points, ray_address, on_done)
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(points) == 1:
        return [_done(run_point(p), on_done) for p in points]
    rows: list[dict[str, Any]] = [{} for _ in points]
    with ProcessPoolExecutor(max_workers=min(workers, len(points)), mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(run_point, p): i for i, p in enumerate(points)}
        for future in as_completed(futures):
            rows[futures[future]] = _done(future.result(), on_done)
    return rows


def _done(row: dict[str, Any], on_done: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    if on_done is not None:
        on_done(row)
    return row


def _run_ray(
    points: Sequence[Mapping[str, Any]], address: str | None, on_done: Callable[[dict[str, Any]], None] | None
) -> list[dict[str, Any]]:
    """Each point as one Ray task (ray is an optional extra: ``pip install 'fnvllm[ray]'``)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray installed: pip install 'fnvllm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(run_point)
        refs = [task.remote(dict(p)) for p in points]
        index = {ref: i for i, ref in enumerate(refs)}
        rows: list[dict[str, Any]] = [{} for _ in points]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                rows[index[ref]] = _done(ray.get(ref), on_done)
        return rows
    finally:
        if started:
            ray.shutdown()


def write_table(rows: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Rows as CSV (columns: every key, in first-seen order) or, for a .json path, a JSON list."""
    if str(path).endswith(".json"):
        Path(path).write_text(json_text(list(rows), indent=1) + "\n")
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

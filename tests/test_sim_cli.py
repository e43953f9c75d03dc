"""``fnvllm simulate`` from the shell: metrics, one-line errors, calibration, and sweeps (local and Ray)."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from fnvllm.sim import H200, load_profile, save_profile

SMALL = ["--num-requests", "40", "--num-blocks", "600", "--no-progress"]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnvllm.cli", "simulate", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_simulate_prints_json_metrics_and_writes_a_timeline(tmp_path: Path) -> None:
    """--json prints one object whose counts add up; --timeline writes a header and one record per busy step."""
    out = _cli(
        "--workload", "shared-prefix", "--prefix-len", "256", "--json", "--timeline", str(tmp_path / "t.jsonl"), *SMALL
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["num_finished"] == 40 and summary["prefix_hit_rate"] > 0
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert "model" in json.loads(lines[0])
    assert 1 <= len(lines) - 1 <= summary["num_steps"]


def _strict_json(text: str) -> object:
    """``text`` parsed as standard JSON: NaN / Infinity (Python's extensions) are refused."""

    def refuse(constant: str) -> object:
        raise ValueError(f"not standard JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_undefined_metrics_are_json_null(tmp_path: Path) -> None:
    """Every request makes one token, so TPOT is undefined: --json and a sweep's .json table write null, standard
    JSON, not NaN."""
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"arrival_s": 0, "prompt_len": 4, "output_len": 1}) + "\n")
    out = _cli("--workload", str(trace), "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    summary = _strict_json(out.stdout)
    assert isinstance(summary, dict) and summary["tpot_mean_ms"] is None and summary["num_finished"] == 1
    from fnvllm.sim.metrics import json_text

    assert _strict_json(json_text({"a": [float("nan"), float("inf"), 1.5]})) == {"a": [None, None, 1.5]}


def test_simulate_prints_a_table_for_a_trace(tmp_path: Path) -> None:
    """A JSONL trace workload runs and prints the latency table."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"arrival_s": i * 0.01, "prompt_len": 50, "output_len": 5}) + "\n" for i in range(10))
    )
    out = _cli("--workload", str(trace), "--no-progress", "--num-blocks", "100")
    assert out.returncode == 0, out.stderr
    assert "requests 10/10" in out.stdout and "ttft" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "nope"], "workload must be one of"),
        (["--rate", "0"], "--rate must be a number in (0, "),
        (["--hardware", "missing.json"], "hardware 'missing.json'"),
        (["--model-shape", "gpt-9"], "model shape 'gpt-9'"),
        (["--policy", "random"], "unknown policy 'random'"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be an int in [1, "),
        (["calibrate", "missing.jsonl"], "missing.jsonl"),
    ],
)
def test_bad_options_fail_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    """Each user mistake exits with code 2 and exactly one line on stderr naming the problem."""
    out = _cli(*args, "--no-progress" if args[0] != "calibrate" else "--check=x", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fnvllm simulate: error:") and message in lines[0], out.stderr


def test_a_request_that_can_never_run_fails_with_one_line(tmp_path: Path) -> None:
    """A trace request longer than max_model_len stops the run with the core's one-line reason."""
    (tmp_path / "t.jsonl").write_text(json.dumps({"arrival_s": 0, "prompt_len": 900, "output_len": 200}) + "\n")
    out = _cli("--workload", str(tmp_path / "t.jsonl"), "--max-model-len", "1024", "--no-progress")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "exceeds max_model_len (1024)" in out.stderr


def test_calibrate_writes_a_profile_that_simulate_accepts(tmp_path: Path) -> None:
    """simulate --timeline -> calibrate -> simulate --hardware: the fitted profile reproduces the timings."""
    save_profile(H200, tmp_path / "h200.json")
    first = _cli("--json", "--timeline", str(tmp_path / "t.jsonl"), "--rate", "200", *SMALL)
    assert first.returncode == 0, first.stderr
    cal = _cli(
        "calibrate",
        str(tmp_path / "t.jsonl"),
        "--out",
        str(tmp_path / "fit.json"),
        "--check",
        str(tmp_path / "t.jsonl"),
    )
    assert cal.returncode == 0, cal.stderr
    assert "fit " in cal.stdout and "check " in cal.stdout
    again = _cli("--json", "--hardware", str(tmp_path / "fit.json"), "--rate", "200", *SMALL)
    assert again.returncode == 0, again.stderr
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    assert b["duration_s"] == pytest.approx(a["duration_s"], rel=0.02)


def test_calibrate_fits_context_terms_only_with_the_flag(tmp_path: Path) -> None:
    """A timeline simulated with a plain gap that grows per context token: ``calibrate --context-terms`` fits a
    per-token gap, plain ``calibrate`` leaves it (and the host's) at 0."""
    true = attrs.evolve(H200, graph=attrs.evolve(H200.graph, gap_context_us=0.05))
    save_profile(true, tmp_path / "true.json")
    timeline = ["--timeline", str(tmp_path / "t.jsonl"), "--no-overlap"]  # the plain loop: the gap is its own
    run = _cli("--json", *timeline, "--hardware", str(tmp_path / "true.json"), *SMALL)
    assert run.returncode == 0, run.stderr
    fitted = {}
    for label, flags in (("plain", []), ("context", ["--context-terms"])):
        out = _cli("calibrate", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / f"{label}.json"), *flags)
        assert out.returncode == 0, out.stderr
        fitted[label] = load_profile(tmp_path / f"{label}.json").graph
    assert fitted["plain"].gap_context_us == 0.0 and fitted["plain"].host_context_us == 0.0
    assert fitted["context"].gap_context_us > 0.0


def _grid(tmp_path: Path) -> Path:
    grid = {
        "num_requests": 30,
        "num_blocks": 600,
        "rate": [50, 400],
        "policy": ["fcfs", "sjf"],
        "metric": "e2e_mean_ms",
    }
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    return path


def test_sweep_runs_a_grid_in_local_processes(tmp_path: Path) -> None:
    """A 2x2 grid runs in 2 worker processes and writes one CSV row per point, in grid order."""
    out = _cli("sweep", str(_grid(tmp_path)), "--workers", "2", "--out", str(tmp_path / "table.csv"))
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader((tmp_path / "table.csv").open()))
    assert [(r["rate"], r["policy"]) for r in rows] == [("50", "fcfs"), ("50", "sjf"), ("400", "fcfs"), ("400", "sjf")]
    assert all(float(r["num_finished"]) == 30 for r in rows)


def test_sweep_rejects_an_unknown_option(tmp_path: Path) -> None:
    """A misspelt option in the grid fails before anything runs, naming it."""
    (tmp_path / "g.json").write_text(json.dumps({"rates": [1, 2]}))
    out = _cli("sweep", str(tmp_path / "g.json"))
    assert out.returncode == 2 and "rates" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'fnvllm[ray]')")
def test_sweep_runs_on_a_local_ray_instance(tmp_path: Path) -> None:
    """--ray with no address starts a local Ray instance and gives the same table as local processes."""
    out = _cli("sweep", str(_grid(tmp_path)), "--ray", "--out", str(tmp_path / "ray.json"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "ray.json").read_text())
    assert len(rows) == 4 and all(r["num_finished"] == 30 for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed ([sim] extra)")
def test_plots_are_written(tmp_path: Path) -> None:
    """--plot writes a PNG for a run and for a sweep."""
    run = _cli("--plot", str(tmp_path / "run.png"), *SMALL)
    assert run.returncode == 0, run.stderr
    sweep = _cli("sweep", str(_grid(tmp_path)), "--workers", "1", "--plot", str(tmp_path / "grid.png"))
    assert sweep.returncode == 0, sweep.stderr
    for name in ("run.png", "grid.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_sweep_prints_plain_progress_lines_off_a_terminal(tmp_path: Path) -> None:
    """Off a terminal (stderr is a pipe) the sweep says how many points are done: the first and the last."""
    out = _cli("sweep", str(_grid(tmp_path)), "--workers", "2", "--out", str(tmp_path / "table.csv"))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("sweep: ")]
    assert lines[0].startswith("sweep: 1/4 points done") and lines[-1].startswith("sweep: 4/4 points done"), lines


def test_sweep_progress_prints_at_most_one_line_per_interval() -> None:
    """With a fake clock: the first point, then one line per 10 s interval, and the last point."""
    import io

    from fnvllm.cli.simulate import Progress

    now = [0.0]
    stream = io.StringIO()
    progress = Progress(6, stream, interval_s=10.0, clock=lambda: now[0])
    for t, row in ((1, {}), (2, {}), (5, {"error": "x"}), (12, {}), (13, {}), (14, {})):
        now[0] = t
        progress.done(row)
    assert stream.getvalue().splitlines() == [
        "sweep: 1/6 points done, 1 s elapsed",
        "sweep: 4/6 points done, 1 failed, 12 s elapsed",
        "sweep: 6/6 points done, 1 failed, 14 s elapsed",
    ]


def test_simulate_prints_plain_progress_lines_off_a_terminal() -> None:
    """A single run off a terminal says how many requests finished (first and last line), unless --no-progress."""
    out = _cli("--num-requests", "40", "--num-blocks", "600")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("simulate: ")]
    assert lines and lines[-1].startswith("simulate: 40/40 requests done"), out.stderr
    quiet = _cli(*SMALL)
    assert "simulate: " not in quiet.stderr

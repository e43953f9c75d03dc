"""benchmarks/sim_calibration.py at other precisions and devices: a subset of regimes, runs with an FP8 cache, their
overheads kept in the profile (``--precision-of``), replays against a given profile (``--check-with``), shipping
into a device's built-in profile, and the host fit of a device-bound log."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from fnvllm.sim import fit_profile, load_profile
from fnvllm.sim.cost import CostModel, StepShape
from fnvllm.sim.hardware import H200
from fnvllm.sim.model import load_shape

REGIMES = "decode-1,decode-1-plain,decode-16,decode-16-plain,prefill-16,prefill-16-plain"


def test_a_few_stragglers_do_not_set_the_host_cycle_of_a_device_bound_log() -> None:
    """Decode steps whose device (~0.9 ms at one row) outlasts the host's cycle (0.25 ms), plus a few host-paced
    stragglers whose wall exceeds their cpu_ms by 4 ms: the fitted host cycle of a one-row step stays near its
    cpu_ms, so the fit prices the step device-bound (before PACED_SHARE the stragglers' median gap was added to
    every step's host time: one-request decode steps came out 72 % slow)."""
    model = load_shape("qwen3-0.6b")
    cost = CostModel(model, attrs.evolve(H200, graph_max_seqs=512))
    records = []
    for i, rows in enumerate([1] * 60 + [2, 4, 8, 16, 32, 64, 128] * 20):
        shape = StepShape(rows, rows, rows, 0, rows * 300, rows * 300, rows, True)
        device, cpu = cost.device_s(shape) * 1e3, 0.25 + 0.002 * rows
        straggler = i % 22 == 7  # 9 of 200 (more than MIN_ROWS, under PACED_SHARE): host-paced, a long gap
        timing = {"gpu_ms": device + 4.0, "gap_ms": 0.5} if straggler else {"gpu_ms": device, "gap_ms": 0.0}
        records.append({**shape.to_record(), "cpu_ms": cpu, **timing, "overlap": True, "step": i})
    fitted = CostModel(model, fit_profile(records, model, attrs.evolve(H200, graph_max_seqs=512)))
    one = StepShape(1, 1, 1, 0, 300, 300, 1, True)
    assert fitted.host_s(one) * 1e3 == pytest.approx(0.252, abs=0.05)
    assert fitted.wall_s(one) == pytest.approx(cost.device_s(one), rel=0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Quick CPU runs of a few regimes on the tiny shape: one in the model's dtype, one with an FP8 cache."""
    from benchmarks import sim_calibration

    root = tmp_path_factory.mktemp("calibration")
    folders = {"plain": root / "plain", "fp8_kv": root / "fp8_kv"}
    common = ["--model-shape", "tiny", "--quick", "--regimes", REGIMES]
    assert sim_calibration.main(["--out", str(folders["plain"]), *common]) == 0
    assert sim_calibration.main(["--out", str(folders["fp8_kv"]), *common, "--kv-cache-dtype", "fp8"]) == 0
    return folders


def test_regimes_subset_runs_only_those(runs: dict[str, Path]) -> None:
    """``--regimes`` runs the named regimes only, and the FP8 run's timeline header says its cache is FP8."""
    names = sorted(p.name.removesuffix(".run.json") for p in runs["fp8_kv"].glob("*.run.json"))
    assert names == sorted(REGIMES.split(","))
    header = json.loads((runs["fp8_kv"] / "steps.jsonl").read_text().splitlines()[0])
    assert header["model"]["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in json.loads((runs["plain"] / "steps.jsonl").read_text().splitlines()[0])["model"]


def test_precision_of_keeps_the_fp8_fit_in_the_profile(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """``--refit --precision-of FOLDER`` fits FOLDER's FP8-cache runs on their own and stores their overheads as the
    profile's fp8_kv entry (the same overheads as a fit of that folder alone), with its table printed."""
    from benchmarks import sim_calibration

    out, fp8 = runs["plain"], runs["fp8_kv"]
    assert sim_calibration.main(["--out", str(out), "--refit", "--quick", "--precision-of", str(fp8)]) == 0
    profile = load_profile(out / "profile.json")
    alone = load_profile(fp8 / "profile.json")  # the FP8 folder's own fit, written by the same call
    assert set(profile.precisions) == {"fp8_kv"}
    assert profile.precisions["fp8_kv"].graph == alone.graph and profile.precisions["fp8_kv"].eager == alone.eager
    assert "precision fp8_kv" in capsys.readouterr().out
    # a CPU run is no built-in's device: its snippet is written as the h200's, with the FP8 fit's worst errors
    comment = (out / "h200_profile.py.txt").read_text().replace("\n# ", " ")
    assert "fp8_kv overheads, worst over its 6 runs" in comment
    with pytest.raises(ValueError, match="another precision"):  # one fit prices every run at one precision
        sim_calibration.main(["--out", str(out), "--refit", "--quick", "--pool", str(fp8)])


def test_check_with_replays_each_folder_at_its_precision(runs: dict[str, Path]) -> None:
    """``--refit --check-with PROFILE --pool FOLDER`` fits nothing: it replays every run of both folders with the
    profile, each at its own precision, and writes the rows (``run`` = the folder's index) to check.json."""
    from benchmarks import sim_calibration

    out, fp8 = runs["plain"], runs["fp8_kv"]
    profile = out / "profile.json"
    before = profile.read_text()
    argv = ["--out", str(out), "--refit", "--quick", "--check-with", str(profile), "--pool", str(fp8)]
    assert sim_calibration.main(argv) == 0
    rows = json.loads((out / "check.json").read_text())
    assert [r["run"] for r in rows] == [0] * 6 + [1] * 6
    assert all(r["same_plans"] and r["checked_s"] > 0 for r in rows)
    assert profile.read_text() == before  # no fit was written
    with pytest.raises(SystemExit):
        sim_calibration.main(["--out", str(out), "--check-with", str(profile)])  # needs --refit


def test_ship_replaces_only_the_named_builtin(tmp_path: Path) -> None:
    """``ship`` writes a snippet over the built-in it names (its comment lines and literal) in a copy of
    fnvllm/sim/hardware.py, leaving the other built-in and the lines around them as they were."""
    from benchmarks import sim_calibration

    copy = tmp_path / "hardware.py"
    text = sim_calibration.BUILTIN_FILE.read_text()
    copy.write_text(text)
    profile = attrs.evolve(load_profile("h100"), precisions={})
    snippet = sim_calibration.ship_snippet(profile, [], "abc1234", name="h100")
    sim_calibration.ship(snippet, "h100", copy)
    shipped = copy.read_text()
    h200_block = text[text.index("\nH200 = HardwareProfile(") : text.index("\n)\n", text.index("\nH200 = "))]
    assert h200_block in shipped and "(commit abc1234)" in shipped
    assert shipped.count("\nH100 = HardwareProfile(") == 1 and "The H100's ceilings, measured" in shipped
    with pytest.raises(ValueError, match="no built-in 'a100'"):
        sim_calibration.ship(snippet, "a100", copy)

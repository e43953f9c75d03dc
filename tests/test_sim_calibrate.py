"""Calibration: fitting overheads to a per-step timeline recovers the constants that generated it."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import attrs
import numpy as np
import pytest

from fnvllm.sim import (
    H200,
    CostModel,
    HardwareProfile,
    Overheads,
    SimSpec,
    StepShape,
    fit_profile,
    load_shape,
    read_timeline,
    run_spec,
)
from fnvllm.sim.calibrate import fit_nonnegative, prediction_error
from fnvllm.sim.hardware import load_profile, save_profile
from fnvllm.sim.timeline import record_shape

TRUE = HardwareProfile(
    name="true",
    mem_bandwidth_gbs=H200.mem_bandwidth_gbs,
    matmul_tflops=H200.matmul_tflops,
    matmul_bandwidth_gbs=H200.matmul_bandwidth_gbs,
    memory_gib=H200.memory_gib,
    graph_max_seqs=64,
    eager=Overheads(
        scale=1.3, attn_scale=1.8, step_us=250.0, seq_us=3.0, token_us=0.2, log_seq_us=40.0, gap_us=80.0, gap_seq_us=0.5
    ),
    graph=Overheads(scale=1.3, attn_scale=1.5, step_us=30.0, seq_us=0.8, log_seq_us=25.0, gap_us=20.0, gap_seq_us=0.1),
)


def _synthetic_log(tmp_path: Path, noise: float, true: HardwareProfile = TRUE) -> Path:
    """A timeline simulated under ``true`` (device and gap times jittered by ``noise``, relative)."""
    save_profile(true, tmp_path / "true.json")
    spec = SimSpec(
        workload="poisson",
        num_requests=300,
        rate=400,
        output_mean=40,
        prompt_mean=300,
        hardware=str(tmp_path / "true.json"),
    )
    stream = io.StringIO()
    run_spec(spec, timeline=stream)
    rng = random.Random(0)
    lines = stream.getvalue().splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        record = json.loads(line)
        for key in ("gpu_ms", "gap_ms"):
            record[key] *= 1 + rng.uniform(-noise, noise)
        out.append(json.dumps(record))
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


def test_fit_recovers_known_overheads(tmp_path: Path) -> None:
    """From a synthetic log with 1% noise, the scales and gap constants come back within 10% and every step's
    device time within 3% (graph steps take their matmul scale, which decode-only steps cannot identify, from the
    eager fit, not from the base profile)."""
    header, records = read_timeline(_synthetic_log(tmp_path, noise=0.01))
    model = load_shape("qwen3-0.6b")
    assert header["model"]["hidden_size"] == model.hidden
    assert {bool(r["graph"]) for r in records} == {True, False}
    base = attrs.evolve(H200, graph=Overheads(scale=1.4))
    fitted = fit_profile(records, model, base, source="synthetic")
    fields = ("scale", "attn_scale", "gap_us")
    for kind in ("eager", "graph"):
        got, want = getattr(fitted, kind), getattr(TRUE, kind)
        for field in fields:
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=0.1, abs=0.02), (kind, field)
    # the per-step terms (step, rows, log2 rows, tokens; the gap's per row, a tenth of a microsecond here) trade off
    # against each other on these shapes: their sum must come back, step by step
    fitted_cost, true_cost = CostModel(model, fitted), CostModel(model, TRUE)
    for record in records:
        shape = record_shape(record)
        assert fitted_cost.device_s(shape) == pytest.approx(true_cost.device_s(shape), rel=0.03)
        assert fitted_cost.gap_s(shape) == pytest.approx(true_cost.gap_s(shape), rel=0.05)
    assert fitted.graph_max_seqs <= 64 and fitted.calibrated_from == "synthetic"
    for is_graph in (True, False):
        kind = [r for r in records if r["graph"] is is_graph]
        assert abs(prediction_error(kind, model, fitted)["total_error"]) < 0.01


def test_context_terms_are_fitted_only_when_asked(tmp_path: Path) -> None:
    """A log whose plain gap grows with the context tokens: ``context_terms=True`` recovers the per-token gap and
    every graph step's gap; by default the context columns are not fitted (0), and the rows and constants take the
    time."""
    true = attrs.evolve(TRUE, graph=attrs.evolve(TRUE.graph, gap_context_us=0.05))
    _, records = read_timeline(_synthetic_log(tmp_path, noise=0.005, true=true))
    model = load_shape("qwen3-0.6b")
    base = attrs.evolve(H200, graph=Overheads(scale=1.4))
    graph_steps = [r for r in records if r["graph"]]
    contexts = [record_shape(r).context_tokens for r in graph_steps]
    assert max(contexts) > 2 * min(contexts)  # the context varies, so the column can be told apart
    with_context = fit_profile(records, model, base, context_terms=True)
    assert with_context.graph.gap_context_us == pytest.approx(0.05, rel=0.2)
    fitted_cost, true_cost = CostModel(model, with_context), CostModel(model, true)
    for record in graph_steps:
        shape = record_shape(record)
        assert fitted_cost.gap_s(shape) == pytest.approx(true_cost.gap_s(shape), rel=0.05)
    default = fit_profile(records, model, base)
    for kind in (default.eager, default.graph):
        assert kind.gap_context_us == 0.0 and kind.host_context_us == 0.0
    assert default.graph.gap_us + default.graph.gap_seq_us > with_context.graph.gap_us + with_context.graph.gap_seq_us


def test_fitted_profile_round_trips_through_json(tmp_path: Path) -> None:
    """save_profile / load_profile give back an equal profile; an unknown field is an error naming it."""
    save_profile(TRUE, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == TRUE
    (tmp_path / "bad.json").write_text(json.dumps({**TRUE.to_dict(), "colour": "red"}))
    with pytest.raises(ValueError, match="colour"):
        load_profile(tmp_path / "bad.json")


def test_fit_nonnegative_drops_negative_and_collinear_columns() -> None:
    """A column that would fit negative is zeroed; a duplicate column keeps its prior; exact data is recovered."""
    rng = np.random.default_rng(0)
    a, b = rng.uniform(1, 2, 50), rng.uniform(1, 2, 50)
    y = 2 * a + 3 * b
    coef = fit_nonnegative(np.column_stack([a, b, b, -a]), y)
    assert coef == pytest.approx([2, 3, 0, 0], abs=1e-9)
    coef = fit_nonnegative(np.column_stack([a, b, b]), y + 0.5 * b, prior=np.array([0, 0, 0.5]))
    assert coef == pytest.approx([2, 3, 0.5], abs=1e-9)


def test_record_shape_estimates_missing_attention_pairs() -> None:
    """Without attn_pairs a decode-only record's pairs equal its context; prefill chunks are taken from 0."""
    decode = {"num_seqs": 2, "num_tokens": 2, "num_decode_seqs": 2, "num_prefill_tokens": 0, "context_tokens": 30}
    assert record_shape({**decode, "gpu_ms": 1, "graph": True}).attn_pairs == 30
    mixed = {"num_seqs": 2, "num_tokens": 5, "num_decode_seqs": 1, "num_prefill_tokens": 4, "context_tokens": 14}
    assert record_shape({**mixed, "gpu_ms": 1, "graph": False}).attn_pairs == 10 + 10


def test_read_timeline_names_a_bad_line(tmp_path: Path) -> None:
    """A record lacking a required field is reported with its line number."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"model": {}}\n{"num_seqs": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_timeline(path)


HOST_TRUE = attrs.evolve(
    TRUE,
    eager=attrs.evolve(
        TRUE.eager, gap_new_seq_us=40.0, host_us=900.0, host_seq_us=6.0, host_new_seq_us=150.0, host_token_us=0.3
    ),
    graph=attrs.evolve(TRUE.graph, host_us=1500.0, host_seq_us=4.0),
)


def _host_log(tmp_path: Path, overlap: bool, num_requests: int, rate: float, seed: int) -> list[dict]:
    """Step records simulated under HOST_TRUE in one loop mode, times jittered by 1%."""
    save_profile(HOST_TRUE, tmp_path / "host_true.json")
    spec = SimSpec(
        num_requests=num_requests,
        rate=rate,
        output_mean=40,
        prompt_mean=300,
        hardware=str(tmp_path / "host_true.json"),
        overlap=overlap,
        seed=seed,
    )
    stream = io.StringIO()
    run_spec(spec, timeline=stream)
    path = tmp_path / f"log_{overlap}_{seed}.jsonl"
    path.write_text(stream.getvalue())
    rng = random.Random(seed)
    _, records = read_timeline(path)
    for record in records:
        for key in ("gpu_ms", "gap_ms", "cpu_ms"):
            record[key] *= 1 + rng.uniform(-0.01, 0.01)
    return records


def test_fit_recovers_known_host_and_gap_coefficients(tmp_path: Path) -> None:
    """Timelines of overlapped and plain loops, synthesised from known host and gap coefficients (low and high
    load, so both host-bound and device-bound steps occur), give the host coefficients back within 10% and the
    gap ones within 20% (a plain step's gap is fitted on its wall time less the predicted device time, so it also
    carries the device fit's error), and each loop mode's total within 1%."""
    records = [
        *_host_log(tmp_path, True, 200, 30.0, 1),
        *_host_log(tmp_path, True, 300, 400.0, 2),
        *_host_log(tmp_path, False, 200, 30.0, 3),
        *_host_log(tmp_path, False, 300, 400.0, 4),
    ]
    assert {r["overlap"] for r in records} == {True, False}
    fitted = fit_profile(records, load_shape("qwen3-0.6b"), H200)
    fields = ("gap_us", "gap_seq_us", "gap_new_seq_us", "host_us", "host_seq_us", "host_new_seq_us", "host_token_us")
    for kind, names in (("eager", fields), ("graph", ("gap_us", "host_us", "host_seq_us"))):
        got, want = getattr(fitted, kind), getattr(HOST_TRUE, kind)
        for field in names:
            rel = 0.2 if field.startswith("gap") else 0.1
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=rel, abs=0.05), (kind, field)
    # a graph step's gap per row (a tenth of a microsecond) trades off against the device's: the gap must come back
    fitted_cost, true_cost = CostModel(load_shape("qwen3-0.6b"), fitted), CostModel(load_shape("qwen3-0.6b"), HOST_TRUE)
    for record in records:
        shape = record_shape(record)
        assert fitted_cost.gap_s(shape) == pytest.approx(true_cost.gap_s(shape), rel=0.1)
    for overlap in (True, False):
        mode = [r for r in records if r["overlap"] is overlap]
        assert abs(prediction_error(mode, load_shape("qwen3-0.6b"), fitted)["total_error"]) < 0.01


def test_overlap_rule_prices_a_step_as_max_or_sum() -> None:
    """Overlapped: wall = max(device, host); plain: device + gap; a profile without a host model: device + gap."""
    from fnvllm.sim import CostModel, StepShape

    decode = StepShape(1, 1, 1, 0, 500, 500, 1, True)
    model = load_shape("qwen3-0.6b")
    over, plain = CostModel(model, HOST_TRUE, overlap=True), CostModel(model, HOST_TRUE, overlap=False)
    device, host = over.device_s(decode), over.host_s(decode)
    assert host > device  # one request: host-bound, as on the H200
    assert over.wall_s(decode) == pytest.approx(host)
    assert plain.wall_s(decode) == pytest.approx(device + plain.gap_s(decode))
    assert CostModel(model, TRUE, overlap=True).wall_s(decode) == pytest.approx(device + over.gap_s(decode))


def test_calibration_set_script_runs_fits_and_replays_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/sim_calibration.py --quick on the tiny shape (CPU): every regime runs with a run record, the
    fitted profile is named after the device and records the model, every run replays with the engine's plans,
    and the table prints one line per regime; --refit of a folder without some regime's runs fits the others."""
    from benchmarks import sim_calibration

    assert sim_calibration.main(["--out", str(tmp_path), "--model-shape", "tiny", "--quick"]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())
    names = [r.name for r in sim_calibration.regimes(quick=True)]
    assert [row["regime"] for row in rows] == names and len(names) == 18
    assert all(row["same_plans"] for row in rows)
    profile = load_profile(tmp_path / "profile.json")
    assert profile.name == "cpu" and profile.model is not None and profile.model["hidden_size"] == 128
    out = capsys.readouterr().out
    assert "worst |error| held_out" in out and "prefill-512-plain" in out and "long-128-plain" in out
    for name in ("long-128", "long-128-plain"):  # a folder from before the regime existed refits without it
        (tmp_path / f"{name}.run.json").unlink()
    assert sim_calibration.main(["--out", str(tmp_path), "--refit", "--quick"]) == 0
    assert len(json.loads((tmp_path / "report.json").read_text())) == 16
    # --pool: another run's folder (here a copy of this one, one regime fewer) joins the fit and the checks
    other = tmp_path / "other"
    other.mkdir()
    for path in tmp_path.glob("*.run.json"):
        if path.name != "decode-1.run.json":
            shutil.copy(path, other / path.name)
    shutil.copy(tmp_path / "steps.jsonl", other / "steps.jsonl")
    capsys.readouterr()
    assert sim_calibration.main(["--out", str(tmp_path), "--refit", "--quick", "--pool", str(other)]) == 0
    pooled = json.loads((tmp_path / "report.json").read_text())
    assert [r["run"] for r in pooled] == [0] * 16 + [1] * 15
    first = {r["regime"]: r for r in pooled if r["run"] == 0}
    for row in (r for r in pooled if r["run"] == 1):  # the same runs: the same measured and fitted times
        assert row["measured_s"] == first[row["regime"]]["measured_s"]
        assert row["fitted_s"] == pytest.approx(first[row["regime"]]["fitted_s"])
    assert "decode-16@1" in capsys.readouterr().out


def _regime_log(tmp_path: Path, name: str, **options: object) -> list[dict]:
    """Step records of one synthetic regime simulated under HOST_TRUE, times jittered by 1%."""
    save_profile(HOST_TRUE, tmp_path / "host_true.json")
    spec = SimSpec(hardware=str(tmp_path / "host_true.json"), **options)  # type: ignore[arg-type]
    stream = io.StringIO()
    run_spec(spec, timeline=stream)
    path = tmp_path / f"{name}.jsonl"
    path.write_text(stream.getvalue())
    rng = random.Random(name)
    _, records = read_timeline(path)
    for record in records:
        for key in ("gpu_ms", "gap_ms", "cpu_ms"):
            record[key] *= 1 + rng.uniform(-0.01, 0.01)
    return records


def test_fit_recovers_profile_and_predicts_a_held_out_regime(tmp_path: Path) -> None:
    """Fitted on synthetic regimes of a known profile (low and high load, both loop modes), the device scales come
    back within 10 %, and a regime left out of the fit (long prompts) is predicted within 3 % end to end."""
    model = load_shape("qwen3-0.6b")
    common = {"output_mean": 40, "prompt_mean": 300}
    train = [
        *_regime_log(tmp_path, "low", num_requests=150, rate=30.0, seed=1, **common),
        *_regime_log(tmp_path, "high", num_requests=300, rate=400.0, seed=2, **common),
        *_regime_log(tmp_path, "low-plain", num_requests=150, rate=30.0, seed=3, overlap=False, **common),
        *_regime_log(tmp_path, "high-plain", num_requests=300, rate=400.0, seed=4, overlap=False, **common),
    ]
    held_out = _regime_log(tmp_path, "long", num_requests=100, rate=200.0, seed=5, prompt_mean=1500, output_mean=8)
    fitted = fit_profile(train, model, H200)
    assert fitted.eager.scale == pytest.approx(HOST_TRUE.eager.scale, rel=0.1)
    assert fitted.eager.attn_scale == pytest.approx(HOST_TRUE.eager.attn_scale, rel=0.1)
    assert abs(prediction_error(held_out, model, fitted)["total_error"]) < 0.03


def test_constrained_fit_never_zeroes_a_roofline_scale() -> None:
    """Steps whose device time is a constant whatever their work (as a compile-bound log looks) still get roofline
    scales within [1, 1/MIN_EFFICIENCY]: the constant goes to step_us, not to a zero scale."""
    from fnvllm.sim.calibrate import MAX_ROOFLINE_SCALE

    model = load_shape("qwen3-0.6b")
    records = [
        {"num_seqs": n, "num_tokens": t, "num_decode_seqs": 0, "num_prefill_tokens": t, "context_tokens": t}
        | {"gpu_ms": 45.0, "graph": False, "num_samples": n}
        for n, t in [(1, 134), (16, 3280), (64, 12716), (11, 16384), (32, 16384), (13, 4758)] * 3
    ]
    fitted = fit_profile(records, model, H200)
    for scale in (fitted.eager.scale, fitted.eager.attn_scale):
        assert 1.0 <= scale <= MAX_ROOFLINE_SCALE
    assert fitted.eager.step_us > 0


def _box_brute_force(x: np.ndarray, y: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> float:
    """The least squared residual of ``y ~ x`` over every assignment of the coefficients to free / lower / upper
    (the optimum of a box-constrained least-squares problem is one of them)."""
    import itertools

    best = np.inf
    for states in itertools.product((0, 1, 2), repeat=x.shape[1]):
        at = np.array(states)
        if np.isinf(lower[at == 1]).any() or np.isinf(upper[at == 2]).any():
            continue
        coef = np.where(at == 2, upper, lower).astype(float)
        free = np.flatnonzero(at == 0)
        if len(free):
            bound = np.flatnonzero(at != 0)
            rest = y - x[:, bound] @ coef[bound]
            coef[free] = np.linalg.lstsq(x[:, free], rest, rcond=None)[0]
        if (coef < lower - 1e-9).any() or (coef > upper + 1e-9).any():
            continue
        best = min(best, float(np.sum((x @ coef - y) ** 2)))
    return best


def test_box_least_squares_finds_the_constrained_optimum() -> None:
    """fit_bounded's active-set solution stays within the bounds and its residual equals the best of every
    free / lower / upper assignment of the coefficients, on random problems with columns of very different
    scales."""
    from fnvllm.sim.calibrate import fit_bounded

    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(2, 6))
        x = rng.normal(size=(30, n)) * rng.uniform(0.01, 1000.0, size=n)
        y = rng.normal(size=30) * 50
        lower = np.where(rng.random(n) < 0.6, 0.0, -np.inf)
        upper = np.where(rng.random(n) < 0.4, rng.uniform(0.5, 3.0, size=n), np.inf)
        coef = fit_bounded(x, y, lower, upper)
        assert (coef >= lower - 1e-9).all() and (coef <= upper + 1e-9).all()
        loss = float(np.sum((x @ coef - y) ** 2))
        assert loss <= _box_brute_force(x, y, lower, upper) * (1 + 1e-9) + 1e-9


SMALL_TRUE = Overheads(
    attn_scale=1.5,
    step_us=700.0,
    seq_us=1.0,
    log_seq_us=30.0,
    small_us=(450.0, 720.0, 760.0, 790.0),
    host_us=900.0,
    host_seq_us=2.0,
    gap_us=300.0,
    gap_seq_us=1.5,
)
UNTIMED_MS = 0.08  # the part of a host-paced cycle that cpu_ms does not time


def _small_batch_records(cost: CostModel) -> list[dict]:
    """Decode graph steps of 1 to 128 rows, overlapped and plain, timed as the engine's timeline times them: an
    overlapped step whose host is slower than its device shows the host's cycle as its device time (the device
    timer starts when the host begins the step) plus UNTIMED_MS as idle gap; a plain step shows its device time
    and the gap before it."""
    records = []
    for rows in [1] * 30 + [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128] * 3:
        shape = StepShape(rows, rows, rows, 0, rows * 400, rows * 400, rows, True)
        device, host = cost.device_s(shape) * 1e3, cost.host_s(shape) * 1e3
        paced = host > device
        overlapped = {"gpu_ms": max(device, host), "cpu_ms": host, "gap_ms": UNTIMED_MS if paced else 0.0}
        records.append({**shape.to_record(), **overlapped, "overlap": True})
        plain = {"gpu_ms": device, "cpu_ms": host, "gap_ms": cost.gap_s(shape) * 1e3, "overlap": False}
        records.append({**shape.to_record(), **plain})
    return records


def test_fit_separates_a_host_bound_small_step_into_device_and_host() -> None:
    """A one-row step whose host (0.9 ms) outlasts its device (~0.75 ms) when overlapped: the fit takes its
    device time from the plain steps (device + gap) and its host time from the overlapped wall, so both come back
    within 3 %, the 1-row graph's own constant (small_us) is found, and both loop modes are predicted within 2 %
    in total (a device model fitted to the overlapped device timer would price the plain step at host + gap)."""
    from fnvllm.sim.hardware import SMALL_BATCHES

    model = load_shape("qwen3-0.6b")
    true = attrs.evolve(H200, graph_max_seqs=512, graph=SMALL_TRUE)
    true_cost = CostModel(model, true)
    records = _small_batch_records(true_cost)
    one = StepShape(1, 1, 1, 0, 400, 400, 1, True)
    assert true_cost.host_s(one) > true_cost.device_s(one)  # host-bound when overlapped
    fitted = fit_profile(records, model, attrs.evolve(H200, graph_max_seqs=512))
    cost = CostModel(model, fitted)
    assert cost.device_s(one) == pytest.approx(true_cost.device_s(one), rel=0.03)
    assert cost.host_s(one) == pytest.approx(true_cost.host_s(one) + UNTIMED_MS / 1e3, rel=0.03)
    assert len(fitted.graph.small_us) == len(SMALL_BATCHES)
    assert fitted.graph.small_us[0] == pytest.approx(SMALL_TRUE.small_us[0], rel=0.05)
    for overlap in (True, False):
        mode = [r for r in records if r["overlap"] is overlap]
        assert abs(prediction_error(mode, model, fitted)["total_error"]) < 0.02, overlap

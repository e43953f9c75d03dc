"""Serving: the profile's serving section, the served loop's timing, the eager launch floor, mixed CUDA graphs, and
their fits from timelines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest

from fnvllm.sim import H200, CostModel, HardwareProfile, Overheads, SimSpec, StepShape, load_shape, run_spec
from fnvllm.sim.calibrate import fit_profile, fit_serving
from fnvllm.sim.checks import SimInputError
from fnvllm.sim.executor import SimExecutor
from fnvllm.sim.hardware import Serving, load_profile, save_profile
from fnvllm.sim.timeline import record_shape

MODEL = load_shape("qwen3-0.6b")
DECODE = StepShape(64, 64, 64, 0, 64 * 400, 64 * 400, 64, True)
MIXED = StepShape(65, 464, 64, 400, 64 * 400 + 400, 64 * 400 + 80_200, 65, False)

GRAPH = Overheads(step_us=2000.0, host_us=1500.0)  # device-bound decode: 2.0 ms device, 1.5 ms host
EAGER = Overheads(step_us=1000.0, host_us=1500.0, launch_us=18_000.0)  # launch-bound: 18 ms of launches
SERVED = attrs.evolve(
    H200, graph_max_seqs=512, serving=Serving(eager=EAGER, graph=GRAPH, latency_us=5000.0, calibrated_from="x")
)


def _zero_rooflines(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with ceilings so high that every roofline is ~0 (times are the fitted constants alone)."""
    return attrs.evolve(profile, mem_bandwidth_gbs=1e7, matmul_tflops=1e7, matmul_bandwidth_gbs=1e7)


def test_serving_section_round_trips_and_names_a_bad_field(tmp_path: Path) -> None:
    """A profile with a serving section saves and loads back equal; a bad serving field is an error naming it."""
    save_profile(SERVED, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == SERVED
    data = SERVED.to_dict()
    data["serving"]["latency_us"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(SimInputError, match="latency_us"):
        load_profile(tmp_path / "bad.json")
    data["serving"] = {"colour": 1}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(SimInputError, match="colour"):
        load_profile(tmp_path / "bad.json")
    assert "serving" not in attrs.evolve(H200, serving=None).to_dict()  # a profile without one writes none


def test_cost_model_prices_serving_only_when_asked() -> None:
    """``serving=True`` prices steps with the serving overheads (an eager step at its launch floor); without it,
    or without a serving section, with the profile's own."""
    profile = _zero_rooflines(SERVED)
    served = CostModel(MODEL, profile, serving=True)
    assert served.serving and served.launch_s(MIXED) == pytest.approx(0.018)
    assert served.device_s(MIXED) == pytest.approx(0.018, rel=1e-3)  # max(kernels ~1 ms, launch 18 ms)
    assert served.device_s(DECODE) == pytest.approx(0.002, rel=1e-3)
    offline = CostModel(MODEL, profile)
    assert not offline.serving and offline.launch_s(MIXED) == pytest.approx(H200.eager.launch_us * 1e-6)
    assert not CostModel(MODEL, _zero_rooflines(attrs.evolve(H200, serving=None)), serving=True).serving


def test_device_time_is_the_launch_floor_or_the_kernels() -> None:
    """An eager step's device time is max(kernels, launch): a small step waits for its launches, a large one
    does not."""
    profile = attrs.evolve(H200, eager=attrs.evolve(H200.eager, launch_us=20_000.0))
    cost = CostModel(MODEL, profile)
    small = StepShape(1, 200, 0, 200, 200, 20_100, 1, False)
    large = StepShape(32, 16384, 0, 16384, 16384, 16384 * 512, 32, False)
    assert cost.device_s(small) == pytest.approx(0.020)
    assert cost.compute_s(large) > 0.020 and cost.device_s(large) == cost.compute_s(large)


def _executor(profile: HardwareProfile) -> SimExecutor:
    return SimExecutor(CostModel(MODEL, profile, overlap=True, serving=True))


def test_served_cycle_paces_decodes_at_max_of_device_and_host() -> None:
    """Served timing: device-bound decode steps deliver one every device time; host-bound ones one every host
    cycle."""
    for graph, period in ((GRAPH, 0.002), (attrs.evolve(GRAPH, host_us=3000.0), 0.003)):
        profile = _zero_rooflines(attrs.evolve(SERVED, serving=attrs.evolve(SERVED.serving, graph=graph)))
        ex = _executor(profile)
        times = []
        for _ in range(20):
            ex._served_cycle(DECODE, 0)
            times.append(ex.delivered_s)
        assert times[-1] - times[-2] == pytest.approx(period, rel=1e-3)


def test_served_eager_launch_delays_the_previous_steps_tokens() -> None:
    """The cycle that launches an eager step delivers the step before it only after the launch (18 ms), and the
    eager step itself one host cycle after its launch-bound device time."""
    ex = _executor(_zero_rooflines(SERVED))
    for _ in range(5):
        ex._served_cycle(DECODE, 0)
    before = ex.delivered_s
    ex._served_cycle(MIXED, 1)  # launches the eager step, delivers the last decode
    assert ex.delivered_s - before == pytest.approx(0.018 + 0.0015, rel=1e-3)
    ex._served_cycle(DECODE, 0)  # delivers the eager step: its device ends right after its launch
    assert ex.delivered_s - before == pytest.approx(0.018 + 0.0015 + 0.0015, rel=1e-2)
    assert ex.drain() == pytest.approx(ex.device_free + 0.0015)


def test_served_simulation_finishes_every_request_and_adds_the_latency(tmp_path: Path) -> None:
    """``--serve`` with a serving section: every request finishes, TTFT grows by the server's latency and TPOT
    does not (against the same run with no latency), and the run takes longer than unserved."""
    common = {"workload": "poisson", "num_requests": 60, "rate": 40.0, "output_mean": 30, "prompt_mean": 200}
    save_profile(SERVED, tmp_path / "served.json")
    no_latency = attrs.evolve(SERVED, serving=attrs.evolve(SERVED.serving, latency_us=0.0))
    save_profile(no_latency, tmp_path / "plain.json")
    result, served = run_spec(SimSpec(hardware=str(tmp_path / "served.json"), serve=True, **common))
    _, bare = run_spec(SimSpec(hardware=str(tmp_path / "plain.json"), serve=True, **common))
    _, offline = run_spec(SimSpec(hardware=str(tmp_path / "served.json"), **common))
    assert served["num_finished"] == 60 and not any(math.isnan(f) for f in result.recorder.finish)
    assert served["ttft_p50_ms"] == pytest.approx(bare["ttft_p50_ms"] + 5.0, rel=1e-6)
    assert served["tpot_p50_ms"] == pytest.approx(bare["tpot_p50_ms"], rel=1e-9)
    assert served["tpot_p50_ms"] > offline["tpot_p50_ms"]  # 18 ms eager launches between the decodes


def _served_records(num_cycles: int) -> list[dict]:
    """A served timeline as the engine writes it: runs of 9 decode steps (2 ms device, 1.5 ms host cycle) and an
    eager step (its launch: 18 ms more host in the cycle before it; 19 ms of device)."""
    records = []
    for cycle in range(num_cycles):
        for k in range(10):
            eager_next, eager = k == 8, k == 9
            shape = MIXED if eager else DECODE
            record = {"step": len(records), **shape.to_record(), "num_new_seqs": 1 if eager else 0}
            gpu = 19.0 + 0.01 * (cycle % 3) if eager else 2.0
            cpu = 1.5 + (18.0 if eager_next else 0.0)
            records.append(record | {"gpu_ms": gpu, "gap_ms": 0.0, "cpu_ms": cpu, "end_s": len(records) * 0.003})
    return records


def test_fit_serving_recovers_host_launch_and_device() -> None:
    """From a served timeline, the fit gives the host cycle (1.5 ms) from steps followed by a graph step, the eager
    launch (18 ms) from the cycles before eager steps, and each kind's device time (2 ms, ~19 ms)."""
    records = _served_records(20)
    base = _zero_rooflines(H200)
    serving = fit_serving(records, MODEL, base, source="t")
    cost = CostModel(MODEL, attrs.evolve(base, serving=serving), serving=True)
    assert cost.host_s(DECODE) == pytest.approx(0.0015, rel=0.02)
    assert cost.launch_s(MIXED) == pytest.approx(0.018, rel=0.02)
    assert cost.launch_s(DECODE) == 0.0
    assert cost.device_s(DECODE) == pytest.approx(0.002, rel=0.02)
    assert cost.device_s(MIXED) == pytest.approx(0.019, rel=0.02)
    assert serving.calibrated_from == "t" and serving.latency_us == 0.0


def test_fit_serving_keeps_the_offline_growth_with_the_batch() -> None:
    """A served run over a narrow range of decode batches whose device time rises steeply with the rows: the
    served fit keeps the offline profile's growth terms (no steep per-row slope to extrapolate to larger batches)
    and puts the server's extra device time in the constants."""
    base = _zero_rooflines(attrs.evolve(H200, graph=attrs.evolve(H200.graph, seq_us=0.0, log_seq_us=30.0)))
    records = []
    for k in range(120):
        rows = (16, 32, 48)[k % 3]
        shape = StepShape(rows, rows, rows, 0, rows * 300, rows * 300, rows, True)
        gpu = (700.0 + 10.0 * rows) / 1e3  # 10 us per row: steeper than the offline fit's log2 term
        record = {"step": k, **shape.to_record(), "num_new_seqs": 0}
        records.append(record | {"gpu_ms": gpu, "gap_ms": 0.0, "cpu_ms": 1.0, "end_s": k * 0.002})
    graph = fit_serving(records, MODEL, base, source="t").graph
    for name in ("seq_us", "log_seq_us", "token_us", "attn_scale", "scale"):
        assert getattr(graph, name) <= max(getattr(base.graph, name), 1.0 if name.endswith("scale") else 0.0)
    assert graph.step_us > base.graph.step_us  # the server's extra device time went into the constant


def test_fit_profile_finds_the_eager_launch_floor() -> None:
    """Eager steps whose device time is a floor (20 ms) below some size and their kernels' time above it: the
    fit puts the floor in launch_us, and prices both sizes within 5 %."""
    base = H200
    cost = CostModel(MODEL, attrs.evolve(base, eager=Overheads(attn_scale=1.5, token_us=0.5)))
    records = []
    for tokens in [200, 800, 1500, 3000] * 4 + [12_000, 14_000, 16_384] * 4:
        shape = StepShape(4, tokens, 0, tokens, tokens, tokens * tokens // 8, 4, False)
        gpu_ms = max(cost.compute_s(shape) * 1e3, 20.0)
        records.append({**shape.to_record(), "gpu_ms": gpu_ms, "gap_ms": 0.0, "overlap": True})
    fitted = fit_profile(records, MODEL, base)
    assert fitted.eager.launch_us == pytest.approx(20_000.0, rel=0.01)
    priced = CostModel(MODEL, fitted)
    for record in records:
        assert priced.device_s(record_shape(record)) * 1e3 == pytest.approx(record["gpu_ms"], rel=0.05)


def test_mixed_steps_within_the_graph_token_limit_are_priced_as_graphs() -> None:
    """A profile with graph_mixed_tokens prices a mixed step of at most that many tokens with the graph
    overheads; fit_profile sets the limit from the mixed steps a timeline shows as graphs."""
    profile = attrs.evolve(H200, graph_mixed_tokens=512, eager=Overheads(step_us=15_000.0))
    spec = {"workload": "poisson", "num_requests": 20, "rate": 100.0, "output_mean": 20, "prompt_mean": 100}
    from fnvllm.sim.executor import mixed_graph

    small = attrs.evolve(MIXED, num_tokens=300)
    assert mixed_graph(small, 512).graph and not mixed_graph(small, 32).graph
    records = [{**attrs.evolve(small, graph=True).to_record(), "gpu_ms": 3.0, "gap_ms": 0.0}] * 10
    assert fit_profile(records, MODEL, H200).graph_mixed_tokens == 300
    assert fit_profile([{**DECODE.to_record(), "gpu_ms": 2.0}] * 10, MODEL, H200).graph_mixed_tokens == 0
    ex = SimExecutor(CostModel(MODEL, profile))
    from fnvllm.sim.loop import simulate
    from fnvllm.sim.spec import build_requests, core_config

    sim_spec = SimSpec(**spec)
    config = core_config(sim_spec, MODEL, profile)
    shapes = []
    simulate(
        build_requests(sim_spec, config.max_model_len), config, ex, on_step=lambda *_: shapes.append(ex.last_shape)
    )
    mixed = [s for s in shapes if s is not None and s.num_prefill_tokens]
    assert mixed and all(s.graph == (s.num_tokens <= 512) for s in mixed)


def test_serve_check_refits_a_saved_run(tmp_path: Path) -> None:
    """sim_serve_check's analysis of a saved served folder (trace, per-request timings, served timeline, run
    record) fits a serving section and the server's latency, timed both ways: the fitted profile keeps the timing
    with the smaller worst p50 error, and its TTFT p50 matches the measured one."""
    from benchmarks import sim_serve_check
    from fnvllm.sim.spec import SimSpec as Spec

    out = tmp_path / "serve"
    out.mkdir()
    engine = {**sim_serve_check.ENGINE, "max_model_len": 1024}
    trace = [{"arrival_s": i / 30, "prompt_len": 150 + 7 * (i % 20), "output_len": 20 + i % 15} for i in range(80)]
    (out / "trace.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trace))
    save_profile(SERVED, tmp_path / "true.json")
    with (out / "served_timeline.jsonl").open("w") as timeline:
        spec = Spec(workload=str(out / "trace.jsonl"), hardware=str(tmp_path / "true.json"), serve=True, **engine)
        result, _ = run_spec(spec, timeline=timeline)
    rec = result.recorder
    with (out / "measured.jsonl").open("w") as f:
        for first, arrival, finish, n in zip(rec.first_token, rec.arrival, rec.finish, rec.num_output, strict=True):
            row = {"ttft": first - arrival, "tpot": (finish - first) / (n - 1), "e2e": finish - arrival}
            f.write(json.dumps(row | {"num_tokens": n}) + "\n")
    run = {"device": "sim", "args": {"model_shape": "qwen3-0.6b"}, "engine": engine, "overlap": True}
    (out / "run.json").write_text(json.dumps(run | {"model": MODEL.to_config()}))
    save_profile(attrs.evolve(SERVED, serving=None), tmp_path / "offline.json")
    tables = sim_serve_check.analyse(out, str(tmp_path / "offline.json"))
    fitted = load_profile(out / "profile_served.json")
    assert fitted.serving is not None and fitted.serving.latency_us >= 0
    ttft = next(r for r in tables["served_fit"] if r["metric"] == "ttft" and r["p"] == "p50")
    assert abs(ttft["error"]) < 0.05
    chosen = "cycle by cycle" if fitted.serving.cycle else "step by step"
    assert tables["served_fit"] == tables[f"served_fit ({chosen})"] and (out / "analysis.json").exists()
    worst = {k: max(abs(r["error"]) for r in v if r["p"] == "p50") for k, v in tables.items() if "(" in k}
    assert worst[f"served_fit ({chosen})"] == min(worst.values())


def test_cli_calibrate_fits_a_serving_section_from_a_served_timeline(tmp_path: Path) -> None:
    """`fnvllm simulate calibrate LOG --served SERVED` writes a profile whose serving section is fitted on SERVED
    (its eager launch ~18 ms), and `fnvllm simulate --serve` runs with it."""
    import subprocess
    import sys

    header = json.dumps({"model": MODEL.to_config(), "block_size": 256, "device": "cuda"})
    lines = [header, *(json.dumps(r) for r in _served_records(20))]
    for name in ("steps.jsonl", "served.jsonl"):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    root = Path(__file__).resolve().parent.parent
    cli = [sys.executable, "-m", "fnvllm", "simulate"]
    env = {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    args = ["calibrate", str(tmp_path / "steps.jsonl"), "--served", str(tmp_path / "served.jsonl")]
    done = subprocess.run([*cli, *args, "--out", str(tmp_path / "p.json")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    profile = load_profile(tmp_path / "p.json")
    assert profile.serving is not None
    assert profile.serving.eager.launch_us == pytest.approx(18_000.0, rel=0.05)
    run = [*cli, "--hardware", str(tmp_path / "p.json"), "--serve", "--num-requests", "30", "--json", "--no-progress"]
    done = subprocess.run(run, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and json.loads(done.stdout)["num_finished"] == 30, done.stderr


def test_median_line_ignores_the_tail() -> None:
    """median_line recovers a + b x from data whose tenth of points sit far above the line (a latency tail),
    returns b = 0 for a negative slope or a constant x, and the median there."""
    import numpy as np

    from benchmarks.sim_serve_check import median_line

    rng = np.random.default_rng(0)
    x = rng.integers(5, 60, size=400).astype(float)
    y = 0.004 + 0.0002 * x + rng.normal(0, 0.0002, size=400)
    y[::10] += 0.05
    a, b = median_line(x.tolist(), y.tolist())
    assert a == pytest.approx(0.004, abs=3e-4) and b == pytest.approx(0.0002, rel=0.1)
    assert median_line(x.tolist(), (0.01 - 0.0001 * x).tolist())[1] == 0.0
    assert median_line([3.0] * 5, [1.0, 2.0, 3.0, 4.0, 50.0]) == (3.0, 0.0)


def test_served_latency_grows_with_the_requests_in_flight(tmp_path: Path) -> None:
    """With Serving.latency_stream_us, each request's TTFT and end-to-end latency grow by latency_us +
    latency_stream_us x the requests in flight when it arrived (the recorder's count), and its TPOT not at all."""
    spec = {"workload": "poisson", "num_requests": 60, "rate": 200.0, "output_mean": 30, "prompt_mean": 200}
    base = attrs.evolve(SERVED, serving=attrs.evolve(SERVED.serving, latency_us=0.0))
    runs = {}
    for name, stream_us in (("flat", 0.0), ("per_stream", 300.0)):
        profile = attrs.evolve(base, serving=attrs.evolve(base.serving, latency_us=1000.0, latency_stream_us=stream_us))
        save_profile(profile, tmp_path / f"{name}.json")
        result, _ = run_spec(SimSpec(**spec, hardware=str(tmp_path / f"{name}.json"), serve=True))
        runs[name] = result.recorder
    flat, per_stream = runs["flat"], runs["per_stream"]
    in_flight = per_stream.in_flight_at_arrival()
    assert max(in_flight) > min(in_flight)  # the load varies, so the delays do
    for i, n in enumerate(in_flight):
        assert per_stream.first_token[i] - flat.first_token[i] == pytest.approx(300e-6 * n, abs=1e-9)
        assert per_stream.finish[i] - flat.finish[i] == pytest.approx(300e-6 * n, abs=1e-9)
    with pytest.raises(SimInputError, match="latency_stream_us"):
        Serving(latency_stream_us=-1.0)


def test_split_timeline_cuts_at_the_pauses_before_each_load(tmp_path: Path) -> None:
    """split_timeline writes each load's steps (between the pauses before the loads; the warm-up's first) with
    the header to its folder."""
    from benchmarks.sim_serve_check import split_timeline

    header = json.dumps({"model": MODEL.to_config(), "block_size": 256, "device": "cuda"})
    ends = [0.0, 0.01, 0.02] + [2.5 + 0.002 * i for i in range(50)] + [5.0 + 0.003 * i for i in range(30)]
    steps = [json.dumps({**DECODE.to_record(), "step": i, "gpu_ms": 2.0, "end_s": t}) for i, t in enumerate(ends)]
    (tmp_path / "server.jsonl").write_text("\n".join([header, *steps]) + "\n")
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
    split_timeline(tmp_path / "server.jsonl", folders)
    for folder, (first, count) in zip(folders, ((3, 50), (53, 30)), strict=True):
        lines = (folder / "served_timeline.jsonl").read_text().splitlines()
        assert lines[0] == header and len(lines) == count + 1
        assert json.loads(lines[1])["step"] == first


def _served_folder(out: Path, profile_path: Path, rate: float, seed: int) -> None:
    """A saved served run (what sim_serve_check writes per load) made by simulating ``rate`` requests a second
    under the profile at ``profile_path``: trace, per-request timings, timeline segment, run record."""
    import random

    from benchmarks import sim_serve_check

    out.mkdir(parents=True)
    engine = {**sim_serve_check.ENGINE, "max_model_len": 1024}
    rng, t, trace = random.Random(seed), 0.0, []
    for _ in range(80):
        trace.append({"arrival_s": t, "prompt_len": rng.randint(150, 300), "output_len": rng.randint(20, 40)})
        t += rng.expovariate(rate)
    (out / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    with (out / "served_timeline.jsonl").open("w") as timeline:
        spec = SimSpec(workload=str(out / "trace.jsonl"), hardware=str(profile_path), serve=True, **engine)
        result, _ = run_spec(spec, timeline=timeline)
    rec = result.recorder
    with (out / "measured.jsonl").open("w") as f:
        for first, arrival, finish, n in zip(rec.first_token, rec.arrival, rec.finish, rec.num_output, strict=True):
            row = {"ttft": first - arrival, "tpot": (finish - first) / (n - 1), "e2e": finish - arrival}
            f.write(json.dumps(row | {"num_tokens": n}) + "\n")
    args = {"model_shape": "qwen3-0.6b", "request_rate": rate, "num_requests": len(trace)}
    run = {"device": "sim", "args": args, "engine": engine, "overlap": True, "timeline": "segment"}
    (out / "run.json").write_text(json.dumps(run | {"model": MODEL.to_config()}))


def test_serve_check_checks_the_fitted_section_out_of_sample(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A served folder with a check run beside it (rate-60/): the serving section fitted on the 30/s run predicts
    the 60/s run it never saw (TPOT p50 within 5 %, TTFT p50 within 15 %: both were made by the same profile), the
    per-rate table marks which run was fitted and which is out of sample, and the profile written to ship has its
    latency refitted on both runs (TTFT p50 within 15 % on each)."""
    from benchmarks import sim_serve_check

    true = attrs.evolve(SERVED, serving=attrs.evolve(SERVED.serving, latency_us=3000.0, latency_stream_us=100.0))
    save_profile(true, tmp_path / "true.json")
    _served_folder(tmp_path / "serve", tmp_path / "true.json", 30.0, seed=1)
    _served_folder(tmp_path / "serve" / "rate-60", tmp_path / "true.json", 60.0, seed=2)
    save_profile(attrs.evolve(SERVED, serving=None), tmp_path / "offline.json")
    tables = sim_serve_check.analyse(tmp_path / "serve", str(tmp_path / "offline.json"))
    check = {(r["metric"], r["p"]): r["error"] for r in tables["rate-60"]}
    assert abs(check["tpot", "p50"]) < 0.05 and abs(check["ttft", "p50"]) < 0.15
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rate/s"])
    assert [line.split()[:3] for line in lines[head + 1 : head + 3]] == [["30", "80", "fitted"], ["60", "80", "out"]]
    assert lines[head + 3].startswith("worst out-of-sample p50")
    # the profile to ship: the latency refitted on both runs, the fit on the first alone kept beside it
    assert (tmp_path / "serve" / "profile_fit_run.json").is_file()
    shipped = load_profile(tmp_path / "serve" / "profile_served.json")
    assert shipped.serving is not None and shipped.serving.latency_stream_us >= 0
    for name in ("all_rates", "all_rates rate-60"):
        pooled = {(r["metric"], r["p"]): r["error"] for r in tables[name]}
        assert abs(pooled["ttft", "p50"]) < 0.15, name


def test_an_eager_launch_hides_behind_the_step_before() -> None:
    """The device waits for the part of an eager step's launch (18 ms) that the step before does not hide: all of
    it after an idle device, none after a step of 20 ms, 8 ms after one of 10 ms; the executor passes the last
    step's device time on (a second eager step in a row runs at its kernels' 1 ms) and forgets it over an idle gap
    (the next one waits for its whole launch again)."""
    from fnvllm.state import SamplingParams, StepPlan

    profile = _zero_rooflines(attrs.evolve(H200, eager=attrs.evolve(EAGER, step_us=1000.0), serving=None))
    cost = CostModel(MODEL, attrs.evolve(profile, graph_max_seqs=0, graph_mixed_tokens=0))
    assert cost.step_times(MIXED, 0, True, 0.0)[0] == pytest.approx(0.018, rel=1e-3)
    assert cost.step_times(MIXED, 0, True, 0.020)[0] == pytest.approx(0.001, rel=1e-2)  # its kernels' 1 ms
    assert cost.step_times(MIXED, 0, False, 0.010)[0] == pytest.approx(0.008, rel=1e-3)

    def prefill(step: int) -> StepPlan:
        return StepPlan(
            step=step, block_size=16, seq_ids=("a",), input_tokens=((1,) * 64,), start_positions=(0,),
            block_tables=((0, 1, 2, 3),), sample=(True,), params=(SamplingParams(),), num_generated=(0,),
            histories=(None,),
        )  # fmt: skip

    def devices(cost: CostModel) -> list[float]:
        ex, out = SimExecutor(cost), []
        for step in range(3):
            if step == 2:
                ex.advance_to(ex.clock + 1.0)  # idle: the next launch hides behind nothing
            ex.execute(prefill(step))
            out.append(ex.last_device_s)
        return out

    assert devices(cost) == pytest.approx([0.018, 0.001, 0.018], rel=1e-2)
    # a plain loop launches each step after the one before it finished: every step waits for its whole launch
    plain = CostModel(MODEL, cost.hardware, overlap=False)
    assert devices(plain) == pytest.approx([0.018, 0.018, 0.018], rel=1e-2)


def test_only_an_overlapped_steps_launch_hides_behind_the_step_before_it_in_a_timeline() -> None:
    """``hidden_launch_ms``: the device time of the record before, for an overlapped step that follows it; 0 for a
    plain step (its launch began after the step before had finished), a run's first step, a step after an idle
    gap longer than the step before, and a step that does not follow the record before."""
    from fnvllm.sim.calibrate import hidden_launch_ms

    def record(step: int, overlap: bool, gap: float = 0.0, **extra: object) -> dict[str, object]:
        return {"step": step, "gpu_ms": 10.0 + step, "gap_ms": gap, "overlap": overlap, **extra}

    overlapped = [record(0, True), record(1, True), record(2, True, gap=20.0), record(4, True)]
    assert hidden_launch_ms(overlapped) == [0.0, 10.0, 0.0, 0.0]
    plain = [record(0, False), record(1, False), record(2, False)]
    assert hidden_launch_ms(plain) == [0.0, 0.0, 0.0]
    assert hidden_launch_ms([record(0, True), record(1, True, first_in_run=True)]) == [0.0, 0.0]
    unsaid = [{"step": 0, "gpu_ms": 5.0}, {"step": 1, "gpu_ms": 5.0}]  # a log that never says its loop mode
    assert hidden_launch_ms(unsaid) == [0.0, 5.0]

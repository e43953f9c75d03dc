"""`fnvllm simulate --check`: a recorded run (timeline + run record) replayed in the simulator, on CPU."""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs
import pytest

from fnvllm.cli import main
from fnvllm.sim import H200, CostModel, SimExecutor, SimRequest, load_profile, load_shape, save_profile, simulate
from fnvllm.sim.check import check_run, read_run
from fnvllm.sim.recorder import RunRecorder, run_path
from fnvllm.sim.timeline import TimelineWriter
from fnvllm.state import CoreConfig

# The "true" profile runs are recorded under: the built-in's ceilings and overheads, with a host model and an
# intake time of its own (so the tests do not move when the built-in is refitted).
TRUE = attrs.evolve(
    H200,
    eager=attrs.evolve(H200.eager, host_us=3000.0, host_new_seq_us=80.0),
    graph=attrs.evolve(H200.graph, host_us=1700.0, host_seq_us=0.4),
    request_us=400.0,
)
CONFIG = CoreConfig(block_size=16, num_blocks=400, max_num_batched_tokens=512, max_num_seqs=8, vocab_size=151936)


def _record_simulated_run(folder: Path, overlap: bool) -> Path:
    """A run 'recorded' from the simulator under TRUE: its timeline and run record, clocked by the simulator."""
    model = load_shape("qwen3-0.6b")
    executor = SimExecutor(CostModel(model, TRUE, overlap))
    recorder = RunRecorder(CONFIG, overlap, "Simulated H200", clock=lambda: executor.clock)
    rng = random.Random(0)
    requests = [SimRequest(0.05 * (i // 4), rng.randint(20, 300), rng.randint(5, 40)) for i in range(16)]
    path = folder / "steps.jsonl"
    with path.open("w") as stream:
        writer = TimelineWriter(stream)
        writer.header(model.to_config(), CONFIG.block_size, "cuda:0")

        def on_step(state, plan, output):  # type: ignore[no-untyped-def]
            ex = executor
            writer.step(plan.step, ex.last_shape, ex.last_device_s, ex.last_gap_s, ex.last_host_s)
            recorder.on_step(state, plan, output)

        for r in requests:  # the recorder hears of arrivals as the engine's driver would (same clock)
            recorder.requests.append({"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "max_tokens": r.output_len})
        simulate(requests, CONFIG, executor, on_step=on_step)
    recorder.finish([r.output_len for r in requests])
    recorder.write(run_path(path))
    return path


@pytest.mark.parametrize("overlap", [True, False])
def test_check_of_a_run_under_its_own_profile_has_no_error(tmp_path: Path, overlap: bool) -> None:
    """Replaying a run with the profile that timed it reproduces its plans, its total and every step exactly."""
    timeline = _record_simulated_run(tmp_path, overlap)
    result = check_run(timeline, run_path(timeline), TRUE)
    assert result.same_plans == "yes"
    assert result.predicted_s == pytest.approx(result.measured_s, rel=1e-9)
    assert result.step_errors["max_abs"] == pytest.approx(0.0, abs=1e-9)
    assert result.num_requests == 16


def test_check_reports_the_error_of_a_wrong_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With a profile whose steps cost 5 ms more the replay is slower than the run; the CLI prints end-to-end and
    per-step error (per step when the plans line up: with the run's own profile)."""
    timeline = _record_simulated_run(tmp_path, overlap=True)
    save_profile(TRUE, tmp_path / "true.json")
    slower = {"eager": attrs.evolve(TRUE.eager, step_us=TRUE.eager.step_us + 5000.0)}
    small = tuple(us + 5000.0 for us in TRUE.graph.small_us)  # the 1-8 row graphs' own constants
    graph = attrs.evolve(TRUE.graph, step_us=TRUE.graph.step_us + 5000.0, small_us=small)
    wrong = attrs.evolve(TRUE, graph=graph, **slower)
    assert check_run(timeline, run_path(timeline), wrong).error > 0.05
    code = main(["simulate", "--check", str(timeline), "--hardware", str(tmp_path / "true.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "end to end: measured" in out and "per-step wall error" in out and "planned the engine's steps: yes" in out


def test_check_without_a_run_record_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--check on a timeline whose run record is missing is one line naming the expected file, exit 2."""
    timeline = _record_simulated_run(tmp_path, overlap=True)
    run_path(timeline).unlink()
    assert main(["simulate", "--check", str(timeline)]) == 2
    assert "steps.run.json" in capsys.readouterr().err


def test_run_record_missing_output_lengths_is_refused(tmp_path: Path) -> None:
    """A run record whose requests never got finish() is refused naming the request."""
    recorder = RunRecorder(CONFIG, True)
    recorder.arrive([[1, 2, 3]], [4])
    recorder.steps.append({"step": 0, "end_s": 0.1, "num_new_seqs": 1})
    recorder.write(tmp_path / "r.run.json")
    with pytest.raises(ValueError, match="request 0 has no output_len"):
        read_run(tmp_path / "r.run.json")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of the embedded demo model on CPU, with FNVLLM_TIMELINE and a RunRecorder."""
    from fnvllm.demo import model_path
    from fnvllm.llm import LLM
    from fnvllm.state import SamplingParams

    folder = tmp_path_factory.mktemp("demo_run")
    timeline = folder / "steps.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FNVLLM_TIMELINE", str(timeline))
        llm = LLM(model_path(), num_blocks=64, load_tokenizer=False)
    recorder = RunRecorder(llm.engine.config, llm.loop.overlap, "cpu", model_name="fnvllm-demo")
    llm.loop.on_step = recorder.on_step
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 200) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    recorder.arrive(prompts, [8] * 6)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    recorder.finish([len(o.token_ids) for o in outputs])
    recorder.write(run_path(timeline))
    llm.executor.timeline.close()
    return timeline


def test_demo_model_run_calibrates_and_checks_on_cpu(
    demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """calibrate names the profile after the CPU and records the demo model; --check replays the run with it,
    planning exactly the engine's steps."""
    profile_file = tmp_path / "cpu.json"
    assert main(["simulate", "calibrate", str(demo_run), "--out", str(profile_file)]) == 0
    profile = load_profile(profile_file)
    assert profile.name == "cpu" and profile.mem_bandwidth_gbs != H200.mem_bandwidth_gbs
    assert profile.model is not None and profile.model["num_hidden_layers"] >= 1
    assert profile.model["name"] == "fnvllm-demo"
    capsys.readouterr()
    assert main(["simulate", "--check", str(demo_run), "--hardware", str(profile_file), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["same_plans"] == "yes" and result["num_requests"] == 6
    assert result["measured_s"] > 0 and result["predicted_s"] > 0


def test_simulate_uses_the_profile_model_unless_told_otherwise(tmp_path: Path) -> None:
    """A profile that records a model (as calibrate writes it) makes simulate price that model by default;
    --model-shape still wins."""
    eight_b = load_shape("qwen3-8b")
    save_profile(attrs.evolve(H200, model={**eight_b.to_config(), "name": "qwen3-8b"}), tmp_path / "p.json")
    small = ["--num-requests", "5", "--num-blocks", "300", "--no-progress", "--hardware", str(tmp_path / "p.json")]
    for extra, hidden in (([], 4096), (["--model-shape", "qwen3-0.6b"], 1024)):
        timeline = tmp_path / f"t{hidden}.jsonl"
        assert main(["simulate", *small, *extra, "--timeline", str(timeline)]) == 0
        header = json.loads(timeline.read_text().splitlines()[0])
        assert header["model"]["hidden_size"] == hidden


def test_request_intake_time_is_fitted_from_a_runs_first_step(tmp_path: Path) -> None:
    """A run simulated with 400 us of host time per arriving request gives request_us = 400 back."""
    from fnvllm.sim.check import fit_request_us, run_records
    from fnvllm.sim.timeline import read_timeline

    assert TRUE.request_us == 400.0
    timeline = _record_simulated_run(tmp_path, overlap=True)
    run = read_run(run_path(timeline))
    records = run_records(read_timeline(timeline)[1], run)
    assert records[0]["first_in_run"] and not records[1].get("first_in_run")
    assert fit_request_us([(run, records)], load_shape("qwen3-0.6b"), TRUE) == pytest.approx(400.0, rel=1e-6)
    no_intake = attrs.evolve(TRUE, request_us=0.0)
    assert check_run(timeline, run_path(timeline), no_intake).error < 0

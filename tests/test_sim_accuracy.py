"""benchmarks/sim_accuracy.py on synthetic engine output: timelines written by the simulator under a known profile,
laid out as benchmarks/sim_h200_check.sh lays out the GPU engine's (warm-up steps first, bench record, flags)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from benchmarks import sim_accuracy
from fnvllm.sim import H200, CostModel, HardwareProfile, Overheads, SimExecutor, save_profile, simulate
from fnvllm.sim.model import load_shape
from fnvllm.state import EngineState, StepOutput, StepPlan

TRUE = HardwareProfile(
    name="true",
    mem_bandwidth_gbs=H200.mem_bandwidth_gbs,
    matmul_tflops=H200.matmul_tflops,
    matmul_bandwidth_gbs=H200.matmul_bandwidth_gbs,
    memory_gib=H200.memory_gib,
    graph_max_seqs=512,
    eager=Overheads(scale=1.3, attn_scale=1.8, step_us=250.0, seq_us=3.0, token_us=0.2, gap_us=80.0, gap_seq_us=0.5),
    graph=Overheads(scale=1.3, attn_scale=1.5, step_us=30.0, seq_us=0.8, gap_us=20.0, gap_seq_us=0.1),
)
ENGINE = "--model-shape qwen3-0.6b --block-size 16 --max-num-batched-tokens 1024"
FLAGS = {
    "A": f"{ENGINE} --num-requests 40 --max-input-len 300 --max-output-len 150 --max-num-seqs 16",
    "B": f"{ENGINE} --num-requests 16 --max-input-len 400 --max-output-len 120",
}
NUM_BLOCKS = 1000


def _write_run(folder: Path, name: str) -> None:
    """RUN.flags, RUN.jsonl (warm-up then timed steps, times from TRUE) and RUN.json, like the GPU script."""
    (folder / f"{name}.flags").write_text(FLAGS[name] + "\n")
    flags = sim_accuracy.bench_flags(FLAGS[name])
    model = load_shape("qwen3-0.6b")
    run = sim_accuracy.Run(name, {}, [], [], {"num_blocks": NUM_BLOCKS}, flags, model)
    executor = SimExecutor(CostModel(model, TRUE))
    lines = [json.dumps({"model": model.to_config(), "block_size": flags.block_size, "device": "cuda"})]
    timed: list[float] = []

    def on_step(state: EngineState, plan: StepPlan, output: StepOutput) -> None:
        device, gap, shape = executor.last_device_s, executor.last_gap_s, executor.last_shape
        assert shape is not None
        record = {"step": plan.step, **shape.to_record(), "gpu_ms": device * 1e3, "gap_ms": gap * 1e3, "cpu_ms": 0.0}
        lines.append(json.dumps(record))
        if executor.clock > sim_accuracy.IDLE_GAP_S:
            timed.append(device + gap)

    requests = sim_accuracy.bench_requests(run)
    simulate(requests, sim_accuracy.core_config(run), executor, on_step=on_step)
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    bench = {"requests": flags.num_requests, "seconds": sum(timed), "steps": len(timed), "num_blocks": NUM_BLOCKS}
    (folder / f"{name}.json").write_text("log line\n" + json.dumps(bench) + "\n")


def test_accuracy_script_recovers_a_known_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fitted on A's synthetic timeline, the script predicts B's bench time within 1% (and the reverse), finds
    the timed steps after the warm-up, and reports that the simulator planned the logged steps exactly."""
    for name in sim_accuracy.RUNS:
        _write_run(tmp_path, name)
    # the base: H200's ceilings, overheads near TRUE's and no host model (a kind of step with few records keeps
    # the base's overheads)
    eager = Overheads(scale=1.1, attn_scale=1.6, step_us=400.0, seq_us=2.0, token_us=0.05, gap_us=100.0, gap_seq_us=0.5)
    graph = Overheads(scale=1.1, attn_scale=1.6, step_us=40.0, seq_us=0.5, gap_us=30.0, gap_seq_us=0.2)
    base = attrs.evolve(H200, eager=eager, graph=graph, request_us=0.0)
    save_profile(base, tmp_path / "base.json")
    args = [str(tmp_path), "--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "r.json")]
    assert sim_accuracy.main([*args, "--base", str(tmp_path / "base.json")]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert [(r["fit"], r["predicted_run"]) for r in results] == [("A", "B"), ("B", "A")]
    for r in results:
        assert r["same_plans"] == "yes"
        assert abs(r["error_vs_bench"]) < 0.01, r
        assert r["measured_timeline_s"] == pytest.approx(r["measured_bench_s"], rel=1e-9)
    assert "fit on A" in capsys.readouterr().out
    assert (tmp_path / "out" / "profile_A.json").is_file()


def test_accuracy_script_names_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder without the GPU script's files is a one-line error naming the first missing one (exit 2)."""
    assert sim_accuracy.main([str(tmp_path)]) == 2
    assert "A.jsonl is missing" in capsys.readouterr().err

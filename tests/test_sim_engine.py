"""The simulator against the real engine: identical plans for the same requests and tokens, the executor
protocol, a CPU timeline it can calibrate from, and no torch import."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from fnvllm.sim import H200, CostModel, ReplayTokens, SimExecutor, SimRequest, fit_profile, load_shape, simulate
from fnvllm.sim.calibrate import prediction_error
from fnvllm.sim.cost import step_shape
from fnvllm.sim.timeline import read_timeline, record_new_seqs, record_shape
from fnvllm.state import SamplingParams, StepPlan


class Recording:
    """Wraps an executor: keeps every plan, its sampled tokens and its wall time."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.plans: list[StepPlan] = []
        self.tokens: list[tuple[int, ...]] = []
        self.seconds: list[float] = []

    def execute(self, plan: StepPlan) -> Any:
        start = time.perf_counter()
        result = self.inner.execute(plan)
        self.seconds.append(time.perf_counter() - start)
        self.plans.append(plan)
        self.tokens.append(tuple(result.token_ids))
        return result

    def reset(self, next_step: int) -> None:
        self.inner.reset(next_step)


def _not_graph(attribute: attrs.Attribute[Any], value: Any) -> bool:
    return attribute.name != "graph"


def _workload(seed: int, n: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    return prompts, [rng.randint(2, 16) for _ in range(n)]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One greedy CPU run of a tiny Qwen3 under preemption pressure, recorded, with the engine's timeline."""
    from fnvllm.llm import LLM
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("sim_engine")
    ckpt = write_tiny_checkpoint(root / "ckpt", "qwen3", hidden_size=64, num_layers=2, vocab_size=256)
    os.environ["FNVLLM_TIMELINE"] = str(root / "timeline.jsonl")
    try:
        llm = LLM(
            ckpt, load_tokenizer=False, device="cpu", dtype="float32", block_size=4, num_blocks=40,
            max_num_batched_tokens=32, max_num_seqs=6,
        )  # fmt: skip
    finally:
        del os.environ["FNVLLM_TIMELINE"]
    recording = Recording(llm.engine.executor)
    llm.engine.executor = recording
    prompts, max_tokens = _workload(0, 12)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens], use_tqdm=False)
    llm.executor.timeline.close()
    return {"llm": llm, "rec": recording, "prompts": prompts, "max_tokens": max_tokens, "outputs": outputs,
            "timeline": root / "timeline.jsonl", "ckpt": ckpt}  # fmt: skip


def test_simulator_and_engine_make_identical_plans(engine_run: dict[str, Any]) -> None:
    """Fed the engine's sampled tokens, the simulator schedules exactly the engine's plans, step by step."""
    rec, llm = engine_run["rec"], engine_run["llm"]
    assert any(plan.preempted for plan in rec.plans)  # the pool is small enough to force preemption
    pairs = zip(engine_run["prompts"], engine_run["max_tokens"], strict=True)
    requests = [SimRequest(0.0, len(p), n, prompt=tuple(p)) for p, n in pairs]
    sim_plans: list[StepPlan] = []
    executor = SimExecutor(CostModel(load_shape(engine_run["ckpt"]), H200), ReplayTokens(rec.tokens))
    result = simulate(
        requests, llm.engine.config, executor, ignore_eos=False, on_step=lambda s, plan, o: sim_plans.append(plan)
    )
    assert sim_plans == rec.plans
    engine_outputs = [tuple(o.token_ids) for o in engine_run["outputs"]]
    assert result.recorder.num_output == [len(t) for t in engine_outputs]


def test_engine_timeline_calibrates_a_cpu_profile(engine_run: dict[str, Any], tmp_path: Path) -> None:
    """The CPU engine's FNVLLM_TIMELINE log reads back, and a profile fitted to its steps reproduces their total
    time within 10 %. The times are those a known profile gives each logged step (device, gap and host), not the
    shared CPU's wall clock, whose 2x swings under load would make this a test of the machine's load."""
    header, records = read_timeline(engine_run["timeline"])
    assert len(records) == len(engine_run["rec"].plans)
    model = load_shape(engine_run["ckpt"])
    assert header["model"]["hidden_size"] == model.hidden
    eager = attrs.evolve(H200.eager, step_us=3 * H200.eager.step_us, gap_us=0.5 * H200.eager.gap_us)
    truth = CostModel(model, attrs.evolve(H200, graph_max_seqs=0, eager=eager))  # not the profile the fit starts at
    timed = []
    for record in records:
        shape, new = record_shape(record), record_new_seqs(record)
        device, gap, host = truth.device_s(shape), truth.gap_s(shape, new), truth.host_s(shape, new)
        timed.append({**record, "gpu_ms": 1e3 * device, "gap_ms": 1e3 * gap, "cpu_ms": 1e3 * host})
    cpu = fit_profile(timed, model, H200, source="cpu")
    assert cpu.graph_max_seqs == 0  # the CPU engine replays no CUDA graphs
    assert abs(prediction_error(timed, model, cpu)["total_error"]) < 0.10


def test_engine_timeline_logs_the_simulators_step_shapes(engine_run: dict[str, Any]) -> None:
    """Every record of the engine's timeline carries exactly the shape the simulator computes for its plan,
    attention pairs and sample counts included (so calibration needs no estimates)."""
    _, records = read_timeline(engine_run["timeline"])
    plans = [plan for plan in engine_run["rec"].plans if not plan.is_empty]
    assert len(records) == len(plans)
    for record, plan in zip(records, plans, strict=True):
        shape = step_shape(plan, graph_max_seqs=0)
        assert record["step"] == plan.step
        assert {k: record[k] for k in shape.to_record() if k != "graph"} == attrs.asdict(shape, filter=_not_graph)
        assert record_shape(record) == shape


def test_sim_executor_drives_the_engine_class() -> None:
    """SimExecutor satisfies the executor protocol: Engine.step runs its plans and commits its tokens."""
    from fnvllm.engine import Engine
    from fnvllm.state import CoreConfig, add_request, schedule

    config = CoreConfig(block_size=4, num_blocks=32, vocab_size=1000)
    executor = SimExecutor(CostModel(load_shape("qwen3-0.6b"), H200))
    engine = Engine(executor, config)
    state = add_request(engine.initial_state(), "a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    clocks = []
    while state.has_unfinished:
        state, plan = schedule(state)
        state, _ = engine.step(state, plan)
        clocks.append(executor.clock)
    assert len(clocks) == 3 and clocks == sorted(clocks) and clocks[0] > 0


def test_sim_imports_and_runs_without_torch() -> None:
    """With torch unimportable, fnvllm.sim imports and runs a small simulation (it never needs torch)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from fnvllm.sim import SimSpec, run_spec\n"
        "_, s = run_spec(SimSpec(num_requests=20, num_blocks=500))\n"
        "assert s['num_finished'] == 20, s\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m, v in sys.modules.items() if v is not None)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

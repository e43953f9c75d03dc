"""The simulator's pieces: cost model, executor, workloads, and the loop's conservation and clock."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from fnvllm.executor.base import StalePlanError
from fnvllm.sim import (
    H200,
    CostModel,
    FillerTokens,
    ModelShape,
    SimExecutor,
    SimRequest,
    SimSpec,
    bench_requests,
    load_shape,
    poisson_requests,
    prompt_tokens,
    read_trace,
    run_spec,
    shared_prefix_requests,
    simulate,
    step_shape,
    write_trace,
)
from fnvllm.sim.workloads import bench_prompts
from fnvllm.state import CoreConfig, SamplingParams, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QWEN3_06B = load_shape("qwen3-0.6b")
SMALL = {"model": "qwen3-0.6b", "block_size": 16, "num_blocks": 400, "max_num_batched_tokens": 512}


def _plan(lens: list[int], starts: list[int]) -> StepPlan:
    n = len(lens)
    return StepPlan(
        step=0,
        block_size=16,
        seq_ids=tuple(str(i) for i in range(n)),
        input_tokens=tuple((1,) * q for q in lens),
        start_positions=tuple(starts),
        block_tables=tuple((i,) for i in range(n)),
        sample=(True,) * n,
        params=(SamplingParams(),) * n,
        num_generated=(0,) * n,
        histories=(None,) * n,
    )


def test_named_shapes_match_the_checkpoints() -> None:
    """The named Qwen3 shapes carry the published dimensions and weight sizes (0.6B tied: ~0.6e9 params)."""
    assert (QWEN3_06B.hidden, QWEN3_06B.layers, QWEN3_06B.q_heads, QWEN3_06B.kv_heads) == (1024, 28, 16, 8)
    assert QWEN3_06B.weight_bytes / 2 == pytest.approx(0.596e9, rel=0.01)
    big = load_shape("qwen3-8b")
    assert big.weight_bytes / 2 == pytest.approx(8.19e9, rel=0.01)
    assert QWEN3_06B.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_step_shape_counts_a_mixed_plan() -> None:
    """A decode at position 9 and a 4-token chunk at position 0: counts, context and causal pairs by hand."""
    shape = step_shape(_plan([1, 4], [9, 0]), graph_max_seqs=512)
    assert (shape.num_seqs, shape.num_tokens, shape.num_decode_seqs, shape.num_prefill_tokens) == (2, 5, 1, 4)
    assert shape.context_tokens == 10 + 4
    assert shape.attn_pairs == 10 + (1 + 2 + 3 + 4)
    assert not shape.graph
    assert step_shape(_plan([1, 1], [5, 7]), graph_max_seqs=512).graph


def test_roofline_of_a_decode_step_is_the_weight_and_kv_read() -> None:
    """A 1-sequence decode is memory bound: its roofline is the weights (layers + LM head) over the bandwidth
    matmuls stream them at, plus the KV over the read bandwidth."""
    cost = CostModel(QWEN3_06B, H200)
    shape = step_shape(_plan([1], [999]), graph_max_seqs=0)
    m = QWEN3_06B
    weight_bytes = m.layers * 2 * m.layer_params + 2 * m.vocab * m.hidden + 8 * m.vocab
    kv_bytes = m.layers * 2 * 1000 * 2 * m.kv_size
    expected = weight_bytes / H200.matmul_bytes_per_s + kv_bytes / H200.bytes_per_s
    assert cost.roofline_s(shape) == pytest.approx(expected, rel=0.01)


def test_roofline_of_a_long_prefill_is_compute_bound() -> None:
    """An 8192-token prefill costs at least its matmul FLOPs at the matmul rate, and more than a decode."""
    cost = CostModel(QWEN3_06B, H200)
    shape = step_shape(_plan([8192], [0]), graph_max_seqs=0)
    flops = 2 * 8192 * QWEN3_06B.layer_params * QWEN3_06B.layers
    assert cost.roofline_s(shape) >= flops / H200.flops_per_s
    assert cost.roofline_s(shape) > 10 * cost.roofline_s(step_shape(_plan([1], [8191]), 0))


def test_executor_advances_the_clock_and_rejects_stale_plans() -> None:
    """execute() adds the plan's predicted time to the clock (the first step, after an idle device, as a plain
    loop's step: device + gap) and refuses a repeated step."""
    cost = CostModel(QWEN3_06B, H200)
    executor = SimExecutor(cost)
    plan = _plan([1, 1], [10, 20])
    result = executor.execute(plan)
    assert result.token_ids == (3, 3) and executor.last_plain
    assert executor.clock == pytest.approx(cost.wall_s(step_shape(plan, H200.graph_max_seqs), 0, False))
    with pytest.raises(StalePlanError):
        executor.execute(plan)


def test_filler_tokens_draw_eos_at_the_given_rate() -> None:
    """FillerTokens with eos_prob 0.25 returns EOS for about a quarter of 4000 samples, reproducibly."""
    plan = _plan([1] * 4000, [0] * 4000)
    tokens = FillerTokens(eos_prob=0.25, seed=7).tokens(plan)
    assert tokens == FillerTokens(eos_prob=0.25, seed=7).tokens(plan)
    assert tokens.count(0) / 4000 == pytest.approx(0.25, abs=0.03)


def test_bench_workload_equals_the_benchmark_draw() -> None:
    """The simulator's bench workload is exactly benchmarks/workload.py's prompts and max_tokens."""
    from fnvllm.workloads import bench_workload

    prompts, params = bench_workload()
    sim_prompts, max_tokens = bench_prompts()
    assert sim_prompts == prompts
    assert max_tokens == [p.max_tokens for p in params]
    requests = bench_requests()
    assert [list(r.prompt or ()) for r in requests] == prompts
    assert all(r.arrival_s == 0 for r in requests)


def test_poisson_workload_is_seeded_and_within_limits() -> None:
    """Poisson arrivals are increasing, reproducible, near the rate, and prompt + output fits max_len."""
    requests = poisson_requests(2000, rate=40, seed=3, max_len=1024)
    assert requests == poisson_requests(2000, rate=40, seed=3, max_len=1024)
    times = [r.arrival_s for r in requests]
    assert times == sorted(times) and times[0] == 0
    assert len(times) / times[-1] == pytest.approx(40, rel=0.1)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 1024 for r in requests)


def test_shared_prefix_prompts_share_exactly_their_prefix() -> None:
    """Two requests of one prefix id agree on prefix_len tokens and then differ; other prefixes differ at once."""
    requests = shared_prefix_requests(200, rate=10, num_prefixes=2, prefix_len=64, seed=1)
    by_prefix: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_prefix.setdefault(r.prefix_id or 0, []).append(i)
    a, b = by_prefix[0][:2]
    pa, pb = prompt_tokens(requests[a], a, 1000), prompt_tokens(requests[b], b, 1000)
    assert pa[:64] == pb[:64] and pa[64:67] != pb[64:67]
    other = by_prefix[1][0]
    assert prompt_tokens(requests[other], other, 1000)[:3] != pa[:3]


def test_trace_round_trip_and_errors(tmp_path: Path) -> None:
    """write_trace / read_trace round-trip (sorted by arrival); a bad line is reported with its number."""
    requests = [SimRequest(1.5, 10, 5), SimRequest(0.5, 20, 7, prefix_id=3, prefix_len=8, priority=2)]
    path = tmp_path / "t.jsonl"
    write_trace(requests, path)
    assert read_trace(path) == sorted(requests, key=lambda r: r.arrival_s)
    path.write_text('{"arrival_s": 0, "prompt_len": 3, "output_len": 1}\n{"arrival_s": 1, "prompt_len": 0}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_trace(path)


def _run(**options: object):
    return run_spec(SimSpec.from_dict({**SMALL, **options}))


@pytest.mark.parametrize("workload", ["poisson", "shared-prefix"])
def test_every_request_finishes_with_the_tokens_it_asked_for(workload: str) -> None:
    """Conservation under preemption pressure: each request finishes with exactly output_len tokens."""
    result, summary = _run(
        workload=workload, num_requests=150, rate=math.inf, prompt_mean=200, output_mean=60, prefix_len=128
    )
    rec = result.recorder
    assert summary["num_finished"] == 150 and not result.final_state.has_unfinished
    assert rec.num_output == rec.output_len
    assert rec.num_generated == sum(rec.output_len)
    assert summary["preemptions"] > 0  # 400 blocks of 16 cannot hold the burst
    if workload == "shared-prefix":
        assert summary["prefix_hit_rate"] > 0.2


def test_clock_is_monotone_and_events_are_ordered() -> None:
    """Steps never overlap or go back in time; arrival <= scheduled <= first token <= finish per request."""
    result, _ = _run(workload="poisson", num_requests=100, rate=5, output_mean=20)
    rec = result.recorder
    for k in range(1, len(rec.step_end)):
        assert rec.step_start[k] >= rec.step_end[k - 1] - 1e-12
        assert rec.step_end[k] >= rec.step_start[k]
    for a, s, t, f in zip(rec.arrival, rec.first_scheduled, rec.first_token, rec.finish, strict=True):
        assert a <= s < t <= f
    assert result.end_s == rec.step_end[-1] and result.end_s >= rec.arrival[-1]


def test_eos_probability_ends_requests_early() -> None:
    """With eos_prob 0.05, requests of 200 tokens stop early (at an EOS) and never exceed what they asked."""
    result, summary = _run(workload="poisson", num_requests=80, rate=50, output_mean=200, len_sigma=0, eos_prob=0.05)
    rec = result.recorder
    assert summary["num_finished"] == 80
    assert all(1 <= n <= asked for n, asked in zip(rec.num_output, rec.output_len, strict=True))
    assert sum(rec.num_output) < 0.5 * sum(rec.output_len)


def test_policies_change_the_order_not_the_work() -> None:
    """Shortest-job-first serves the same tokens as FCFS but lowers the mean end-to-end latency under load."""
    common = {"workload": "poisson", "num_requests": 200, "rate": math.inf, "output_mean": 100, "max_num_seqs": 16}
    fcfs, sjf = _run(**common)[1], _run(**common, policy="sjf")[1]
    assert fcfs["output_tokens"] == sjf["output_tokens"]
    assert sjf["e2e_mean_ms"] < fcfs["e2e_mean_ms"]


def test_simulate_accepts_any_cost_model_and_config() -> None:
    """simulate() runs a hand-made workload on a tiny custom shape with a fixed pool."""
    shape = ModelShape("tiny", hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=300)
    config = CoreConfig(block_size=4, num_blocks=64, max_num_batched_tokens=32, vocab_size=300)
    rng = random.Random(0)
    requests = [SimRequest(i * 0.001, rng.randint(1, 20), rng.randint(1, 10)) for i in range(30)]
    result = simulate(requests, config, SimExecutor(CostModel(shape, H200)))
    assert result.recorder.num_output == [r.output_len for r in requests]


def test_batched_arrivals_equal_one_add_request_each() -> None:
    """add_requests (the loop's batched arrivals) gives the state of one add_request per request, under FCFS and
    under a priority policy where arrivals land mid-queue; a bad request leaves the state as it was."""
    from fnvllm.state import FCFS, PRIORITY, InvalidRequestError, add_request, initial_state
    from fnvllm.state.state import add_requests

    config = CoreConfig(block_size=4, num_blocks=64, vocab_size=100, eos_token_ids=(0,))
    rng = random.Random(0)
    batches = [
        [
            (f"r{b}-{i}", [rng.randrange(100) for _ in range(rng.randint(1, 9))],
             SamplingParams(max_tokens=rng.randint(1, 5), stop_token_ids=(rng.randrange(100),) * rng.randint(0, 1)),
             rng.randint(0, 3))
            for i in range(rng.randint(0, 5))
        ]
        for b in range(6)
    ]  # fmt: skip
    for policy in (FCFS, PRIORITY):
        one, batched = initial_state(config, policy), initial_state(config, policy)
        for batch in batches:
            for request in batch:
                one = add_request(one, *request)
            batched = add_requests(batched, batch)
            assert batched == one and batched.waiting == one.waiting
        bad = [("ok", [1], SamplingParams(max_tokens=1), 0), ("r0-0", [1], SamplingParams(max_tokens=1), 0)]
        if batches[0]:
            with pytest.raises(InvalidRequestError):
                add_requests(batched, bad)
        assert "ok" not in batched.requests


def _appender(plans: list[StepPlan]) -> Any:
    """An on_step hook that keeps every plan in ``plans``."""
    return lambda state, plan, output: plans.append(plan)


def test_holding_back_arrivals_changes_no_plan_or_metric() -> None:
    """Under overload, keeping arrivals that cannot affect the next plan out of the core (the default under
    FCFS) gives the same plans, per-request times and waiting counts as adding every request on arrival."""
    from fnvllm.sim import summarize

    requests = poisson_requests(300, 2000.0, 60, 20, 0.8, 0, 512)
    config = CoreConfig(block_size=16, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=256, vocab_size=1000)
    runs = []
    for hold_back in (True, False):
        plans: list[StepPlan] = []
        executor = SimExecutor(CostModel(load_shape("qwen3-0.6b"), H200))
        result = simulate(requests, config, executor, on_step=_appender(plans), hold_back=hold_back)
        runs.append((plans, result))
    (held_plans, held), (plain_plans, plain) = runs
    assert held_plans == plain_plans
    assert max(plain.recorder.num_waiting) > 100  # overloaded: most of the queue was held back
    for field in ("first_scheduled", "first_token", "finish", "num_output", "num_waiting", "step_end"):
        assert list(getattr(held.recorder, field)) == list(getattr(plain.recorder, field)), field
    assert summarize(held.recorder, held.end_s) == summarize(plain.recorder, plain.end_s)


def test_simulation_plans_are_the_engine_loops() -> None:
    """The simulator steps through the engine's own loop: its plans equal those of testing.drive's pure loop over
    the same requests and executor."""
    from fnvllm.testing.drive import RequestSpec, run_to_completion

    requests = [SimRequest(0.0, 40 + 7 * i, 5 + i % 4) for i in range(12)]
    config = CoreConfig(block_size=16, num_blocks=60, max_num_seqs=4, max_num_batched_tokens=128, vocab_size=1000)
    sim_plans: list[StepPlan] = []
    simulate(requests, config, SimExecutor(CostModel(QWEN3_06B, H200)), on_step=_appender(sim_plans), hold_back=False)
    specs = [
        RequestSpec(str(i), prompt_tokens(r, i, 1000), SamplingParams(max_tokens=r.output_len, ignore_eos=True))
        for i, r in enumerate(requests)
    ]
    drive_plans: list[StepPlan] = []
    run_to_completion(config, specs, SimExecutor(CostModel(QWEN3_06B, H200)), on_step=_appender(drive_plans))
    assert [p.seq_ids for p in sim_plans] == [p.seq_ids for p in drive_plans]
    assert [p.input_tokens for p in sim_plans] == [p.input_tokens for p in drive_plans]
    assert len(sim_plans) > len(requests)  # several steps, some with admissions and some decode-only


def test_simulated_arrivals_keep_their_priorities() -> None:
    """Requests arriving together under the priority policy run in priority order (lower first), not in arrival
    order: the loop queues each with its own priority."""
    from fnvllm.sim import get_policy

    requests = [SimRequest(0.0, 30, 4, priority=p) for p in (3, 1, 2, 0)]
    config = CoreConfig(block_size=16, num_blocks=60, max_num_seqs=1, max_num_batched_tokens=128, vocab_size=1000)
    result = simulate(requests, config, SimExecutor(CostModel(QWEN3_06B, H200)), get_policy("priority"))
    order = sorted(range(len(requests)), key=lambda i: result.recorder.first_scheduled[i])
    assert order == [3, 1, 2, 0]


def test_decode_graph_steps_are_priced_at_their_captured_batch() -> None:
    """A decode graph step of 5 rows replays the 8-row graph: its device time equals that of 8 rows reading the
    same KV (padding rows compute); an eager step of 5 rows costs less than one of 8; the sizes are the engine's."""
    import attrs

    from fnvllm.sim import Overheads, StepShape
    from fnvllm.sim.cost import graph_batch_sizes

    profile = attrs.evolve(H200, graph=Overheads(step_us=300.0, seq_us=5.0), eager=Overheads(seq_us=5.0))
    cost = CostModel(QWEN3_06B, profile)

    def decode(rows: int, graph: bool) -> StepShape:
        return StepShape(rows, rows, rows, 0, 4000, 4000, rows, graph)

    assert cost.device_s(decode(5, True)) == pytest.approx(cost.device_s(decode(8, True)), rel=1e-3)  # q, out: 5 rows
    assert cost.device_s(decode(9, True)) > cost.device_s(decode(8, True))
    assert cost.compute_s(decode(5, False)) < cost.compute_s(decode(8, False))
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    torch_sizes = pytest.importorskip("fnvllm.executor.cuda_graphs").graph_batch_sizes
    assert all(graph_batch_sizes(n) == torch_sizes(n) for n in (1, 3, 8, 16, 17, 100, 512))


def test_small_graphs_take_their_own_step_constant(tmp_path: Path) -> None:
    """With small_us set, a 1-row decode graph step's constant is small_us[0] instead of step_us + the log term
    (and a 16-row one keeps the curve); small_us holds at most 4 numbers >= 0 (an error names it) and survives a
    JSON round trip."""
    import attrs

    from fnvllm.sim import Overheads, StepShape
    from fnvllm.sim.checks import SimInputError
    from fnvllm.sim.hardware import load_profile, save_profile

    curve = Overheads(step_us=800.0, log_seq_us=20.0)
    small = attrs.evolve(curve, small_us=(400.0, 700.0, 750.0, 790.0))
    one, sixteen = StepShape(1, 1, 1, 0, 300, 300, 1, True), StepShape(16, 16, 16, 0, 4800, 4800, 16, True)
    with_curve = CostModel(QWEN3_06B, attrs.evolve(H200, graph=curve))
    with_small = CostModel(QWEN3_06B, attrs.evolve(H200, graph=small))
    assert with_curve.compute_s(one) - with_small.compute_s(one) == pytest.approx(400e-6)
    assert with_small.compute_s(sixteen) == pytest.approx(with_curve.compute_s(sixteen))
    for bad in ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0), (1.0, -2.0, 3.0, 4.0), "fast"):
        with pytest.raises(SimInputError, match="small_us"):
            Overheads(small_us=bad)  # type: ignore[arg-type]
    save_profile(attrs.evolve(H200, graph=small), tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").graph.small_us == small.small_us


def test_host_time_grows_with_the_context() -> None:
    """host_context_us and gap_context_us charge per context token: doubling a decode step's context adds
    exactly their share to its host time and plain gap."""
    import attrs

    from fnvllm.sim import Overheads, StepShape

    over = Overheads(host_us=500.0, host_context_us=0.01, gap_us=100.0, gap_context_us=0.004)
    cost = CostModel(QWEN3_06B, attrs.evolve(H200, graph=over))
    short, long = StepShape(8, 8, 8, 0, 4000, 4000, 8, True), StepShape(8, 8, 8, 0, 8000, 8000, 8, True)
    assert cost.host_s(long) - cost.host_s(short) == pytest.approx(4000 * 0.01e-6)
    assert cost.gap_s(long) - cost.gap_s(short) == pytest.approx(4000 * 0.004e-6)

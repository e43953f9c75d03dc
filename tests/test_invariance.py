"""Scheduling invariance: with a deterministic executor that reads its context back through the block tables,
final outputs must not depend on block size, token budget (chunking), prefix caching, pool size (preemption),
max_num_seqs or the queue policy. Every knob below is checked to have actually bitten (chunks, preemptions,
cache hits), so a pass cannot be vacuous.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fnvllm.state import FCFS, PRIORITY, CoreConfig, EngineState, Policy, SamplingParams, StepOutput, StepPlan
from fnvllm.testing.drive import RequestSpec, RunResult, drive, run_to_completion
from fnvllm.testing.toy import KVToyExecutor

VOCAB = 50
EOS = frozenset({7, 8, 9})  # 6% of the toy's tokens: some requests stop early
MAX_MODEL_LEN = 300
FULL_LEN = 256  # a multiple of every block size below: the full-hit case


def _main_batch() -> list[RequestSpec]:
    """A shared system prompt, two long generators that overflow a small pool together, and short requests
    with EOS, stop ids and ignore_eos mixed; priorities differ so PRIORITY reorders them."""
    rng = random.Random(1)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    specs = [
        RequestSpec(
            f"long{i}",
            system[:30] + [rng.randrange(VOCAB) for _ in range(5)],
            SamplingParams(max_tokens=240, ignore_eos=True),
            priority=1 - i,
        )
        for i in range(2)
    ]
    for i in range(10):
        prompt = system[: rng.randint(20, 40)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24), ignore_eos=i % 3 == 0, stop_token_ids=(11,) if i % 4 == 1 else ()
        )
        specs.append(RequestSpec(f"s{i}", prompt, params, priority=i % 3))
    specs.append(RequestSpec("dup48", [*system[:32], *specs[2].prompt[:16]], SamplingParams(max_tokens=5)))
    specs.append(RequestSpec("dup48-again", specs[-1].prompt, SamplingParams(max_tokens=5), priority=2))
    return specs


def _full_prompts() -> list[RequestSpec]:
    """Three identical prompts of exactly FULL_LEN tokens: "full-a" runs alone after the main batch, then
    "full-b" and "full-c" arrive together and find the whole prompt cached."""
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(FULL_LEN)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    return [RequestSpec(f"full-{x}", prompt, params) for x in "abc"]


MAIN, FULL = _main_batch(), _full_prompts()


def _blocks_needed(spec: RequestSpec, block_size: int) -> int:
    return -(-(len(spec.prompt) + spec.params.max_tokens - 1) // block_size)


class _Observer:
    """Collects the plans of a run and checks the per-step caps as they go."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.plans: list[StepPlan] = []

    def __call__(self, state: EngineState, plan: StepPlan, output: StepOutput) -> None:
        assert plan.num_tokens <= self.config.max_num_batched_tokens
        assert len(state.running) <= self.config.max_num_seqs
        self.plans.append(plan)

    def first_row(self, request_id: str) -> tuple[tuple[int, ...], int]:
        """(input tokens, start position) of the request's first scheduled row."""
        for plan in self.plans:
            if request_id in plan.seq_ids:
                i = plan.seq_ids.index(request_id)
                return plan.input_tokens[i], plan.start_positions[i]
        raise AssertionError(f"{request_id} was never scheduled")

    def num_partial_prefills(self) -> int:
        return sum(not sample for plan in self.plans for sample in plan.sample)


def _run(config: CoreConfig, policy: Policy) -> tuple[list[RunResult], _Observer]:
    """The main batch, then "full-a" alone, then "full-b" and "full-c" together, all on one engine."""
    observer = _Observer(config)
    executor = KVToyExecutor(VOCAB)
    results = [run_to_completion(config, MAIN, executor, policy, on_step=observer)]
    for phase in (FULL[:1], FULL[1:]):
        results.append(drive(results[-1].final_state, phase, executor, on_step=observer))
    return results, observer


def _config(block_size: int, budget: int, caching: bool, small_pool: bool, max_num_seqs: int) -> CoreConfig:
    need = max(_blocks_needed(spec, block_size) for spec in MAIN + FULL)
    return CoreConfig(
        block_size=block_size,
        num_blocks=need if small_pool else 4096,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=caching,
        eos_token_ids=EOS,
        vocab_size=VOCAB,
    )


def _outcome(results: list[RunResult]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {rid: (f.reason, f.output) for result in results for rid, f in result.finished.items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Outputs of a big-pool, no-cache, no-chunking, FCFS run."""
    results, observer = _run(_config(16, 4096, False, False, 512), FCFS)
    assert sum(r.num_preemptions for r in results) == observer.num_partial_prefills() == 0
    return _outcome(results)


def test_reference_workload_exercises_every_stop_path(reference: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The workload finishes requests by EOS/stop ids and by max_tokens, with some stopping early on EOS."""
    reasons = [reason for reason, _ in reference.values()]
    assert "stop" in reasons and "length" in reasons
    stopped_on_eos = [out for reason, out in reference.values() if reason == "stop" and out[-1] in EOS]
    assert stopped_on_eos
    assert len(reference) == len(MAIN) + len(FULL)


MATRIX = [
    pytest.param(bs, budget, caching, small, mns, policy, id=f"bs{bs}-tok{budget}-{tags}-seqs{mns}-{policy.name}")
    for bs, budget, caching, small, mns, policy in itertools.product(
        (1, 16, 256), (7, 64, 4096), (False, True), (False, True), (1, 4, 512), (FCFS, PRIORITY)
    )
    for tags in [("cache" if caching else "nocache") + ("-smallpool" if small else "")]
]


@pytest.mark.parametrize(("block_size", "budget", "caching", "small_pool", "max_num_seqs", "policy"), MATRIX)
def test_outputs_invariant(
    reference: dict[str, tuple[str, tuple[int, ...]]],
    block_size: int,
    budget: int,
    caching: bool,
    small_pool: bool,
    max_num_seqs: int,
    policy: Policy,
) -> None:
    """Every finished output and finish reason equals the reference run's, and the knob under test bit."""
    config = _config(block_size, budget, caching, small_pool, max_num_seqs)
    (main, alone, together), observer = _run(config, policy)
    assert _outcome([main, alone, together]) == reference
    assert together.final_state.pool.num_free == config.num_blocks
    if budget < FULL_LEN:
        assert observer.num_partial_prefills() > 0, "budget should have chunked a prefill"
    if small_pool and max_num_seqs > 1:
        assert main.num_preemptions > 0, "the long generators should overflow the small pool together"
    if caching:
        assert main.num_prefix_hit_tokens > 0 or block_size > 40, "the system prompt spans a full block"
        assert together.num_prefix_hit_tokens >= FULL_LEN - 1
        for rid in ("full-b", "full-c"):
            tokens, start = observer.first_row(rid)
            assert (start, len(tokens)) == (FULL_LEN - 1, 1), f"{rid}: a fully cached prompt computes 1 token"
    else:
        assert main.num_prefix_hit_tokens == alone.num_prefix_hit_tokens == together.num_prefix_hit_tokens == 0


# --- Hypothesis: random configs and workloads against a big-pool, no-cache, no-chunk reference ---------------


@st.composite
def _workloads(draw: st.DrawFn) -> list[RequestSpec]:
    """Requests built from a few shared prefixes (so full blocks repeat), with random suffixes, lengths, EOS
    handling, stop ids, priorities and arrival steps."""
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=32), min_size=1, max_size=3))
    specs = []
    for i in range(draw(st.integers(1, 8))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 16)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        )
        priority, arrival = draw(st.integers(0, 2)), draw(st.integers(0, 6))
        specs.append(RequestSpec(f"r{i}", prefix + suffix, params, priority=priority, arrival_step=arrival))
    return specs


@st.composite
def _configs(draw: st.DrawFn, specs: list[RequestSpec]) -> CoreConfig:
    """A config that can hold every request of ``specs``, from a tight pool to a roomy one."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    need = max(_blocks_needed(spec, block_size) for spec in specs)
    return CoreConfig(
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)),
        max_num_batched_tokens=draw(st.integers(1, 80)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=64,
        enable_prefix_caching=draw(st.booleans()),
        eos_token_ids=EOS,
        vocab_size=VOCAB,
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_outputs_invariant_random(data: st.DataObject) -> None:
    """For drawn workloads and configs, outputs and finish reasons equal a big-pool/no-cache/no-chunk run's."""
    specs = data.draw(_workloads(), label="specs")
    config = data.draw(_configs(specs), label="config")
    policy = data.draw(st.sampled_from([FCFS, PRIORITY]), label="policy")
    reference_config = CoreConfig(
        block_size=16,
        num_blocks=1024,
        max_num_batched_tokens=4096,
        max_model_len=64,
        enable_prefix_caching=False,
        eos_token_ids=EOS,
        vocab_size=VOCAB,
    )
    expected = run_to_completion(reference_config, specs, KVToyExecutor(VOCAB))
    actual = run_to_completion(config, specs, KVToyExecutor(VOCAB), policy, max_steps=5_000)
    assert actual.finish_reasons == expected.finish_reasons
    assert actual.outputs == expected.outputs
    assert actual.final_state.pool.num_free == config.num_blocks

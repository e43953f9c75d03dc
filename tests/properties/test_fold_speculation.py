"""``fold_speculation`` (one commit and one schedule per overlapped step) equals the two calls it replaces:
``commit(state, plan, tokens)`` then ``schedule``, on random workloads, priorities, aborts and token streams (EOS
and stop ids mixed in, where it must decline), and a planted bug in the substitution is caught.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fnvllm.state.overlap as overlap_module
from fnvllm.state import CoreConfig, EngineState, Policy, StepOutput, StepPlan, abort, commit, schedule
from fnvllm.state.overlap import Folded, fold_speculation, speculate
from fnvllm.state.policy import FCFS, PRIORITY
from fnvllm.state.state import add_requests, initial_state
from fnvllm.testing import invariants
from fnvllm.testing.strategies import core_configs, sampled_for, workloads

Step = tuple[EngineState, StepPlan, list[int]]


def _steps(data: st.DataObject, config: CoreConfig, policy: Policy) -> Iterator[Step]:
    """Drive a drawn workload plainly; before each commit yield (pending state, plan, drawn tokens). Some requests
    arrive late and some are aborted between schedule and commit (as a client disconnecting mid-step)."""
    work = data.draw(workloads(config, max_size=6))
    state = initial_state(config, policy)
    late = data.draw(st.integers(0, len(work)))
    due = [(f"r{i}", draw.prompt, draw.params, draw.priority) for i, draw in enumerate(work)]
    state = add_requests(state, due[:late])
    for step in range(200):
        if step == 3:
            state = add_requests(state, due[late:])
        if not state.has_unfinished and step > 3:
            return
        state, plan = schedule(state)
        live = sorted(state.requests)
        if live and data.draw(st.integers(0, 9)) == 0:
            state = abort(state, data.draw(st.sampled_from(live)))
        tokens = data.draw(sampled_for(config, plan.num_samples))
        yield state, plan, tokens
        state, _ = commit(state, plan, tokens)


def _two_calls(state: EngineState, plan: StepPlan, tokens: list[int]) -> tuple[EngineState, StepPlan, StepOutput]:
    committed, output = commit(state, plan, tokens)
    pending, next_plan = schedule(committed)
    return pending, next_plan, output


def _assert_same(folded: Folded, expected: tuple[EngineState, StepPlan, StepOutput]) -> None:
    pending, plan, output = expected
    assert folded.output == output
    assert folded.plan == plan
    assert folded.state == pending
    assert folded.state.rows == pending.rows and folded.state.decode == pending.decode
    invariants.check_derived(folded.state)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=core_configs(max_num_seqs=6, max_num_blocks=32, max_model_len=48),
    policy=st.sampled_from([FCFS, PRIORITY]),
    data=st.data(),
)
def test_fold_equals_commit_then_schedule(config: CoreConfig, policy: Policy, data: st.DataObject) -> None:
    """Wherever ``fold_speculation`` answers, its state, plan and output are those of commit then schedule; it
    declines exactly when a sampled token can stop a row or a sampling row was aborted."""
    stops = config.eos_token_ids
    for state, plan, tokens in _steps(data, config, policy):
        spec = speculate(state, plan)
        if spec is None:
            continue
        folded = fold_speculation(state, plan, spec, tokens)
        aborted = any(rid not in state.requests for rid, s in zip(plan.seq_ids, plan.sample, strict=True) if s)
        can_stop = not (stops | state.stop_token_union).isdisjoint(tokens)
        assert (folded is None) == (aborted or can_stop)
        if folded is not None:
            _assert_same(folded, _two_calls(state, plan, tokens))


def test_fold_declines_a_token_that_ends_a_row() -> None:
    """A sampled EOS (even for an ignore_eos row: the fold is conservative) or an out-of-vocabulary id is left to
    commit and reconcile."""
    from fnvllm.state import SamplingParams

    config = CoreConfig(block_size=4, num_blocks=16, max_num_seqs=2, eos_token_ids={3}, vocab_size=10)
    state = add_requests(initial_state(config), [("a", (5, 6), SamplingParams(max_tokens=5), 0)])
    state, plan = schedule(state)
    spec = speculate(state, plan)
    assert spec is not None
    assert fold_speculation(state, plan, spec, [3]) is None
    assert fold_speculation(state, plan, spec, [10]) is None
    folded = fold_speculation(state, plan, spec, [7])
    assert folded is not None and folded.output.new_tokens == (7,) and folded.plan.input_tokens == ((7,),)


# ----- planted bug: a fold that forgets to substitute the decode prefix's inputs -----

HUNT = settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)


def test_equality_catches_a_fold_that_keeps_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the substitution of one column planted out (the decode prefix keeps its placeholder inputs), the
    equality test above fails."""
    real = overlap_module._with_last_tokens
    calls = {"n": 0}

    def mutant(ids, values, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return values if calls["n"] % 3 == 2 else real(ids, values, *args, **kwargs)

    monkeypatch.setattr(overlap_module, "_with_last_tokens", mutant)

    @HUNT
    @given(config=core_configs(max_num_seqs=6, max_num_blocks=32, max_model_len=48), data=st.data())
    def hunt(config: CoreConfig, data: st.DataObject) -> None:
        for state, plan, tokens in _steps(data, config, FCFS):
            spec = speculate(state, plan)
            folded = None if spec is None else fold_speculation(state, plan, spec, tokens)
            if folded is not None:
                _assert_same(folded, _two_calls(state, plan, tokens))

    with pytest.raises((AssertionError, invariants.InvariantViolation)):
        hunt()

"""Multi-step decoding (``fnvllm.state.multistep``): a plan of K decode steps gives the tokens, outputs and final
state of K single steps (seeded tokens, EOS and stop ids, stop strings applied by the shell, aborts, max_tokens
at the plan's end), and planted bugs in the block order, the stop handling and the sub-step plans are caught.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import fnvllm.executor.base as executor_base
import fnvllm.state.multistep as multistep
from fnvllm.state import (
    CoreConfig,
    EngineState,
    KVManager,
    SamplingParams,
    StepOutput,
    StepPlan,
    abort,
    commit,
    finish,
    schedule,
)
from fnvllm.state.multistep import Tables, decode_steps, schedule_steps, substep
from fnvllm.state.policy import FCFS, PRIORITY, Policy
from fnvllm.state.state import add_requests, initial_state
from fnvllm.testing import invariants
from fnvllm.testing.drive import RequestSpec, run_to_completion
from fnvllm.testing.machine import CoreStateMachine
from fnvllm.testing.strategies import core_configs, sampled_for, token_ids, vocab_of, workloads
from fnvllm.testing.toy import KVToyExecutor

commit_module = importlib.import_module("fnvllm.state.commit")  # the package exports the function `commit`
CONFIGS = core_configs(max_num_seqs=5, max_num_blocks=32, max_model_len=40)
HUNT = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def check_state(state: EngineState) -> None:
    """Every state invariant of the property suite."""
    for check in (
        invariants.check_blocks_conserved,
        invariants.check_ref_counts,
        invariants.check_queues,
        invariants.check_lengths,
        invariants.check_prefix_cache,
        invariants.check_derived,
        invariants.check_slots,
    ):
        check(state)


def outputs_with_and_without(config: CoreConfig, policy: Policy, data: st.DataObject) -> None:
    """One drawn workload (some requests arriving late) run to completion with one-step plans and with plans of
    up to K steps, on a toy executor whose tokens hash the context read back through the block tables (its
    sub-steps fed on the "device" when the toy overlaps, by the host otherwise): the same
    outputs and finish reasons; the state invariants and the KV oracle hold after every multi-step commit."""
    work = data.draw(workloads(config, max_size=5))
    arrivals = data.draw(st.lists(st.integers(0, 4), min_size=len(work), max_size=len(work)))
    specs = [
        RequestSpec(f"r{i}", draw.prompt, draw.params, draw.priority, arrival)
        for i, (draw, arrival) in enumerate(zip(work, arrivals, strict=True))
    ]
    max_steps = data.draw(st.integers(2, 6))
    single = run_to_completion(config, specs, KVToyExecutor(config.vocab_size or 1000), policy)
    toy = KVToyExecutor(config.vocab_size or 1000, overlap=data.draw(st.booleans()), shadow=True)
    assert toy.shadow is not None

    def checked(state: EngineState, plan: object, output: StepOutput) -> None:
        check_state(state)
        invariants.check_kv(state, toy.shadow)  # type: ignore[arg-type]

    multi = run_to_completion(config, specs, toy, policy, on_step=checked, max_decode_steps=max_steps)
    assert multi.outputs == single.outputs
    assert multi.finish_reasons == single.finish_reasons


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, policy=st.sampled_from([FCFS, PRIORITY]), data=st.data())
def test_multistep_outputs_equal_single_steps(config: CoreConfig, policy: Policy, data: st.DataObject) -> None:
    """Plans of up to K decode steps give every request the outputs and finish reason of one-step plans."""
    outputs_with_and_without(config, policy, data)


def fork_and_compare(config: CoreConfig, policy: Policy, data: st.DataObject) -> None:
    """Drive a drawn workload with one-step plans; where a multi-step plan is possible, run it beside K single
    steps from the same state, on the same drawn tokens (by sequence and sub-step), with an optional abort after
    planning and stop strings applied by the shell after each commit (``finish``): each request is delivered the
    same tokens; when no row ends before the last sub-step, the committed states and outputs are equal values."""
    work = data.draw(workloads(config, max_size=5))
    state = add_requests(
        initial_state(config, policy), [(f"r{i}", d.prompt, d.params, d.priority) for i, d in enumerate(work)]
    )
    max_steps = data.draw(st.integers(2, 6))
    stop_strings = frozenset(data.draw(st.lists(token_ids(vocab_of(config)), max_size=2)))
    for _ in range(200):
        if not state.has_unfinished:
            return
        pending, plan = schedule_steps(state, max_steps)
        if plan.num_steps > 1:
            tokens = data.draw(sampled_for(config, plan.num_samples))
            live = sorted(state.requests)
            victim = data.draw(st.sampled_from([None, *live])) if data.draw(st.integers(0, 4)) == 0 else None
            compare_fork(state, pending, plan, tokens, victim, stop_strings)
        state, plan = schedule(state)
        state, _ = commit(state, plan, data.draw(sampled_for(config, plan.num_samples)))


def deliver(state: EngineState, output: StepOutput, stops: frozenset[int], got: dict[str, list[int]]) -> EngineState:
    """The shell's part: route the output's tokens; a request whose token is a stop string ends there (its later
    tokens are not delivered, and ``finish`` ends it if the core has not)."""
    stopped = set()
    for rid, token in zip(output.seq_ids, output.new_tokens, strict=True):
        if rid in stopped or (got.get(rid) and got[rid][-1] in stops):
            continue
        got.setdefault(rid, []).append(token)
        if token in stops:
            stopped.add(rid)
            if rid in state.requests:
                state = finish(state, rid)
    return state


def compare_fork(
    state: EngineState,
    pending: EngineState,
    plan: StepPlan,
    tokens: list[int],
    victim: str | None,
    stops: frozenset[int],
) -> None:
    """``fork_and_compare``'s comparison at one state (see there)."""
    num_rows, steps = plan.num_seqs, plan.num_steps
    token_of = {(rid, j): tokens[j * num_rows + row] for j in range(steps) for row, rid in enumerate(plan.seq_ids)}
    got_multi: dict[str, list[int]] = {}
    multi = abort(pending, victim) if victim is not None else pending
    multi, multi_out = commit(multi, plan, tokens)
    multi = deliver(multi, multi_out, stops, got_multi)
    check_state(multi)
    got_single: dict[str, list[int]] = {}
    single, outputs, early = state, [], victim is not None
    for j in range(steps):
        single, one = schedule(single)
        assert one.num_steps == 1 and set(one.seq_ids) <= set(plan.seq_ids) and not one.num_admitted
        if j == 0 and victim is not None:
            single = abort(single, victim)
        single, out = commit(single, one, [token_of[rid, j] for rid in one.seq_ids])
        single = deliver(single, out, stops, got_single)
        outputs.append(out)
        early = early or (j < steps - 1 and set(single.running) != set(plan.seq_ids))
    assert got_multi == got_single
    if not early:
        assert multi == single
        assert multi_out.seq_ids == tuple(rid for out in outputs for rid in out.seq_ids)
        assert multi_out.new_tokens == tuple(token for out in outputs for token in out.new_tokens)
        assert multi_out.finished == tuple(record for out in outputs for record in out.finished)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, policy=st.sampled_from([FCFS, PRIORITY]), data=st.data())
def test_multistep_commit_equals_single_commits(config: CoreConfig, policy: Policy, data: st.DataObject) -> None:
    """A multi-step plan's commit delivers the tokens of K single steps, and equals them as a value when no row
    ends early."""
    fork_and_compare(config, policy, data)


class MultiStepMachine(CoreStateMachine):
    """The core's state machine (add / schedule / commit / abort, between schedule and commit too, against the
    naive model and the shadow KV cache) with plans of up to 4 decode steps wherever they can be made."""

    decode_steps = 4


def test_multistep_core_machine() -> None:
    """With multi-step plans wherever possible, random scripts keep every invariant of the core's machine, match
    the naive model token for token and finish every request."""
    most = min(settings().max_examples, 100)  # the two property tests above draw another 200 (ci) workloads
    run_state_machine_as_test(
        MultiStepMachine,
        settings=settings(max_examples=most, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]),
    )


def test_decode_steps_declines_and_caps() -> None:
    """One step while a request waits, a row is mid-prefill, or a row wants logprobs; otherwise max_steps capped
    at the fewest tokens a row may still generate; a bad max_steps names itself."""
    config = CoreConfig(block_size=4, num_blocks=16, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=32)
    params = SamplingParams(max_tokens=5)
    state = add_requests(initial_state(config), [("a", (1, 2, 3), params, 0), ("b", (4, 5), params, 0)])
    assert decode_steps(state, 4) == 1  # "a" waits
    state, plan = schedule(state)
    state, _ = commit(state, plan, [7])
    assert decode_steps(state, 4) == 1  # "b" waits (max_num_seqs 1)
    state = abort(state, "b")
    assert decode_steps(state, 4) == 4 and decode_steps(state, 9) == 4  # "a" may still generate 4 tokens
    pending, plan = schedule_steps(state, 9)
    assert plan.num_steps == 4 and plan.num_samples == 4 and pending.step == state.step + 4
    assert plan.block_tables[0] == pending.rows.block_tables[0] and len(plan.block_tables[0]) == 2  # 3 + 4 slots
    assert substep(plan, 2).start_positions == (plan.start_positions[0] + 2,)
    wants_logprobs = add_requests(initial_state(config), [("c", (1,), SamplingParams(logprobs=2), 0)])
    wants_logprobs, plan = schedule(wants_logprobs)
    wants_logprobs, _ = commit(wants_logprobs, plan, [3])
    assert decode_steps(wants_logprobs, 4) == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_steps"):
            decode_steps(state, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index must be in"):
        substep(plan, 1)


# ---------------------------------------------------------------------------------------------- planted bugs


def hunt(check: Callable[[CoreConfig, Policy, st.DataObject], None]) -> None:
    """Run ``check`` on drawn workloads until it fails (an assertion or a toy executor's error)."""

    @HUNT
    @given(config=CONFIGS, policy=st.sampled_from([FCFS, PRIORITY]), data=st.data())
    def search(config: CoreConfig, policy: Policy, data: st.DataObject) -> None:
        check(config, policy, data)

    with pytest.raises(Exception):  # noqa: B017 (a wrong output, a toy's error or a refused plan: all catches)
        search()


def test_planted_row_major_block_order_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks taken row by row (each row's blocks for all sub-steps, then the next row's) instead of sub-step by
    sub-step: the committed state differs from single steps'."""

    def row_major(state: EngineState, kv: KVManager, num_steps: int) -> tuple[int, Tables]:
        rows, bs = state.rows, state.config.block_size
        tables = list(rows.block_tables)
        for i, start in enumerate(rows.num_computed):
            short = (start + num_steps - 1) // bs + 1 - len(tables[i])
            if short > kv.num_free:
                return 1, tables
            tables[i] += tuple(kv.allocate(short)) if short > 0 else ()
        return num_steps, tables

    monkeypatch.setattr(multistep, "grow_tables", row_major)
    hunt(fork_and_compare)


def test_planted_tokens_after_a_stop_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-step commit that never ends a row inside its plan (the stop check per token dropped): rows run
    past EOS, stop ids and max_tokens, so the tokens delivered differ from single steps'."""
    original = commit_module._fold_token

    def keeps_going(fold: commit_module._Fold, index: int, *args: Any) -> tuple[Any, ...]:
        ended = len(fold.finished)
        values = original(fold, index, *args)
        del fold.finished[ended:]
        return values

    monkeypatch.setattr(commit_module, "_fold_token", keeps_going)
    hunt(fork_and_compare)


def test_planted_stale_substep_positions_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sub-steps run at the plan's first position (positions not advanced): the toy executor reads the wrong
    KV back, so outputs differ (or it finds a slot holding another position)."""

    def stale(plan: StepPlan, index: int, inputs: object = None) -> StepPlan:
        fresh = substep(plan, index, inputs)  # type: ignore[arg-type]
        return attrs.evolve(fresh, start_positions=plan.start_positions)

    monkeypatch.setattr(executor_base, "substep", stale)
    hunt(outputs_with_and_without)

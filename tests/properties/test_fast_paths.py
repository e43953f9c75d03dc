"""Fast paths agree with the slow paths beside them, on every state the core state machine reaches.

The core keeps column-wise fast paths for the common step next to general one-row-at-a-time paths, and either
may run on a given state; here both run on the same drawn state and must give the same result:

- schedule: the leading plain decodes scheduled column-wise (``_schedule_decode_prefix``) or one at a time
  (``_schedule_rows``, forced by hiding the decode prefix); the plan's columns shared with the new state
  (``_shared_columns``) or assembled (``_plan_columns``);
- commit: the plan's rows folded as the running rows, decode prefix column-wise (``_commit_running``), or one
  plan row at a time (``_commit_rows``); the decode prefix it derives incrementally or from scratch
  (``_decode_prefix``).

Whatever the state, ``check_derived`` (run after every rule) also compares the incremental decode prefix with a
naive recomputation.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import fnvllm.state as core
from fnvllm.state import EngineState, StepOutput, StepPlan
from fnvllm.state._running import DecodePrefix
from fnvllm.state.state import replace
from fnvllm.testing import invariants as inv
from fnvllm.testing.machine import CoreStateMachine
from fnvllm.testing.strategies import core_configs

# ``fnvllm.state.schedule`` and ``.commit`` are the functions, which shadow their modules' names on the package.
scheduler = sys.modules["fnvllm.state.scheduler"]
committer = sys.modules["fnvllm.state.commit"]


def check_schedule_paths(state: EngineState) -> None:
    """Scheduling ``state`` with its decode prefix and with the prefix hidden gives equal states and plans, and
    the plan columns shared with the new state equal the assembled ones."""
    new, plan = core.schedule(state)
    slow_new, slow_plan = core.schedule(replace(state, decode=DecodePrefix()))
    if (new, new.rows, plan) != (slow_new, slow_new.rows, slow_plan):
        inv.fail(f"fast paths: column-wise decodes planned {plan}, one row at a time {slow_plan}")
    step = scheduler._decide(state)
    shared = scheduler._shared_columns(step, scheduler._next_state(step).rows)
    if shared is not None and shared != scheduler._plan_columns(step):
        inv.fail(f"fast paths: plan columns shared {shared} != assembled {scheduler._plan_columns(step)}")


def check_commit_paths(state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> None:
    """When the plan's rows are the running rows, folding them as such and one plan row at a time give equal
    rows, finished requests and pools, and the incremental decode prefix starts the one found from scratch."""
    if plan.seq_ids != state.running:
        return
    tokens = list(sampled)
    fast, slow = committer._Fold(state, plan), committer._Fold(state, plan)
    rows, decode = committer._commit_running(fast, tokens)
    slow_rows, _, _ = committer._commit_rows(slow, tokens)
    if (rows, fast.finished, fast.kv.freeze()) != (slow_rows, slow.finished, slow.kv.freeze()):
        inv.fail(f"fast paths: commit as running rows gave {rows}, {fast.finished}; one row at a time {slow_rows}")
    fresh = committer._decode_prefix(state, slow_rows)  # all of the leading plain decodes
    k = len(decode.inputs)  # the incremental prefix may stop earlier (at a prompt's last token, not sampled yet)
    head = (fresh.inputs[:k], tuple(i for i in fresh.block_due if i < k), fresh.phases[:k])
    if (decode.inputs, decode.block_due, decode.phases) != head:
        inv.fail(f"fast paths: incremental decode prefix {decode} is not the start of the one from scratch {fresh}")
    remaining = [
        limit - total for limit, total in zip(slow_rows.token_limits[:k], slow_rows.num_tokens[:k], strict=True)
    ]
    exact = min(filter(None, remaining), default=0)  # rows at 0 just finished
    if decode.steps_to_limit and exact and decode.steps_to_limit > exact:
        inv.fail(f"fast paths: decode steps_to_limit {decode.steps_to_limit} > the fewest steps left, {exact}")


class BothPathsMachine(CoreStateMachine):
    """The default machine, checking before every schedule and commit that the fast and slow paths agree."""

    configs = core_configs(max_budget=24)  # budgets that often cover every decode, so the fast paths run

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        check_schedule_paths(state)
        return core.schedule(state)

    def commit(self, state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> tuple[EngineState, StepOutput]:
        check_commit_paths(state, plan, sampled)
        return core.commit(state, plan, sampled)


class BothPathsPriorityMachine(BothPathsMachine):
    """Under the priority policy, where admissions land between running rows (the assembled plan columns)."""

    policy = core.PRIORITY


# The active profile, at most 100 scripts: each machine here also repeats every invariant and model check that
# tests/properties/test_core_machine.py runs on the full profile, so half the ci profile's scripts (up to 5,000
# steps a policy) suffice for the fast paths (about 25 s less CI per policy).
FAST_PATH_SETTINGS = settings(
    max_examples=min(settings().max_examples, 100),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("machine", [BothPathsMachine, BothPathsPriorityMachine], ids=["fcfs", "priority"])
def test_fast_and_slow_paths_agree(machine: type[CoreStateMachine]) -> None:
    """On random scripts, every fast path of schedule and commit gives what its general path gives."""
    run_state_machine_as_test(machine, settings=FAST_PATH_SETTINGS)

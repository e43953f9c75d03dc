"""The core state machine (fnvllm.testing.machine) under the active Hypothesis profile (see tests/conftest.py).

Each run is a random script of add / schedule / commit / abort against the real core and a naive model, with
every invariant checked after every rule and a liveness drain at the end. A user machine runs the same way, or
as a unittest class: ``TestMine = MyMachine.TestCase``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import fnvllm.state as core
from fnvllm.state.hashing import BlockHasher
from fnvllm.testing.invariants import check_plan
from fnvllm.testing.machine import CoreStateMachine


def machine_settings() -> settings:
    """The active profile, minus health checks that a stateful test with large draws trips by design."""
    return settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def capped(base: settings, most: int = 100) -> settings:
    """``base`` with at most ``most`` examples (the ci profile's 200 where another test covers the rest)."""
    return settings(base, max_examples=min(base.max_examples, most))


def constant_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Every block collides with every other one."""
    return 7


class PriorityMachine(CoreStateMachine):
    """The core under the priority policy."""

    policy = core.PRIORITY


class CollidingHashMachine(CoreStateMachine):
    """The core with a hasher that makes every block collide."""

    def block_hasher(self) -> BlockHasher:
        return constant_hash


def test_fcfs_core_machine() -> None:
    """Under FCFS, random scripts keep every invariant, match the naive model and finish every request."""
    run_state_machine_as_test(CoreStateMachine, settings=machine_settings())


def test_priority_core_machine() -> None:
    """Under the priority policy, random scripts keep every invariant and finish every request."""
    # at most 100 scripts: test_fast_paths.py's priority machine runs another 100 with every invariant checked
    run_state_machine_as_test(PriorityMachine, settings=capped(machine_settings()))


def test_colliding_hash_core_machine() -> None:
    """With a constant block hash, the token/parent guard keeps every invariant (no wrong prefix-cache hit)."""
    # at most 100 scripts: every block collides, so the guard runs on each lookup from the first steps, and the
    # planted-bug hunts of test_suite_catches_planted_bugs.py show a missing guard fails within far fewer
    run_state_machine_as_test(CollidingHashMachine, settings=capped(machine_settings()))


def test_preempted_request_and_its_twin_do_not_both_compute_a_prefix() -> None:
    """Regression (found by the machine): a preempted request recomputing blocks whose hashes it already knew
    marked none of them pending, so a twin prompt admitted in the same step computed the same block again."""
    config = core.CoreConfig(block_size=1, num_blocks=4, max_num_batched_tokens=3, max_num_seqs=2, max_model_len=5)
    state = core.initial_state(config)
    state = core.add_request(state, "r0", (1, 0), core.SamplingParams(max_tokens=3, stop_token_ids=(0,)))
    state = core.add_request(state, "r1", (0, 0), core.SamplingParams(max_tokens=1))  # preempted in step 1
    state = core.add_request(state, "r2", (0,), core.SamplingParams(max_tokens=1))  # r1's twin prefix
    for sampled in ([4], [4], [0], None):
        before = state
        state, plan = core.schedule(state)
        check_plan(config, before, state, plan)
        if sampled is not None:
            state, _ = core.commit(state, plan, sampled)
    assert plan.seq_ids == ("r1",), "r2 waits one step, then hits r1's block"

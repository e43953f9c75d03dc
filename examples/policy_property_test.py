"""Property-test your own scheduling policy with fnvllm.testing (no model, no torch; seconds).

    python examples/policy_property_test.py          # runs both checks below
    python -m pytest examples/policy_property_test.py

The policy here is shortest-job-first (fewest prompt + output tokens first). Two checks, each a few lines:

1. ``ShortestJobMachine``: fnvllm's own state machine (random add / schedule / commit / abort scripts on tiny
   pools, beside a naive model, with every invariant checked after every rule) run with this policy.
2. ``test_policy_does_not_change_outputs``: with a toy executor whose tokens depend on the KV it reads back, every
   request generates the same tokens under this policy as under FCFS — a policy changes *when*, never *what*.

docs/test-your-policy.md walks through it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from fnvllm.state import FCFS, CoreConfig, Policy, Request
from fnvllm.testing.drive import RequestSpec, run_to_completion
from fnvllm.testing.machine import CoreStateMachine
from fnvllm.testing.strategies import RequestDraw, core_configs, workloads
from fnvllm.testing.toy import KVToyExecutor


def shortest_job_key(request: Request) -> tuple[int, ...]:
    """Fewest prompt + output tokens first, arrival order among equals (module-level, so states pickle)."""
    return (len(request.prompt) + request.params.max_tokens, request.arrival)


SHORTEST_JOB_FIRST = Policy("shortest-job-first", shortest_job_key)


class ShortestJobMachine(CoreStateMachine):
    """The core's state machine, scheduling with shortest-job-first."""

    policy = SHORTEST_JOB_FIRST


TestShortestJobMachine = ShortestJobMachine.TestCase  # pytest collects this
TestShortestJobMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


def specs(work: list[RequestDraw]) -> list[RequestSpec]:
    """The drawn requests as the driver's specs, ids r0, r1, ..."""
    return [RequestSpec(f"r{i}", draw.prompt, draw.params, draw.priority) for i, draw in enumerate(work)]


@st.composite
def config_and_workload(draw: st.DrawFn) -> tuple[CoreConfig, list[RequestDraw]]:
    """A stressful config (tiny pool and budget) and requests that fit it."""
    config = draw(core_configs())
    return config, draw(workloads(config, max_size=8))


@settings(max_examples=50, deadline=None)
@given(case=config_and_workload())
def test_policy_does_not_change_outputs(case: tuple[CoreConfig, list[RequestDraw]]) -> None:
    """Every request generates the same tokens, for the same reason, under shortest-job-first as under FCFS."""
    config, work = case
    mine = run_to_completion(config, specs(work), KVToyExecutor(config.vocab_size), SHORTEST_JOB_FIRST)
    fcfs = run_to_completion(config, specs(work), KVToyExecutor(config.vocab_size), FCFS)
    assert mine.outputs == fcfs.outputs
    assert mine.finish_reasons == fcfs.finish_reasons


def main() -> None:
    """Run both checks without pytest; a failure raises with Hypothesis's shrunk example."""
    run_state_machine_as_test(ShortestJobMachine, settings=TestShortestJobMachine.settings)
    print("state machine with shortest-job-first: every invariant held")
    test_policy_does_not_change_outputs()
    print("shortest-job-first generates what FCFS generates: held")


if __name__ == "__main__":
    main()

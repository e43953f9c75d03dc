"""A small driver that runs the pure core to completion against any executor (toy, simulated or real).

It is the engine loop of docs/design.md and nothing more::

    state, plan = schedule(state)
    tokens = executor.execute(plan).token_ids
    state, output = commit(state, plan, tokens)

plus the bookkeeping tests want afterwards: every finished request, the number of steps, how many preemptions
happened and how many prompt tokens the prefix cache saved (read from each plan's admitted rows, as
``EngineLoop`` reads them). It is the pure loop without output routing or overlap, for tests of the core and of
users' policies; ``EngineLoop`` drives the same three calls for the LLM, the server and the simulator. Imports no
torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs

from fnvllm.executor.base import Executor, execute_steps
from fnvllm.state.commit import commit
from fnvllm.state.config import CoreConfig
from fnvllm.state.multistep import check_max_steps, schedule_steps
from fnvllm.state.params import SamplingParams
from fnvllm.state.plan import StepPlan
from fnvllm.state.policy import FCFS, Policy
from fnvllm.state.request import FinishedRequest, FinishReason, StepOutput
from fnvllm.state.scheduler import schedule
from fnvllm.state.state import EngineState, add_request, initial_state


@attrs.frozen
class RequestSpec:
    """One request to feed the driver.

    request_id / prompt / params / priority: as for ``add_request``.
    arrival_step: the request is added once this many steps of the driving call have run (0 = at the start).
    """

    request_id: str
    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    params: SamplingParams = attrs.field(factory=SamplingParams)
    priority: int = 0
    arrival_step: int = 0


@attrs.frozen
class RunResult:
    """What ``run_to_completion`` observed.

    finished: every request that finished, by id (its output tokens and finish reason).
    num_steps: plans scheduled and committed (empty plans included).
    num_preemptions: sequences preempted over the run (one sequence preempted twice counts twice).
    num_prefix_hit_tokens: prompt/output tokens skipped at admission because their KV was found in the cache.
    final_state: the state after the last commit.
    """

    finished: Mapping[str, FinishedRequest]
    num_steps: int
    num_preemptions: int
    num_prefix_hit_tokens: int
    final_state: EngineState

    @property
    def outputs(self) -> dict[str, tuple[int, ...]]:
        """Generated token ids of each finished request."""
        return {rid: f.output for rid, f in self.finished.items()}

    @property
    def finish_reasons(self) -> dict[str, FinishReason]:
        """Why each finished request stopped."""
        return {rid: f.reason for rid, f in self.finished.items()}


StepHook = Callable[[EngineState, StepPlan, StepOutput], None]


class StepLimitError(RuntimeError):
    """The run did not finish within ``max_steps`` (a livelock, or a limit set too low)."""


def _add_arrivals(state: EngineState, pending: list[RequestSpec], step: int) -> EngineState:
    """``state`` with every spec whose arrival_step has come added (and removed from ``pending``)."""
    while pending and pending[0].arrival_step <= step:
        spec = pending.pop(0)
        state = add_request(state, spec.request_id, spec.prompt, spec.params, spec.priority)
    return state


def run_to_completion(
    config: CoreConfig,
    requests: Iterable[RequestSpec],
    executor: Executor,
    policy: Policy = FCFS,
    max_steps: int = 100_000,
    on_step: StepHook | None = None,
    max_decode_steps: int = 1,
) -> RunResult:
    """Run ``requests`` on a fresh engine until every one has finished; see ``drive``."""
    return drive(initial_state(config, policy), requests, executor, max_steps, on_step, max_decode_steps)


def drive(
    state: EngineState,
    requests: Iterable[RequestSpec],
    executor: Executor,
    max_steps: int = 100_000,
    on_step: StepHook | None = None,
    max_decode_steps: int = 1,
) -> RunResult:
    """Continue from ``state``: add ``requests`` (each once ``arrival_step`` steps of this call have run; ties in
    the given order), then schedule / execute / commit until nothing is left. ``on_step(state, plan, output)``
    sees each committed step. ``state`` must have no plan pending; the executor must expect ``state.step`` next.
    ``max_decode_steps`` > 1 plans up to that many decode steps at once where it can (``schedule_steps``; the
    executor runs them with ``execute_steps``); ``max_steps`` and arrivals count plans either way.

    Raises StepLimitError after ``max_steps`` steps, and whatever ``add_request`` raises for an invalid request.
    """
    check_max_steps(max_decode_steps)
    pending = sorted(requests, key=lambda spec: spec.arrival_step)  # stable: ties keep the given order
    finished: dict[str, FinishedRequest] = {}
    num_steps = num_preemptions = num_hits = 0
    while True:
        state = _add_arrivals(state, pending, num_steps)
        if not state.has_unfinished and not pending:
            break
        if num_steps >= max_steps:
            raise StepLimitError(f"{len(state.requests)} requests unfinished after max_steps={max_steps} steps")
        state, plan = schedule_steps(state, max_decode_steps) if max_decode_steps > 1 else schedule(state)
        state, output = commit(state, plan, execute_steps(executor, plan).token_ids)
        finished.update((f.request_id, f) for f in output.finished)
        num_steps += 1
        num_preemptions += len(plan.preempted)
        num_hits += sum(plan.admitted_starts().values())  # admitted rows start after their hit
        if on_step is not None:
            on_step(state, plan, output)
    return RunResult(finished, num_steps, num_preemptions, num_hits, state)

"""Engine: binds an executor to the pure core. ``step(state, plan)`` = execute + pure commit.

The loop researchers write themselves::

    engine = Engine(executor, core_config)
    state = add_request(engine.initial_state(), "r0", prompt_ids, SamplingParams(max_tokens=32))
    while state.has_unfinished:
        state, plan = schedule(state)          # pure: swap in your own policy here
        state, out = engine.step(state, plan)  # runs the plan, commits the sampled tokens

States are plain values: pickle one, and ``engine.restore(state)`` on a fresh engine continues it (running
requests are re-prefilled, since a fresh executor's KV cache is empty).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress

import attrs

from fnvllm.executor.base import (
    ExecuteResult,
    Executor,
    OverlapExecutor,
    PromptLogprobs,
    TokenLogprobs,
    execute_steps,
    supports_overlap,
)
from fnvllm.executor.logprob_rows import RequestLogprobs, StepLogprobs
from fnvllm.state import (
    FCFS,
    CoreConfig,
    EngineState,
    PlanMismatchError,
    Policy,
    StepOutput,
    StepPlan,
    commit,
    forget_kv,
    initial_state,
)
from fnvllm.state.overlap import Folded, Speculation, fold_speculation


@attrs.frozen
class EngineOutput:
    """A committed step: the core's StepOutput plus logprobs of the requests that asked for them (of the sampled
    tokens, and of the prompt tokens this step fed: ``SamplingParams.prompt_logprobs``). ``logprobs`` maps each
    request id to its TokenLogprobs; from the model executor it is a ``RequestLogprobs``, which builds an entry
    only when it is read (``fnvllm.executor.logprob_rows``)."""

    output: StepOutput
    logprobs: Mapping[str, TokenLogprobs] = attrs.field(factory=dict)
    prompt_logprobs: Mapping[str, PromptLogprobs] = attrs.field(factory=dict)


class Engine:
    """An executor plus the core settings it was sized for. Holds no scheduling state: that is threaded."""

    def __init__(self, executor: Executor, config: CoreConfig, policy: Policy = FCFS) -> None:
        self.executor = executor
        self.config = config
        self.policy = policy

    def initial_state(self) -> EngineState:
        """An empty state for this engine's config and policy. On an engine that has already run steps, adopt it
        with ``restore`` before stepping it (the executor counts steps: its next plan is not step 0)."""
        return initial_state(self.config, self.policy)

    def step(self, state: EngineState, plan: StepPlan) -> tuple[EngineState, EngineOutput]:
        """Run ``plan`` (from ``schedule(state_before)``; ``state`` is the state it returned) and commit it.

        The plan is checked against ``state`` before the executor sees it: a stale or foreign plan raises
        PlanMismatchError with the executor untouched, so the correct retry still works. If the executor's
        tokens are then rejected by ``commit`` (an id outside the vocabulary), the executor has run the step:
        ``restore(state)`` brings the two back in step (``EngineLoop`` does this itself). A plan of several decode
        steps (``fnvllm.state.multistep``) runs them back to back (``execute_steps``)."""
        self.check_plan(state, plan)
        return self._commit(state, plan, execute_steps(self.executor, plan))

    def launch(self, state: EngineState, plan: StepPlan, fed_by: object | None = None) -> object:
        """Check ``plan`` against ``state`` (as ``step`` does) and start it on an overlapping executor without
        waiting; ``collect`` commits it. ``fed_by``: see ``OverlapExecutor.launch``. A plan of several decode steps
        runs with ``step`` (PlanMismatchError here)."""
        self.check_plan(state, plan)
        if plan.num_steps > 1:
            raise PlanMismatchError(f"plan {plan.step} covers {plan.num_steps} decode steps: run it with Engine.step")
        return self._overlapping.launch(plan, fed_by)

    def collect(
        self, state: EngineState, plan: StepPlan, launched: object, keep: Sequence[bool] | None = None
    ) -> tuple[EngineState, EngineOutput]:
        """Wait for a launched step and commit it as ``plan``. ``keep``: the launched run was a speculative plan
        whose kept rows make up ``plan`` (``fnvllm.state.overlap.reconcile``); one flag per row that run sampled,
        in order (the tokens come one per sampled row): the tokens of unflagged rows are dropped."""
        return self._commit(state, plan, self._collected(launched, keep))

    def collect_folded(
        self,
        state: EngineState,
        plan: StepPlan,
        launched: object,
        keep: Sequence[bool] | None,
        speculation: Speculation,
    ) -> tuple[EngineState, EngineOutput, Folded | None]:
        """``collect``, with the commit and the next ``schedule`` read off ``speculation`` (``speculate(state,
        plan)``) when its placeholders can simply take the real tokens (``fold_speculation``). Returns the state,
        the step's output and the fold: with a fold, the state is the fold's (step N+1 planned: ``Folded.plan``);
        without one (None), it is ``plan`` committed, as ``collect`` returns it."""
        result = self._collected(launched, keep)
        folded = fold_speculation(state, plan, speculation, result.token_ids)
        if folded is None:
            return (*self._commit(state, plan, result), None)
        return folded.state, self._output(plan, folded.output, result), folded

    def _collected(self, launched: object, keep: Sequence[bool] | None) -> ExecuteResult:
        """The launched step's result, with the tokens (and logprobs) of the rows ``keep`` drops removed."""
        result = self._overlapping.collect(launched)
        if keep is not None and not all(keep):
            logprobs: Sequence[TokenLogprobs | None] = ()
            if isinstance(result.logprobs, StepLogprobs):
                logprobs = result.logprobs.select(keep)  # no row built
            elif result.logprobs:
                logprobs = tuple(compress(result.logprobs, keep))
            result = ExecuteResult(tuple(compress(result.token_ids, keep)), logprobs, result.prompt_logprobs)
        return result

    def discard(self, launched: object) -> None:
        """Forget a launched step that will not be committed (see ``OverlapExecutor.discard``)."""
        self._overlapping.discard(launched)

    @property
    def _overlapping(self) -> OverlapExecutor:
        if not supports_overlap(self.executor):
            raise TypeError(f"{type(self.executor).__name__} cannot launch steps without waiting (no overlap)")
        return self.executor  # type: ignore[return-value]  # checked just above

    def _commit(self, state: EngineState, plan: StepPlan, result: ExecuteResult) -> tuple[EngineState, EngineOutput]:
        state, output = commit(state, plan, result.token_ids)
        return state, self._output(plan, output, result)

    @staticmethod
    def _output(plan: StepPlan, output: StepOutput, result: ExecuteResult) -> EngineOutput:
        """The committed step's output with the logprobs of the rows that asked (a ``StepLogprobs`` stays lazy: a
        ``RequestLogprobs`` over it builds no row until one is read)."""
        logprobs: Mapping[str, TokenLogprobs] = {}
        if result.logprobs:
            every = plan.num_samples == plan.num_seqs  # a decode step: every row sampled, in plan order
            sampled_ids = plan.seq_ids if every else tuple(compress(plan.seq_ids, plan.sample))
            if isinstance(result.logprobs, StepLogprobs):
                logprobs = RequestLogprobs(sampled_ids, result.logprobs)
            else:
                pairs = zip(sampled_ids, result.logprobs, strict=True)
                logprobs = {rid: lp for rid, lp in pairs if lp is not None}
        return EngineOutput(output, logprobs, result.prompt_logprobs)

    def check_plan(self, state: EngineState, plan: StepPlan) -> None:
        """Raise PlanMismatchError unless ``plan`` is the one ``state`` is waiting to commit, for this engine."""
        if state.config is not self.config and state.config != self.config:
            raise PlanMismatchError("state was made with a different CoreConfig than this engine's")
        if not isinstance(plan, StepPlan):
            raise PlanMismatchError(f"plan must be a StepPlan, got {type(plan).__name__}")
        if state.pending_step != plan.step:
            expected = "no plan (schedule first)" if state.pending_step is None else f"step {state.pending_step}"
            raise PlanMismatchError(f"plan.step is {plan.step} but the state expects {expected}")
        if plan.block_size != self.config.block_size:
            raise PlanMismatchError(f"plan.block_size is {plan.block_size}, the engine's is {self.config.block_size}")

    def restore(self, state: EngineState) -> EngineState:
        """Adopt a snapshot (e.g. unpickled) on this engine: empties the KV bookkeeping to match this executor.

        Raises ValueError if the snapshot was made with a different core config.
        """
        if state.config != self.config:
            raise ValueError(f"snapshot config {state.config} differs from this engine's {self.config}")
        self.executor.reset(state.step)
        return forget_kv(state)

"""The executor contract: ``execute(plan) -> ExecuteResult``. Anything with that method can drive ``Engine``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from fnvllm.state import StepPlan
from fnvllm.state.multistep import substep, substep_inputs


class NonFiniteLogitsError(RuntimeError):
    """The model produced a NaN or an infinity in the logits of a sampled row (a broken checkpoint or an
    overflow); raised by the executor, naming the requests, instead of returning a token for them."""


@attrs.frozen
class TokenLogprobs:
    """Log-probabilities at one sampled position: the sampled token's, and the top-n (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class PromptLogprobs:
    """Log-probabilities of some prompt tokens of one request (``SamplingParams.prompt_logprobs``), computed by the
    step that fed them.

    start: the prompt position of the first entry. entries: one per position from ``start``, each the prompt
    token's logprob given the tokens before it and the top-k (id, logprob) there; None at position 0 (nothing
    precedes it) or where the step could not score it (its previous position was computed by another life).
    """

    start: int
    entries: tuple[TokenLogprobs | None, ...]


@attrs.frozen
class ExecuteResult:
    """One token per sampling sequence of the plan (in plan order), and their logprobs where asked (one entry per
    sampled row, None where it did not ask: a tuple, or a sequence that builds each entry when read, as
    ``fnvllm.executor.logprob_rows.StepLogprobs`` does).

    prompt_logprobs: per request id, the prompt logprobs of the tokens this step fed (requests that asked).
    """

    token_ids: tuple[int, ...]
    logprobs: Sequence[TokenLogprobs | None] = ()
    prompt_logprobs: Mapping[str, PromptLogprobs] = attrs.field(factory=dict)


class Executor(Protocol):
    """Applies plans to hardware (or a simulation). Must reject a plan whose step is not the next expected."""

    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Run the plan; return the sampled tokens."""
        ...

    def reset(self, next_step: int) -> None:
        """Forget all KV contents and expect ``next_step`` as the next plan (restoring a snapshot)."""
        ...


class OverlapExecutor(Executor, Protocol):
    """An executor that can run a step without waiting for it, so the host plans the next one meanwhile
    (``EngineLoop`` overlaps steps with one whose ``supports_overlap`` is True).

    ``launch(plan, fed_by)`` starts the plan and returns a handle at once; with ``fed_by`` (the handle of the step
    launched just before), each row of ``plan`` feeds the token that step sampled for the same sequence, read
    where it was sampled (device memory), instead of ``plan.input_tokens`` (placeholders: see
    ``fnvllm.state.overlap``). ``collect(handle)`` waits for the tokens. ``discard(handle)``: the launched step
    will never be collected; expect its plan's step number again next."""

    supports_overlap: bool

    def launch(self, plan: StepPlan, fed_by: object | None = None) -> object:
        """Start the plan; return a handle for ``collect`` (or a later launch's ``fed_by``)."""
        ...

    def collect(self, launched: object) -> ExecuteResult:
        """Wait for the launched step; its sampled tokens (plan order) and logprobs."""
        ...

    def discard(self, launched: object) -> None:
        """Forget a launched step that will not be committed: the next plan expected is its step again."""
        ...


def supports_overlap(executor: Executor) -> bool:
    """True when ``executor`` implements ``OverlapExecutor`` and says overlapping pays on its device."""
    return bool(getattr(executor, "supports_overlap", False))


class StalePlanError(RuntimeError):
    """The executor got a plan out of order (stale, repeated or skipped)."""


def check_step(expected: int, plan: StepPlan) -> None:
    """Raise StalePlanError unless ``plan.step == expected``."""
    if plan.step != expected:
        hint = " (a stale, repeated or skipped plan)"
        if plan.step == 0:  # the usual way to get here: a fresh state on an engine that has already run
            hint += "; a new state (initial_state()) on an engine that has run steps: adopt it with restore() first"
        raise StalePlanError(f"executor expected plan.step {expected}, got {plan.step}{hint}")


def execute_steps(executor: Executor, plan: StepPlan) -> ExecuteResult:
    """Run ``plan``, however many decode steps it covers: a one-step plan is ``executor.execute(plan)``; a
    multi-step plan (``fnvllm.state.multistep``) runs sub-step by sub-step (``substep``), each fed the tokens the
    one before sampled, through ``launch(..., fed_by=...)`` on an executor that overlaps (the tokens stay on the
    device, at most two sub-steps in flight) or from the host otherwise. Returns every sub-step's tokens,
    sub-step-major, as ``commit`` takes them (multi-step plans carry no logprob rows)."""
    if plan.num_steps == 1:
        return executor.execute(plan)
    if supports_overlap(executor):
        return _launch_steps(executor, plan)  # type: ignore[arg-type]
    tokens: list[int] = []
    inputs = plan.input_tokens
    for index in range(plan.num_steps):
        result = executor.execute(substep(plan, index, inputs))
        tokens += result.token_ids
        inputs = substep_inputs(result.token_ids, 0, plan.num_seqs)
    return ExecuteResult(tuple(tokens))


def _launch_steps(executor: OverlapExecutor, plan: StepPlan) -> ExecuteResult:
    """``execute_steps`` on an overlapping executor: sub-step j + 1 is launched fed by sub-step j before j is
    collected, so the device runs them back to back while the host collects."""
    launched = executor.launch(substep(plan, 0))
    tokens: list[int] = []
    for index in range(1, plan.num_steps):
        following = executor.launch(substep(plan, index), fed_by=launched)
        tokens += executor.collect(launched).token_ids
        launched = following
    tokens += executor.collect(launched).token_ids
    return ExecuteResult(tuple(tokens))

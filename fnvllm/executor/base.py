"""The executor contract: ``execute(plan) -> ExecuteResult``. Anything with that method can drive ``Engine``."""

from __future__ import annotations

from typing import Protocol

import attrs

from fnvllm.state import StepPlan


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
class ExecuteResult:
    """One token per sampling sequence of the plan (in plan order), and their logprobs where asked."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] = ()


class Executor(Protocol):
    """Applies plans to hardware (or a simulation). Must reject a plan whose step is not the next expected."""

    def execute(self, plan: StepPlan) -> ExecuteResult:
        """Run the plan; return the sampled tokens."""
        ...

    def reset(self, next_step: int) -> None:
        """Forget all KV contents and expect ``next_step`` as the next plan (restoring a snapshot)."""
        ...


class StalePlanError(RuntimeError):
    """The executor got a plan out of order (stale, repeated or skipped)."""


def check_step(expected: int, plan: StepPlan) -> None:
    """Raise StalePlanError unless ``plan.step == expected``."""
    if plan.step != expected:
        raise StalePlanError(
            f"executor expected plan.step {expected}, got {plan.step} (a stale, repeated or skipped plan)"
        )

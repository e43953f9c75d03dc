"""The naive reference model that ``CoreStateMachine`` runs beside the real core.

It knows nothing about blocks, budgets or queues: per live request, a plain list of the tokens it generated,
and the finish rule spelled out as simply as possible. Whatever the core does inside, the tokens it reports
must equal these lists.
"""

from __future__ import annotations

from collections.abc import Sequence

from fnvllm.state.plan import StepPlan
from fnvllm.state.request import FinishedRequest, FinishReason, Request, StepOutput
from fnvllm.testing.invariants import stop_reason


class NaiveModel:
    """The reference: what each live request has generated, as plain lists, and what finished and why."""

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos = eos_token_ids
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[tuple[int, ...], FinishReason]] = {}
        self.stale: set[str] = set()  # aborted while a plan was pending: that plan's rows for them are void

    @property
    def live(self) -> list[str]:
        """Live request ids, sorted (so Hypothesis draws from them deterministically)."""
        return sorted(self.outputs)

    def add(self, request: Request) -> None:
        """Record an accepted request."""
        self.requests[request.request_id] = request
        self.outputs[request.request_id] = []
        self.finished.pop(request.request_id, None)

    def tokens(self, rid: str) -> tuple[int, ...]:
        """Prompt plus generated tokens of a live request."""
        return self.requests[rid].prompt + tuple(self.outputs[rid])

    def abort(self, rid: str, pending: bool) -> None:
        """Forget a live request, as aborted."""
        self.finished[rid] = (tuple(self.outputs.pop(rid)), "abort")
        if pending:
            self.stale.add(rid)

    def commit(self, plan: StepPlan, sampled: Sequence[int]) -> StepOutput:
        """What commit should return: each sampled token appended to its (still live) request, stops applied; a
        multi-step plan's tokens sub-step by sub-step (a request that stopped takes no more)."""
        ids, tokens, finished = [], [], []
        sampling = [rid for rid, sample in zip(plan.seq_ids, plan.sample, strict=True) if sample]
        for rid, token in zip(sampling * plan.num_steps, sampled, strict=True):
            if rid in self.stale or rid not in self.outputs:
                continue
            self.outputs[rid].append(token)
            ids.append(rid)
            tokens.append(token)
            reason = stop_reason(self.requests[rid], self.outputs[rid], self.eos)
            if reason is not None:
                output = tuple(self.outputs.pop(rid))
                self.finished[rid] = (output, reason)
                finished.append(FinishedRequest(rid, len(self.requests[rid].prompt), output, reason))
        self.stale.clear()
        return StepOutput(plan.step, tuple(ids), tuple(tokens), tuple(finished))


def step_bound(requests: Sequence[Request]) -> int:
    """A generous number of steps within which a correct FCFS/priority core finishes ``requests`` (no arrivals).

    Each step the highest-priority running sequence, which nothing preempts, feeds at least one token, so the
    work (prompt + max_tokens of every request) bounds one pass; preemption makes lower-priority requests
    recompute, which n + 1 passes cover with room to spare (drains in this suite use under half of it).
    """
    work = sum(len(r.prompt) + r.params.max_tokens for r in requests)
    return (len(requests) + 1) * work + 2

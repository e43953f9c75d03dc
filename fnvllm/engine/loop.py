"""EngineLoop: the one engine loop. It owns the ``EngineState`` and an ``Engine``, admits and aborts requests
between steps, and steps while work exists; the ``OutputProcessor`` routes each step's tokens to their requests.

One step reads like the design's pseudo-code::

    state, plan = schedule(state)               # pure
    state, out = engine.step(state, plan)       # executor.execute(plan) + pure commit
    state = processor.process(state, out)       # route tokens; stop strings end requests

``LLM.generate`` / ``LLM.stream``, ``fnvllm.testing.drive``, the benchmarks and the server are clients: they add
requests with a ``RequestTracker`` and call ``step`` until their own requests are done. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from fnvllm.engine.core import Engine, EngineOutput
from fnvllm.engine.output import OutputProcessor, RequestTracker
from fnvllm.state import EngineState, SamplingParams, StepPlan, abort, add_request, schedule


@attrs.frozen
class EngineStats:
    """Running totals since the loop started: steps run, sequences preempted, prompt tokens served from the
    prefix cache (not recomputed), and tokens generated."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0


def admitted_cached_tokens(before: EngineState, after: EngineState, plan: StepPlan) -> dict[str, int]:
    """Prompt/output tokens each sequence admitted by ``plan`` found in the prefix cache (its start position).

    ``before`` is the state ``schedule`` was given, ``after`` the one it returned. ``schedule`` hands back the
    very same waiting tuple when it admits and preempts nothing, so most decode steps cost one identity test.
    """
    if after.waiting is before.waiting:
        return {}
    running = before.num_computed  # rows running before this step; every other plan row was just admitted
    return {rid: start for rid, start in zip(plan.seq_ids, plan.start_positions, strict=True) if rid not in running}


StepHook = Callable[[EngineState, StepPlan, EngineOutput], None]


class EngineLoop:
    """The engine loop: state + engine + output processor. Not thread-safe: one owner drives it.

    on_step(state, plan, output) (optional) sees every committed step, after routing (timelines, tests).
    """

    def __init__(self, engine: Engine, state: EngineState | None = None, on_step: StepHook | None = None) -> None:
        self.engine = engine
        self.state = engine.initial_state() if state is None else state
        self.processor = OutputProcessor()
        self.stats = EngineStats()
        self.on_step = on_step

    @property
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return self.state.has_unfinished

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tracker: RequestTracker | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request (validated by the pure ``add_request``: on error nothing changes); route its outputs
        to ``tracker`` when given."""
        self.state = add_request(self.state, request_id, tuple(prompt_ids), params, priority)
        if tracker is not None:
            self.processor.add(tracker)

    def add_many(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams, RequestTracker | None]]) -> None:
        """Queue several requests atomically: if any is invalid, raise and queue none."""
        state = self.state
        for rid, ids, params, _ in requests:
            state = add_request(state, rid, tuple(ids), params)
        self.state = state
        for *_, tracker in requests:
            if tracker is not None:
                self.processor.add(tracker)

    def abort(self, request_id: str) -> None:
        """Remove a live request and free its blocks; its tracker (if any) gets a final "abort" delta.

        Unknown or already finished ids are ignored (a client may disconnect after its request finished)."""
        if request_id in self.state.requests:
            self.state = abort(self.state, request_id)
        self.processor.abort(request_id)

    def step(self) -> EngineOutput:
        """Schedule, execute and commit one step, then route its outputs. Returns the committed step.

        If the executor or commit raises, the loop resets the executor and the state's KV bookkeeping (every
        request stays queued and will be recomputed) and re-raises."""
        before = self.state
        state, plan = schedule(before)
        try:
            state, out = self.engine.step(state, plan)
        except BaseException:
            self.state = self.engine.restore(before)  # executor and state in step again; nothing lost
            raise
        cached = admitted_cached_tokens(before, state, plan)
        self.processor.note_cached(cached)
        self.state = self.processor.process(state, out)
        self._count(plan, sum(cached.values()))
        if self.on_step is not None:
            self.on_step(self.state, plan, out)
        return out

    def _count(self, plan: StepPlan, cached: int) -> None:
        s = self.stats
        self.stats = EngineStats(
            s.num_steps + 1,
            s.num_preemptions + len(plan.preempted),
            s.num_cached_tokens + cached,
            s.num_generated_tokens + plan.num_samples,
        )

    def run_until_done(self, trackers: Mapping[str, RequestTracker] | None = None) -> None:
        """Step until ``trackers`` have all finished (or, without trackers, until nothing is left)."""
        if trackers is None:
            while self.has_unfinished:
                self.step()
            return
        while not all(t.finished for t in trackers.values()):
            self.step()

"""EngineLoop: the one engine loop. It owns the ``EngineState`` and an ``Engine``, admits and aborts requests
between steps, and steps while work exists; the ``OutputProcessor`` routes each step's tokens to their requests.

One step reads like the design's pseudo-code::

    state, plan = schedule(state)               # pure
    state, out = engine.step(state, plan)       # executor.execute(plan) + pure commit
    state, outbox = processor.process(state, out)  # route tokens; stop strings end requests
    deliver(outbox)                             # consumers' callbacks, once the state is adopted

Its clients: ``LLM.generate`` / ``LLM.stream`` (and through ``LLM`` the bench and the profilers), the server's
``EngineWorker`` (all built by ``fnvllm.engine.build``), and the simulator (``fnvllm.sim.loop``: a ``SimExecutor``
and the simulated clock). They add requests with a ``RequestTracker`` and call ``step`` until their own requests
are done; ``drain`` commits a step in flight, ``adopt`` takes back a step a driver ran by hand, and ``restore``
adopts a snapshot. ``fnvllm.testing.drive`` writes the three pure calls without routing or overlap, for tests of
the pure core.

Overlapped steps (on an executor with ``supports_overlap``, e.g. the CUDA ``ModelExecutor``): each ``step``
commits one step as above, but the device already runs the next one by then::

    spec = speculate(state, plan_N)                            # pure: plan N+1 from placeholder tokens
    launched = engine.launch(spec.state, spec.plan, fed_by=N)  # device: N+1 behind N, fed N's tokens there
    state, out = engine.collect(state, plan_N, N)              # wait for N's tokens, commit them
    state, outbox = processor.process(state, out)
    verdict = reconcile(state, spec)                           # pure: does the run of N+1 stand? else drop it
    deliver(outbox)                                            # user code last: it may add or abort requests

so the host's commit, routing and planning hide behind the device's work (``fnvllm.state.overlap``). When no
token or stop string ends a request (most steps), ``engine.collect_folded`` replaces the commit and the
reconcile: it puts N's tokens where the speculation's placeholders are (``fold_speculation``), which is exactly
the commit followed by ``schedule``, so the host runs one commit and one schedule per step, not two of each; the
loop's state is then already step N+1's pending state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import compress

import attrs

from fnvllm.engine.core import Engine, EngineOutput
from fnvllm.engine.output import Outbox, OutputProcessor, RequestTracker, deliver_all
from fnvllm.executor.base import supports_overlap
from fnvllm.executor.structured import check_structured
from fnvllm.state import (
    EngineState,
    InvalidRequestError,
    PlanMismatchError,
    SamplingParams,
    StepPlan,
    abort,
    add_request,
    commit,
    finish,
    schedule,
)
from fnvllm.state.multistep import check_max_steps, decode_steps, schedule_steps
from fnvllm.state.overlap import Folded, Speculation, reconcile, speculate
from fnvllm.state.state import add_requests


@attrs.frozen
class EngineStats:
    """Running totals since the loop started: steps run, sequences preempted, prompt tokens served from the
    prefix cache (not recomputed), and tokens generated."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0


StepHook = Callable[[EngineState, StepPlan, EngineOutput], None]


@attrs.frozen(eq=False)
class _Flight:
    """A step running on the device, not yet committed.

    plan: the plan to commit. launched: the executor's handle of the run. keep: when the run was a speculative
    plan standing for ``plan``, one flag per row it sampled: that row's token belongs to ``plan`` (None: the
    run is ``plan`` itself).
    cached: prompt tokens its admissions found in the prefix cache (for the stats).
    """

    plan: StepPlan
    launched: object
    keep: tuple[bool, ...] | None = None
    cached: int = 0


@attrs.frozen
class OverlapStats:
    """Speculative steps since the loop started: launched, kept, and dropped (their device work wasted)."""

    launched: int = 0
    kept: int = 0
    dropped: int = 0


class EngineLoop:
    """The engine loop: state + engine + output processor. Not thread-safe: one owner drives it.

    on_step(state, plan, output) (optional) sees every committed step, after routing (timelines, tests). When
        an overlapped step's commit was folded into the next step's plan, ``state`` is that plan's pending state
        (step ``plan.step`` committed, the next one planned: ``pending_step`` is set).
    overlap: overlap steps when the executor supports it (``supports_overlap``); False always steps plainly.
    clock: the time source of the per-request metrics (``time.perf_counter``).
    decode_steps: plan up to this many decode steps at once where every running request decodes and nothing
        waits (``fnvllm.state.multistep``): the host schedules, commits and routes once per plan, and the device
        runs the sub-steps back to back. Such a plan runs as a plain step (not overlapped with the next plan);
        1 (the default) plans one step at a time.
    While a step is in flight, ``state`` is the state waiting for it to be committed: requests may be added and
    aborted as at any other time, from a tracker's ``on_delta`` or the ``on_step`` hook too.

    User code run by a step (``on_delta`` callbacks, the ``on_step`` hook) cannot corrupt the loop: the step
    completes first (tokens committed and routed, the next step launched or dropped), then the first exception
    that user code raised is raised from ``step`` (once); the next ``step`` carries on as if nothing happened.
    """

    def __init__(
        self,
        engine: Engine,
        state: EngineState | None = None,
        on_step: StepHook | None = None,
        overlap: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        decode_steps: int = 1,
    ) -> None:
        self.engine = engine
        self.decode_steps = check_max_steps(decode_steps)
        self.state = engine.initial_state() if state is None else state
        self.processor = OutputProcessor(clock)
        self.stats = EngineStats()
        self.overlap_stats = OverlapStats()
        self.on_step = on_step
        self.overlap = overlap and supports_overlap(engine.executor)
        self._flight: _Flight | None = None

    @property
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (or a step is in flight)."""
        return self.state.has_unfinished or self._flight is not None

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tracker: RequestTracker | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request (validated by the pure ``add_request``, and its grammar compiled by
        ``check_structured``: on error nothing changes); route its outputs to ``tracker`` when given."""
        self._check_structured(params)
        self.state = add_request(self.state, request_id, tuple(prompt_ids), params, priority)
        if tracker is not None:
            self.processor.add(tracker)

    def add_many(
        self,
        requests: Sequence[tuple[str, Sequence[int], SamplingParams, RequestTracker | None]],
        priorities: Sequence[int] | None = None,
    ) -> None:
        """Queue several requests atomically, in one pass over the queue (``add_requests``): if any is invalid,
        raise and queue none. ``priorities``: one per request (default 0 each)."""
        for _, _, params, _ in requests:
            self._check_structured(params)
        ranks = [0] * len(requests) if priorities is None else priorities
        due = ((rid, tuple(ids), params, rank) for (rid, ids, params, _), rank in zip(requests, ranks, strict=True))
        self.state = add_requests(self.state, due)
        for *_, tracker in requests:
            if tracker is not None:
                self.processor.add(tracker)

    def _check_structured(self, params: SamplingParams) -> None:
        """InvalidRequestError unless a constrained request's grammar compiles and the executor can enforce it
        (a model executor built without a tokenizer has no grammars; a simulated one samples nothing)."""
        if params.structured is None:
            return
        check_structured(params)
        if getattr(self.engine.executor, "grammars", True) is None:
            raise InvalidRequestError(
                "SamplingParams.structured: this engine was built without a tokenizer (load_tokenizer=False), "
                "which grammar-constrained decoding needs"
            )

    def abort(self, request_id: str) -> None:
        """Remove a live request and free its blocks; its tracker (if any) gets a final "abort" delta.

        Unknown or already finished ids are ignored (a client may disconnect after its request finished)."""
        if request_id in self.state.requests:
            self.state = abort(self.state, request_id)
        self.processor.abort(request_id)

    def step(self) -> EngineOutput:
        """Schedule, execute and commit one step, then route its outputs. Returns the committed step.

        If the executor or commit raises, the loop resets the executor and the state's KV bookkeeping (every
        request stays queued and will be recomputed) and re-raises. If user code raises (a tracker's
        ``on_delta``, the ``on_step`` hook), the step completes and the first such exception is raised."""
        errors: list[BaseException] = []
        overlapped = self.overlap and (self._flight is not None or not self._plans_steps(self.state))
        out = self._step_overlapped(errors) if overlapped else self._step_plain(errors)
        if errors:
            raise errors[0]
        return out

    def _plans_steps(self, state: EngineState) -> bool:
        """Whether the next plan from ``state`` (no plan pending) covers several decode steps."""
        return self.decode_steps > 1 and decode_steps(state, self.decode_steps) > 1

    def _schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        """The next plan: ``schedule``, or ``schedule_steps`` with ``decode_steps`` > 1."""
        return schedule_steps(state, self.decode_steps) if self.decode_steps > 1 else schedule(state)

    def _step_plain(self, errors: list[BaseException]) -> EngineOutput:
        before = self.state
        state, plan = self._schedule(before)
        planned_at = self.processor.clock() if plan.num_admitted else None  # its admissions' scheduled time
        try:
            state, out = self.engine.step(state, plan)
        except BaseException:
            self.state = self.engine.restore(before)  # executor and state in step again; nothing lost
            raise
        self._finish_step(state, plan, out, self._note_admissions(plan, planned_at), errors)
        return out

    def _step_overlapped(self, errors: list[BaseException]) -> EngineOutput:
        """One step with the next one launched before this one's tokens are waited for (module docstring)."""
        flight = self._flight if self._flight is not None else self._launch_scheduled()
        self._flight = None
        pending = self.state
        speculative, folded = None, None
        try:  # a batch that may take a multi-step plan next is not speculated: that plan runs plainly
            spec = None if self._may_plan_steps(pending, flight.plan) else speculate(pending, flight.plan)
            if spec is not None:
                speculative = self.engine.launch(spec.state, spec.plan, fed_by=flight.launched)
                state, out, folded = self.engine.collect_folded(
                    pending, flight.plan, flight.launched, flight.keep, spec
                )
            else:
                state, out = self.engine.collect(pending, flight.plan, flight.launched, flight.keep)
        except BaseException:
            self.state = self.engine.restore(pending)  # any launched step is forgotten with the KV contents
            raise
        if spec is not None and speculative is not None and folded is not None:
            committed, outbox = self._adopt_folded(pending, flight, folded, out, spec, speculative)
        else:
            outbox = self._adopt(state, flight.plan, out, flight.cached)
            committed = self.state
            if spec is not None and speculative is not None:
                self._reconcile(spec, speculative)  # before user code runs: it may add or abort requests
        self._run_user_code(committed, flight.plan, out, outbox, errors)
        return out

    def _may_plan_steps(self, pending: EngineState, plan: StepPlan) -> bool:
        """Whether the plan after ``plan`` (pending in ``pending``) may cover several decode steps: with
        ``decode_steps`` > 1, nothing waits and every row of ``plan`` decodes. Checked before its tokens are known,
        so it may say yes for a plan that turns out one step long (e.g. a row reaches its limit)."""
        if self.decode_steps == 1 or pending.waiting or plan.num_admitted:
            return False
        return all(len(tokens) == 1 for tokens in plan.input_tokens) and all(plan.sample)

    def _adopt_folded(
        self, pending: EngineState, flight: _Flight, folded: Folded, out: EngineOutput, spec: Speculation, run: object
    ) -> tuple[EngineState, Outbox]:
        """Adopt a step whose commit was folded into the speculation (``Engine.collect_folded``): unless a stop
        string ends a request, the speculative run stands for the folded plan, and the folded state (step N+1
        planned) is the loop's. Otherwise commit as usual, end the same requests, and reconcile. Returns the state
        the step hook sees and the deltas to deliver."""
        routed, outbox = self.processor.process(folded.state, out)
        self._count(flight.plan, flight.cached, len(out.output.new_tokens))
        if routed is folded.state:
            self.state = routed
            self._prune_grammars()
            self._flight = _Flight(folded.plan, run, None, self._note_admissions(folded.plan))
            s = self.overlap_stats
            self.overlap_stats = OverlapStats(s.launched + 1, s.kept + 1, s.dropped)
            return routed, outbox
        state, _ = commit(pending, flight.plan, out.output.new_tokens)  # the tokens the fold was given
        for rid in out.output.seq_ids:  # the requests a stop string ended, in the order the processor ended them
            if rid in folded.state.requests and rid not in routed.requests:
                state = finish(state, rid)
        self.state = state
        self._prune_grammars()
        self._reconcile(spec, run)
        return state, outbox

    def drain(self) -> EngineOutput | None:
        """Commit the step in flight, if any, without launching another; returns it (None when nothing was in
        flight). Afterwards ``state`` has no plan pending, so a driver may snapshot the state, or run a step's
        calls itself and hand the result back with ``adopt``. User-code exceptions are raised as by ``step``."""
        flight = self._flight
        if flight is None:
            return None
        self._flight = None
        pending, errors = self.state, list[BaseException]()
        try:
            state, out = self.engine.collect(pending, flight.plan, flight.launched, flight.keep)
        except BaseException:
            self.state = self.engine.restore(pending)
            raise
        self._finish_step(state, flight.plan, out, flight.cached, errors)
        if errors:
            raise errors[0]
        return out

    def adopt(self, state: EngineState, plan: StepPlan, out: EngineOutput) -> None:
        """Take over a step the driver ran itself, as ``step`` takes over its own: route its tokens, count it,
        then run the user code it triggers (exceptions raised as by ``step``). For drivers that time or replace
        one of the step's calls::

            loop.drain()                                  # no step in flight
            state, plan = schedule(loop.state)            # pure
            state, out = loop.engine.step(state, plan)    # execute + pure commit
            loop.adopt(state, plan, out)

        PlanMismatchError (nothing changes) unless no step is in flight, ``plan`` was scheduled from the loop's
        state and ``state`` is that plan committed."""
        self._check_adoptable(state, plan)
        errors: list[BaseException] = []
        self._finish_step(state, plan, out, self._note_admissions(plan), errors)
        if errors:
            raise errors[0]

    def _check_adoptable(self, state: EngineState, plan: StepPlan) -> None:
        """PlanMismatchError unless ``state`` is ``plan`` committed and ``plan`` continues the loop's state."""
        current = self.state
        if self._flight is not None or current.pending_step is not None:
            raise PlanMismatchError("a step is in flight: call drain() before running steps by hand")
        if plan.step != current.step:
            raise PlanMismatchError(f"plan.step is {plan.step} but the loop's state plans step {current.step} next")
        if state.pending_step is not None or state.step != plan.step + plan.num_steps:
            raise PlanMismatchError(f"state is not step {plan.step} committed (engine.step returns that state)")

    def restore(self, state: EngineState | None = None) -> None:
        """Adopt ``state`` (a snapshot, e.g. unpickled; default: the loop's own) as on a fresh KV cache: a step
        in flight is forgotten, the executor expects the state's next step, and running requests rejoin waiting
        with their tokens kept (recomputed, the prefix cache emptied). Trackers keep routing their requests.
        ValueError if the snapshot was made for a different core config."""
        restored = self.engine.restore(self.state if state is None else state)
        self._flight = None
        self.state = restored

    def _finish_step(
        self, state: EngineState, plan: StepPlan, out: EngineOutput, cached: int, errors: list[BaseException]
    ) -> None:
        """Adopt a committed step, then run the user code it triggers."""
        outbox = self._adopt(state, plan, out, cached)
        self._run_user_code(self.state, plan, out, outbox, errors)

    def _adopt(self, state: EngineState, plan: StepPlan, out: EngineOutput, cached: int) -> Outbox:
        """Make the committed step the loop's state (stop strings applied) and count it; returns the deltas to
        deliver. Runs no user code."""
        self.state, outbox = self.processor.process(state, out)
        self._count(plan, cached, len(out.output.new_tokens))
        self._prune_grammars()
        return outbox

    def _prune_grammars(self) -> None:
        """Drop the grammar matchers of requests that left the loop's state."""
        grammars = getattr(self.engine.executor, "grammars", None)  # constrained requests' matchers
        if grammars is not None and grammars.num_live:
            grammars.prune(self.state.requests)

    def _run_user_code(
        self,
        committed: EngineState,
        plan: StepPlan,
        out: EngineOutput,
        outbox: Outbox,
        errors: list[BaseException],
    ) -> None:
        """Deliver the step's deltas and call the step hook with the committed state; their exceptions go to
        ``errors``."""
        deliver_all(outbox, errors)
        if self.on_step is not None:
            try:
                self.on_step(committed, plan, out)
            except BaseException as error:  # user code; raised by ``step`` once the step is complete
                errors.append(error)

    def _launch_scheduled(self) -> _Flight:
        """Schedule from the committed state and launch the plan."""
        before = self.state
        state, plan = schedule(before)
        try:
            launched = self.engine.launch(state, plan)
        except BaseException:
            self.state = self.engine.restore(before)
            raise
        self.state = state
        return _Flight(plan, launched, None, self._note_admissions(plan))

    def _reconcile(self, spec: Speculation, launched: object) -> None:
        """Keep the speculative run as the next flight, or drop it (``fnvllm.state.overlap.reconcile``)."""
        committed = self.state
        verdict = reconcile(committed, spec)
        s = self.overlap_stats
        if verdict.kept and verdict.plan is not None:
            plan = verdict.plan
            keep = tuple(compress(verdict.keep, spec.plan.sample))  # per sampled row, as the tokens come
            self._flight = _Flight(plan, launched, keep, self._note_admissions(plan))  # a mixed step may admit
            self.overlap_stats = OverlapStats(s.launched + 1, s.kept + 1, s.dropped)
        else:
            self.engine.discard(launched)
            self.overlap_stats = OverlapStats(s.launched + 1, s.kept, s.dropped + 1)
        self.state = verdict.state

    def _note_admissions(self, plan: StepPlan, planned_at: float | None = None) -> int:
        """Tell the trackers of the requests ``plan`` admits how many prompt tokens the prefix cache served
        them, and when it was planned (``planned_at``; default now: a launched plan is noted as it launches);
        returns the total (for the stats)."""
        cached = plan.admitted_starts()
        self.processor.note_cached(cached, planned_at)
        return sum(cached.values())

    def _count(self, plan: StepPlan, cached: int, num_tokens: int) -> None:
        """Add a committed plan (all its sub-steps) and the ``num_tokens`` tokens it gave its requests."""
        s = self.stats
        self.stats = EngineStats(
            s.num_steps + plan.num_steps,
            s.num_preemptions + len(plan.preempted),
            s.num_cached_tokens + cached,
            s.num_generated_tokens + num_tokens,
        )

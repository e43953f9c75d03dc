"""CoreStateMachine: a Hypothesis rule-based state machine that drives the pure core beside a naive model.

Rules add valid and invalid requests, schedule, commit arbitrary sampled tokens (EOS ids included), abort, and
drain; the pool pressure comes from the tiny pools ``core_configs`` draws. After every rule the invariants of
``fnvllm.testing.invariants`` are checked, the real outputs are compared with ``NaiveModel`` (a dict of token
lists), and every transition is checked not to mutate its inputs. When a run ends, ``teardown`` drives the
state to completion within a step bound computed from the workload (liveness: nobody starves).

Everything under test is a hook, so you can check your own policy or scheduler by subclassing::

    class MyPolicyMachine(CoreStateMachine):
        policy = MY_POLICY                      # a Policy value
        configs = core_configs(max_num_seqs=8)  # the config strategy
        decode_steps = 4                        # plans of up to 4 decode steps (fnvllm.state.multistep)

        def block_hasher(self):                 # replaces the config's block hasher (None keeps it)
            return my_hasher

        def schedule(self, state):              # or wrap the real one
            return my_schedule(state)

    TestMyPolicy = MyPolicyMachine.TestCase

A rule added by a subclass should call ``self.begin()`` first, so that teardown knows whether it finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import fnvllm.state as core
from fnvllm.executor.base import execute_steps
from fnvllm.state import CoreConfig, EngineState, InvalidRequestError, PlanMismatchError, Policy, SamplingParams
from fnvllm.state.hashing import BlockHasher
from fnvllm.state.multistep import schedule_steps
from fnvllm.state.plan import StepPlan
from fnvllm.state.request import Request, StepOutput
from fnvllm.testing import invariants as inv
from fnvllm.testing.reference import NaiveModel, step_bound
from fnvllm.testing.strategies import (
    core_configs,
    invalid_requests,
    max_request_len,
    prefix_pools,
    requests,
    sampled_for,
    uses_history,
    vocab_of,
)
from fnvllm.testing.toy import CounterToyExecutor

MISUSE_KINDS = ("abort_unknown", "schedule_while_pending", "commit_wrong_count", "commit_without_plan")


class CoreStateMachine(RuleBasedStateMachine):
    """Random scripts of add / schedule / commit / abort against the real core and a naive model."""

    configs: ClassVar[st.SearchStrategy[CoreConfig]] = core_configs()
    policy: ClassVar[Policy] = core.FCFS
    decode_steps: ClassVar[int] = 1  # > 1: the default ``schedule`` plans up to this many decode steps at once

    state: EngineState
    config: CoreConfig

    def __init__(self) -> None:
        super().__init__()
        self.pending: StepPlan | None = None
        self.kv: inv.ShadowKV = {}
        self.next_id = 0
        self.num_added = 0  # the machine's own count of accepted requests: the next arrival stamp
        self.dirty = False

    # ----- hooks: override these to test your own scheduler, commit or config -----

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        """The scheduler under test (``schedule_steps`` when the class sets ``decode_steps`` > 1)."""
        return schedule_steps(state, self.decode_steps) if self.decode_steps > 1 else core.schedule(state)

    def commit(self, state: EngineState, plan: StepPlan, sampled: Sequence[int]) -> tuple[EngineState, StepOutput]:
        """The commit under test."""
        return core.commit(state, plan, sampled)

    def prepare_config(self, config: CoreConfig) -> CoreConfig:
        """The drawn config as the machine will use it (with ``block_hasher()`` when that is set)."""
        hasher = self.block_hasher()
        return config if hasher is None else attrs.evolve(config, hash_block=hasher)

    def block_hasher(self) -> BlockHasher | None:
        """A block hasher to use instead of the config's (None keeps the config's). Must pickle (module-level)."""
        return None

    # ----- rules -----

    def begin(self) -> None:
        """Mark a rule as in progress; ``check_invariants`` clears the mark once the rule and invariants passed."""
        self.dirty = True

    def check_invariants(self, *args: Any, **kwargs: Any) -> None:
        """Hypothesis's invariant pass, remembering that the machine is healthy afterwards."""
        super().check_invariants(*args, **kwargs)
        self.dirty = False

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        """Draw the config and the prefix pool that prompts share; start from an empty state."""
        self.begin()
        self.config = self.prepare_config(data.draw(self.configs, label="config"))
        self.state = core.initial_state(self.config, self.policy)
        self.model = NaiveModel(self.config.eos_token_ids)
        self.prefixes = data.draw(prefix_pools(vocab_of(self.config), max_request_len(self.config)), label="prefixes")
        note(f"state = initial_state({self.config!r}, {self.policy.name})")
        # An initial burst, because Hypothesis's swarm testing disables the add rule in some runs.
        for _ in range(data.draw(st.integers(0, 4), label="initial requests")):
            self._add_one(data)

    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data: st.DataObject, count: int) -> None:
        """Add ``count`` valid requests (sometimes reusing the id of one that already left)."""
        self.begin()
        for _ in range(count):
            self._add_one(data)

    @rule(data=st.data())
    def add_invalid(self, data: st.DataObject) -> None:
        """An invalid request raises InvalidRequestError and leaves the state exactly as it was."""
        self.begin()
        bad = data.draw(invalid_requests(self.config, self.model.live), label="invalid request")
        note(f"add_request(state, {bad.request_id!r}, {bad.prompt}, {_brief(bad.params)})  # {bad.kind}: must raise")
        before = inv.snapshot(self.state)
        try:
            core.add_request(self.state, bad.request_id, bad.prompt, bad.params)
        except InvalidRequestError:
            pass
        else:
            inv.fail(f"add_request accepted an invalid request: {bad}")
        if inv.snapshot(self.state) != before:
            inv.fail(f"add_request changed the state while rejecting {bad}")

    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        """Schedule one step and leave it pending, so aborts and adds can come before its commit."""
        self.begin()
        self._finish_pending(data)
        self._schedule()

    @rule(data=st.data())
    def execute(self, data: st.DataObject) -> None:
        """Commit the pending plan (scheduling one first if none is) with arbitrary sampled tokens."""
        self.begin()
        plan = self.pending or self._schedule()
        self._commit(data.draw(sampled_for(self.config, plan.num_samples), label="sampled"))

    @rule(data=st.data(), steps=st.integers(1, 8))
    def step(self, data: st.DataObject, steps: int) -> None:
        """Schedule and commit ``steps`` times with arbitrary sampled tokens."""
        self.begin()
        self._finish_pending(data)
        for i in range(steps):
            if i:
                self.check_all()
            plan = self._schedule()
            self._commit(data.draw(sampled_for(self.config, plan.num_samples), label="sampled"))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Abort a live request (also between schedule and commit); its blocks are released."""
        self.begin()
        if not self.model.live:
            return
        rid = data.draw(st.sampled_from(self.model.live), label="abort id")
        note(f"state = abort(state, {rid!r})")
        if self.pending is not None:
            event("abort between schedule and commit")
        self.state = inv.run_pure(core.abort, self.state, rid)
        self.model.abort(rid, self.pending is not None)

    @rule(data=st.data())
    def abort_planned(self, data: st.DataObject) -> None:
        """Abort a request the pending plan schedules (between schedule and commit): commit must skip its row
        and still give every other request exactly the token sampled for it (checked against the model)."""
        self.begin()
        plan = self.pending
        planned = [rid for rid in plan.seq_ids if rid in self.model.outputs] if plan is not None else []
        if not planned:
            return
        rid = data.draw(st.sampled_from(sorted(set(planned))), label="abort planned id")
        note(f"state = abort(state, {rid!r})  # scheduled in the pending plan")
        event("abort of a planned row")
        self.state = inv.run_pure(core.abort, self.state, rid)
        self.model.abort(rid, True)

    @rule(kind=st.sampled_from(MISUSE_KINDS))
    def misuse(self, kind: str) -> None:
        """Misusing the API raises a clear error and leaves the state as it was."""
        self.begin()
        call = self._misuse_call(kind)
        if call is None:
            return
        before = inv.snapshot(self.state)
        try:
            call()
        except (KeyError, PlanMismatchError):
            pass
        else:
            inv.fail(f"misuse {kind!r} did not raise")
        if inv.snapshot(self.state) != before:
            inv.fail(f"misuse {kind!r} changed the state")

    @rule()
    def drain(self) -> None:
        """Run everything live to completion (liveness) and keep going afterwards."""
        self.begin()
        self.run_to_completion()

    def teardown(self) -> None:
        """At the end of every healthy run, everything still live must finish within the step bound."""
        if not self.dirty and hasattr(self, "state"):
            note("# teardown: run everything live to completion")
            self.run_to_completion()

    # ----- invariants -----

    @invariant()
    def blocks_conserved(self) -> None:
        """free + referenced = all blocks, disjoint, no duplicates."""
        inv.check_blocks_conserved(self.state)

    @invariant()
    def ref_counts_match_holders(self) -> None:
        """Each ref count = number of running sequences holding the block; nobody holds a block twice."""
        inv.check_ref_counts(self.state)

    @invariant()
    def queues_consistent(self) -> None:
        """Waiting/running partition the live requests in policy order; the cap on running holds."""
        inv.check_queues(self.state)
        if set(self.state.requests) != set(self.model.live):
            inv.fail(f"live requests {sorted(self.state.requests)} != model's {self.model.live}")

    @invariant()
    def outputs_match_model(self) -> None:
        """No generated token is lost, added or changed (across preemption too)."""
        for rid in self.model.live:
            if inv.seq_tokens(self.state, rid) != self.model.tokens(rid):
                inv.fail(
                    f"tokens of {rid!r}: state has {inv.seq_tokens(self.state, rid)}, "
                    f"model has {self.model.tokens(rid)}"
                )
        inv.check_lengths(self.state)

    @invariant()
    def queues_in_reference_order(self) -> None:
        """Each queue is sorted by the machine's own reading of the policy (arrival order, or priority then
        arrival), not by the policy key under test; other policies are left to ``queues_consistent``."""
        reference = _REFERENCE_ORDER.get(self.policy.name)
        if reference is None:
            return
        for name, queue in (("waiting", self.state.waiting), ("running", self.state.running)):
            keys = [reference(self.model.requests[rid]) for rid in queue]
            if keys != sorted(keys):
                inv.fail(f"{name} queue out of {self.policy.name} order: {list(zip(queue, keys, strict=True))}")

    @invariant()
    def slots_distinct(self) -> None:
        """Each running request holds its own slot in [0, max_num_seqs); waiting ones hold none."""
        inv.check_slots(self.state)

    @invariant()
    def prefix_cache_consistent(self) -> None:
        """The hash map is the inverse of the cached blocks and consistent with their contents and chains."""
        inv.check_prefix_cache(self.state)

    @invariant()
    def derived_state_consistent(self) -> None:
        """Every cached/derived field (running columns, decode prefix, mapping views) equals a fresh recomputation."""
        inv.check_derived(self.state)

    @invariant()
    def kv_consistent(self) -> None:
        """Every computed position reads back its own token through the block table (shadow KV cache)."""
        inv.check_kv(self.state, self.kv)

    def check_all(self) -> None:
        """Every invariant, now (used between the steps of one rule)."""
        for check in (
            self.derived_state_consistent,
            self.blocks_conserved,
            self.ref_counts_match_holders,
            self.queues_consistent,
            self.outputs_match_model,
            self.slots_distinct,
            self.prefix_cache_consistent,
            self.kv_consistent,
        ):
            check()

    # ----- transitions, checked -----

    def _schedule(self) -> StepPlan:
        before = self.state
        self.state, plan = inv.run_pure(self.schedule, before)
        rows = ", ".join(
            f"{r}@{s}+{len(t)}" for r, s, t in zip(plan.seq_ids, plan.start_positions, plan.input_tokens, strict=True)
        )
        steps = f" x {plan.num_steps} steps" if plan.num_steps > 1 else ""
        note(f"state, plan = schedule(state)  # step {plan.step}{steps}: [{rows}] preempted={list(plan.preempted)}")
        if plan.num_steps > 1:
            event("multi-step plan")
        inv.check_plan(self.config, before, self.state, plan)
        for i, (rid, history) in enumerate(zip(plan.seq_ids, plan.histories, strict=True)):
            expected = i >= plan.num_continuing and uses_history(self.model.requests[rid].params)
            if (history is not None) != expected:
                inv.fail(
                    f"plan: {rid!r} carries history={history is not None}; expected only at admission with a penalty"
                )
        self.pending = plan
        _record_events(before, plan)
        return plan

    def _finish_pending(self, data: st.DataObject) -> None:
        if self.pending is not None:
            self._commit(data.draw(sampled_for(self.config, self.pending.num_samples), label="sampled"))
            self.check_all()

    def _commit(self, sampled: Sequence[int]) -> None:
        plan = self.pending
        assert plan is not None
        note(f"state, out = commit(state, plan, {list(sampled)})")
        inv.write_plan(self.kv, plan, sampled)
        self.state, output = inv.run_pure(self.commit, self.state, plan, list(sampled))
        self.pending = None
        expected = self.model.commit(plan, sampled)
        if output != expected:
            inv.fail(f"commit output {output} != model's {expected}")
        for f in output.finished:
            event(f"finished: {f.reason}")
            inv.check_finished(self.model.requests[f.request_id], f.output, f.reason, self.config.eos_token_ids)

    def run_to_completion(self) -> None:
        """Commit any pending plan, then step with a toy executor until nothing is live, within the bound."""
        toy = CounterToyExecutor(vocab_of(self.config))
        if self.pending is not None:
            self._commit(execute_steps(toy, self.pending).token_ids)
        live = [self.model.requests[r] for r in self.model.live]
        bound, steps = step_bound(live), 0
        while self.model.live:
            if steps >= bound:
                inv.fail(f"liveness: {self.model.live} unfinished after {bound} steps (bound from the workload)")
            self.check_all()
            plan = self._schedule()
            if plan.is_empty:
                inv.fail(f"liveness: nothing scheduled while {self.model.live} are unfinished (a stall)")
            self._commit(execute_steps(toy, plan).token_ids)
            steps += 1
        self.check_all()
        if self.state.requests or len(self.state.pool.ref_counts):
            inv.fail("liveness: nothing live, yet the state keeps requests or referenced blocks")

    # ----- drawing helpers -----

    def _add_one(self, data: st.DataObject) -> None:
        drawn = data.draw(requests(self.config, self.prefixes), label="request")
        rid = self._new_id(data)
        note(f"state = add_request(state, {rid!r}, {drawn.prompt}, {_brief(drawn.params)}, {drawn.priority})")
        self.state = inv.run_pure(core.add_request, self.state, rid, drawn.prompt, drawn.params, drawn.priority)
        self.model.add(self.state.requests[rid])
        expected = Request(rid, drawn.prompt, drawn.params, self.num_added, drawn.priority)
        self.num_added += 1
        if self.state.requests[rid] != expected:
            inv.fail(f"add_request stored {self.state.requests[rid]}, expected {expected}")

    def _new_id(self, data: st.DataObject) -> str:
        gone = sorted(set(self.model.finished) - set(self.model.live))
        if gone and data.draw(st.integers(0, 3), label="reuse id") == 0:
            event("request id reused")
            return data.draw(st.sampled_from(gone), label="reused id")
        self.next_id += 1
        return f"r{self.next_id - 1}"

    def _misuse_call(self, kind: str) -> Callable[[], object] | None:
        state, pending = self.state, self.pending
        if kind == "abort_unknown":
            return lambda: core.abort(state, "never-added")
        if kind == "commit_without_plan" and pending is None:
            return lambda: core.commit(state, StepPlan(step=state.step, block_size=self.config.block_size), [])
        if kind == "schedule_while_pending" and pending is not None:
            return lambda: core.schedule(state)
        if kind == "commit_wrong_count" and pending is not None:
            return lambda: core.commit(state, pending, [0] * (pending.num_samples + 1))
        return None


# The queue orders the built-in policies promise, written out independently of their key functions.
_REFERENCE_ORDER: dict[str, Callable[[Request], tuple[int, ...]]] = {
    "fcfs": lambda r: (r.arrival,),
    "priority": lambda r: (r.priority, r.arrival),
}


def _record_events(before: EngineState, plan: StepPlan) -> None:
    """Tell Hypothesis's statistics which interesting situations this run reached."""
    if plan.preempted:
        event("preemption")
    if plan.num_tokens == before.config.max_num_batched_tokens:
        event("budget full")
    for rid, start, sample in zip(plan.seq_ids, plan.start_positions, plan.sample, strict=True):
        if rid not in before.num_computed and start > 0:
            event("prefix-cache hit")
        if not sample:
            event("chunked prefill")


def _brief(params: SamplingParams) -> str:
    """SamplingParams showing only the fields the core reads."""
    return (
        f"SamplingParams(max_tokens={params.max_tokens}, min_tokens={params.min_tokens}, "
        f"ignore_eos={params.ignore_eos}, stop_token_ids={params.stop_token_ids})"
    )

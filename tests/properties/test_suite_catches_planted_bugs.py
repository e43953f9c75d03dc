"""The property suite bites: each test plants one realistic bug and checks that Hypothesis finds a failure.

Bugs are planted through the machine's hooks (a subclass wrapping ``schedule``) or by monkeypatching one
PoolTxn method. Each hunt is derandomized (deterministic) and skips shrinking, so it stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import fnvllm.state as core
from fnvllm.state import CoreConfig, EngineState, StepPlan
from fnvllm.state._running import DecodePrefix, RunningRows
from fnvllm.state.hashing import BlockHasher, hash_block_xxh3
from fnvllm.state.pool import PoolTxn
from fnvllm.state.state import insert_by_policy
from fnvllm.testing.drive import RequestSpec, run_to_completion
from fnvllm.testing.invariants import InvariantViolation, ShadowKV, check_kv, check_plan, write_plan
from fnvllm.testing.machine import CoreStateMachine
from fnvllm.testing.strategies import RequestDraw, core_configs, workloads
from fnvllm.testing.toy import KVToyExecutor

HUNT = settings(
    max_examples=400,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)


# Tiny pools and several sequences: preemption in about 40% of runs (against about 30% by default).
PRESSURE = core_configs(max_num_blocks=6, max_budget=8, min_num_seqs=2)
CACHING = core_configs(enable_prefix_caching=st.just(True))


class UnderPressure(CoreStateMachine):
    """The default machine on configs that preempt often."""

    configs = PRESSURE


class WithCaching(CoreStateMachine):
    """The default machine with prefix caching always on."""

    configs = CACHING


def hunt(machine: type[CoreStateMachine], match: str) -> None:
    """Run ``machine`` until Hypothesis finds an invariant violation whose message matches ``match``."""
    with pytest.raises(InvariantViolation, match=match):
        run_state_machine_as_test(machine, settings=HUNT)


def constant_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Every block of every sequence collides."""
    return 7


def tokens_only_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Ignores the parent: equal blocks collide whatever precedes them."""
    return hash_block_xxh3(None, tokens)


def unguarded_lookup(self: PoolTxn, block_hash: int, parent_block: int | None, tokens: Sequence[int]) -> int | None:
    """Trusts the hash alone (no parent/token comparison)."""
    return self._hashes.get(block_hash)


# ----- (a) refcount leak in the pool -----


@pytest.mark.parametrize("which", ["shared blocks", "first block"])
def test_release_that_skips_a_decref_is_caught(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """A release that forgets to drop a reference (of shared blocks, or of a table's first block) leaks blocks,
    which the ref-count / conservation invariants report."""
    release = PoolTxn.release

    def leaky(self: PoolTxn, blocks: Sequence[int]) -> None:
        keep = [b for b in blocks if self.ref_count(b) == 1] if which == "shared blocks" else list(blocks[1:])
        release(self, keep)

    monkeypatch.setattr(PoolTxn, "release", leaky)
    hunt(WithCaching, "ref count|conservation")


# ----- (b) hash collisions -----


@pytest.mark.parametrize("hasher", [constant_hash, tokens_only_hash])
def test_colliding_hash_without_guard_is_caught(monkeypatch: pytest.MonkeyPatch, hasher: BlockHasher) -> None:
    """A colliding hasher plus a lookup without the token/parent guard reuses wrong blocks; the KV and
    prefix-cache invariants report it."""
    monkeypatch.setattr(PoolTxn, "lookup", unguarded_lookup)

    class Colliding(WithCaching):
        def block_hasher(self) -> BlockHasher:
            return hasher

    hunt(Colliding, "KV|prefix cache")


def run_kv_toy(config: CoreConfig, work: list[RequestDraw]) -> dict[str, tuple[int, ...]]:
    """Outputs of ``work`` under ``config`` on the paged-KV toy executor."""
    # (the ignore: attrs' mypy plugin types a ``converter=tuple`` field's argument as an unbound Iterable)
    specs = [RequestSpec(f"r{i}", w.prompt, w.params, w.priority) for i, w in enumerate(work)]  # type: ignore[arg-type]
    return run_to_completion(config, specs, KVToyExecutor(vocab_size=config.vocab_size or 32)).outputs


def same_outputs_as_without_cache(hasher: BlockHasher) -> Callable[[], None]:
    """A Hypothesis test: with ``hasher`` and caching on, KV-toy outputs equal those of a no-cache run."""

    @settings(
        max_examples=150,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        config = data.draw(core_configs(enable_prefix_caching=st.just(True), hashers=st.just(hasher)))
        work = data.draw(workloads(config, min_size=2, max_size=6))
        assert run_kv_toy(config, work) == run_kv_toy(attrs.evolve(config, enable_prefix_caching=False), work)

    return check


def test_colliding_hash_without_guard_changes_kv_toy_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the guard, a constant hasher makes the paged-KV toy's outputs differ from a no-cache run."""
    monkeypatch.setattr(PoolTxn, "lookup", unguarded_lookup)
    with pytest.raises((AssertionError, RuntimeError)):
        same_outputs_as_without_cache(constant_hash)()


def test_constant_hash_with_guard_is_harmless() -> None:
    """With the guard, a constant hasher (every block collides) leaves outputs identical to a no-cache run."""
    same_outputs_as_without_cache(constant_hash)()


def test_parent_ignoring_hash_with_guard_never_reuses_another_context() -> None:
    """With the guard, even a hasher that ignores the parent never reuses a block computed after another prefix:
    r1 registers its block [1, 2] (context [7, 7, 9, 9]) as the child of its own [9, 9] block's registration;
    r2 = [8, 8, 9, 9, 1, 2] hits r0's [9, 9] block there, a different registration, so the guard refuses the
    block although its hash, its parent's hash and its tokens all match."""
    config = CoreConfig(block_size=2, num_blocks=16, max_num_batched_tokens=64, hash_block=tokens_only_hash)
    state, kv = core.initial_state(config), ShadowKV()
    for rid, prompt in (("r0", (8, 8, 9, 9)), ("r1", (7, 7, 9, 9, 1, 2)), ("r2", (8, 8, 9, 9, 1, 2))):
        state = core.add_request(state, rid, prompt, core.SamplingParams(max_tokens=1))
        while state.has_unfinished:
            state, plan = core.schedule(state)
            write_plan(kv, plan)
            check_kv(state, kv)
            state, _ = core.commit(state, plan, [0] * plan.num_samples)


# ----- (c) budget and cap overshoot -----


class OvershootingBudget(CoreStateMachine):
    """Schedules with a token budget one larger than the config's."""

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        relaxed = attrs.evolve(state.config, max_num_batched_tokens=state.config.max_num_batched_tokens + 1)
        new, plan = core.schedule(attrs.evolve(state, config=relaxed))
        return attrs.evolve(new, config=state.config), plan


class OvershootingSeqs(CoreStateMachine):
    """Schedules with room for one more running sequence than the config allows."""

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        relaxed = attrs.evolve(state.config, max_num_seqs=state.config.max_num_seqs + 1)
        new, plan = core.schedule(attrs.evolve(state, config=relaxed))
        return attrs.evolve(new, config=state.config), plan


def test_budget_overshoot_is_caught() -> None:
    """A scheduler that feeds one token more than max_num_batched_tokens is reported by the budget check."""
    hunt(OvershootingBudget, "budget")


def test_max_num_seqs_overshoot_is_caught() -> None:
    """A scheduler that runs one sequence more than max_num_seqs is reported by the cap check."""
    hunt(OvershootingSeqs, "max_num_seqs")


# ----- (d) preemption bugs -----


class DropsTokenOnPreemption(UnderPressure):
    """Preemption rolls a victim back to its computed tokens, losing the sampled token that had no KV yet.

    Planted with public transitions only (abort, then re-add the victim with what it kept folded into its
    prompt), so it does not depend on how the state stores outputs.
    """

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        new, plan = core.schedule(state)
        for victim in plan.preempted:
            view = new.sequence(victim)
            kept = view.output[: max(state.num_computed[victim] - len(view.request.prompt), 0)]
            if kept != view.output:
                was = view.request.params
                params = attrs.evolve(
                    was, max_tokens=was.max_tokens - len(kept), min_tokens=max(0, was.min_tokens - len(kept))
                )
                new = core.abort(new, victim)
                new = core.add_request(new, victim, view.request.prompt + kept, params, view.request.priority)
        return new, plan


class KeepsPreemptedBlocks(UnderPressure):
    """Preemption forgets to release the victim's blocks (they stay referenced by nobody)."""

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        new, plan = core.schedule(state)
        txn = new.pool.txn()
        for victim in plan.preempted:
            for block in state.block_tables[victim]:
                txn.share(block)
        return attrs.evolve(new, pool=txn.freeze()), plan


def test_token_dropped_on_preemption_is_caught() -> None:
    """Losing a preempted sequence's last sampled token is reported (preemption check / naive model)."""
    hunt(DropsTokenOnPreemption, "lost tokens|tokens of")


def test_blocks_kept_on_preemption_are_caught() -> None:
    """Not releasing a preempted sequence's blocks is reported by the ref-count / conservation invariants."""
    hunt(KeepsPreemptedBlocks, "ref count|conservation")


# ----- (e) starvation -----


class NeverChunksAPrompt(CoreStateMachine):
    """An admission policy that waits until a whole prompt fits one step's budget: long prompts never run."""

    def schedule(self, state: EngineState) -> tuple[EngineState, StepPlan]:
        budget = state.config.max_num_batched_tokens
        starved = [r for r in state.waiting if state.num_tokens[r] > budget]
        visible = tuple(r for r in state.waiting if r not in starved)
        new, plan = core.schedule(attrs.evolve(state, waiting=visible))
        waiting = new.waiting
        for rid in starved:
            waiting = insert_by_policy(new, waiting, rid)
        return attrs.evolve(new, waiting=waiting), plan


def test_starving_policy_is_caught() -> None:
    """A policy that never admits prompts longer than the budget is reported by the liveness check."""
    hunt(NeverChunksAPrompt, "liveness")


# ----- (f) derived state out of step with the primary fields -----


def drop_without_recount(self: RunningRows, indices: Sequence[int]) -> RunningRows:
    """Drops the rows but keeps the count of rows needing token histories (a cached counter left stale)."""
    dropped = DROP_ROWS(self, indices)
    return attrs.evolve(dropped, num_needing_history=self.num_needing_history)


def drop_without_shifting(self: DecodePrefix, indices: Sequence[int]) -> DecodePrefix:
    """Drops the rows but leaves the indices of the full-table rows after them unshifted."""
    kept = [i for i in range(len(self.inputs)) if i not in indices]
    due = tuple(i for i in self.block_due if i not in indices and i < len(kept))
    inputs, phases = tuple(self.inputs[i] for i in kept), bytes(self.phases[i] for i in kept)
    return DecodePrefix(inputs, due, self.steps_to_limit, phases)


DROP_ROWS = RunningRows.drop


@pytest.mark.parametrize(
    ("owner", "stale_drop"),
    [(RunningRows, drop_without_recount), (DecodePrefix, drop_without_shifting)],
    ids=["stale history count", "unshifted block_due"],
)
def test_stale_derived_state_is_caught(
    monkeypatch: pytest.MonkeyPatch, owner: type, stale_drop: Callable[..., object]
) -> None:
    """A derived field that a transition leaves stale (a counter not recounted when rows leave, indices not
    shifted) is reported by the derived-state invariant, which recomputes every cached field from the primary
    ones; the first bug changes no output, so no other invariant could see it."""
    monkeypatch.setattr(owner, "drop", stale_drop)
    hunt(CoreStateMachine, "derived")


# ----- slots -----


def _slot_after_the_last(self: object) -> int:
    """Hands out one past the running rows' count: collides once a row that was not last has left."""
    step = self  # a scheduler._Step
    return len(step.rows.ids) + len(step.admitted)  # type: ignore[attr-defined]


def _slot_never_reused(self: object) -> int:
    """Hands out ever-growing slots (never reusing a freed one): past max_num_seqs sooner or later."""
    step = self
    return len(step.state.requests) + step.state.next_arrival  # type: ignore[attr-defined]


@pytest.mark.parametrize("planted", [_slot_after_the_last, _slot_never_reused])
def test_wrong_slot_allocation_is_caught(monkeypatch: pytest.MonkeyPatch, planted: Callable[..., int]) -> None:
    """A scheduler that gives two running requests one slot, or a slot outside [0, max_num_seqs), is caught."""
    from fnvllm.state import scheduler

    monkeypatch.setattr(scheduler._Step, "take_slot", planted)
    hunt(UnderPressure, "slots")


# ----- a chunk that completes a block begun in an earlier step, not marked as being computed -----


def mid_block_scenario(block_size: int) -> None:
    """Two prompts sharing two blocks; a budget of 1.5 blocks, so the first prompt's second chunk starts inside
    block 1 and completes it while the second prompt is admitted: every plan goes through ``check_plan``, and the
    second must hit the first's block 1, never compute its own copy."""
    budget = block_size + block_size // 2
    config = CoreConfig(
        block_size=block_size, num_blocks=12, max_num_batched_tokens=budget, max_model_len=8 * block_size, vocab_size=64
    )
    prefix = list(range(1, 2 * block_size + 1))
    tables = run_checked(config, {"x": [*prefix, 40], "y": [*prefix, 41]})
    assert tables["y"][:2] == tables["x"][:2]  # the shared prefix computed once, then hit


def run_checked(config: CoreConfig, prompts: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    """Run ``prompts`` (added in order, 2 tokens each) to the end, every plan through ``check_plan``; returns
    each request's last block table."""
    state = core.initial_state(config)
    params = core.SamplingParams(max_tokens=2, ignore_eos=True)
    for rid, prompt in prompts.items():
        state = core.add_request(state, rid, prompt, params)
    tables: dict[str, tuple[int, ...]] = {}
    while state.has_unfinished:
        before = state
        state, plan = core.schedule(state)
        check_plan(config, before, state, plan)
        tables.update(zip(plan.seq_ids, plan.block_tables, strict=True))
        state, _ = core.commit(state, plan, [9] * sum(plan.sample))
    return tables


@pytest.mark.parametrize("block_size", [2, 4, 6])
def test_a_block_completed_mid_chunk_is_computed_once(block_size: int) -> None:
    mid_block_scenario(block_size)


@pytest.mark.parametrize("block_size", [2, 4, 6])
def test_unmarked_mid_block_completion_is_caught(monkeypatch: pytest.MonkeyPatch, block_size: int) -> None:
    """With ``note_computing`` marking only the blocks a chunk both starts and completes (the bug: a running
    request finishing a block it began a step earlier left it unmarked), the request admitted in that step computes
    the same prefix block a second time, and the duplicate-prefill check names it."""
    from fnvllm.state.kv import KVManager

    def start_aligned_only(self: KVManager, prompt, output, tail, chain, start: int, end: int):  # type: ignore[no-untyped-def]
        marked = original(self, prompt, output, tail, chain, start, end)
        bs = self.block_size
        if self.caching and start % bs and start // bs < end // bs:  # un-mark the block it completes, not starts
            self._pending.discard(marked[start // bs])
        return marked

    original = KVManager.note_computing
    monkeypatch.setattr(KVManager, "note_computing", start_aligned_only)
    with pytest.raises(InvariantViolation, match=r"prefix cache: 'y', admitted in step 1, computes block 1 .* 'x'"):
        mid_block_scenario(block_size)


def last_token_scenario(block_size: int) -> None:
    """A prompt of exactly two blocks whose last token runs alone (a budget of two blocks less one token), in the
    step that admits a second prompt sharing both blocks: the second must wait for the first's block 1 and hit it,
    never compute its own copy (every plan goes through ``check_plan``)."""
    config = CoreConfig(
        block_size=block_size, num_blocks=12, max_num_batched_tokens=2 * block_size - 1,
        max_model_len=8 * block_size, vocab_size=64,
    )  # fmt: skip
    prefix = list(range(1, 2 * block_size + 1))
    tables = run_checked(config, {"x": prefix, "y": [*prefix, 41]})
    assert tables["y"][:2] == tables["x"][:2]  # the shared prefix computed once, then hit


@pytest.mark.parametrize("block_size", [2, 4, 6])
def test_a_block_completed_by_a_prompts_last_token_is_computed_once(block_size: int) -> None:
    last_token_scenario(block_size)

"""Overlapped stepping (fnvllm.state.overlap, EngineLoop with an overlapping executor) gives plain stepping's
outputs.

The executor is ``KVToyExecutor(overlap=True)``: a launch runs at once, so a speculative step writes its K/V
before the step it follows is committed (as on a GPU), and a sampled token is a hash of the context read back
through the block table. A speculative step that wrote into a block the prefix cache still offers, a kept plan
whose blocks differ from what ran, or a placeholder token that reached the cache would change some output.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import fnvllm.engine.core as core_module
import fnvllm.engine.loop as loop_module
import fnvllm.state.overlap as overlap_module
from fnvllm.engine.core import Engine, EngineOutput
from fnvllm.engine.loop import EngineLoop, OverlapStats
from fnvllm.state import CoreConfig, EngineState, FinishedRequest, SamplingParams, StepPlan
from fnvllm.state.overlap import (
    Folded,
    Reconciled,
    Speculation,
    can_feed,
    fold_speculation,
    forget_written_blocks,
    placeholder_token,
    reconcile,
    speculate,
)
from fnvllm.testing import invariants
from fnvllm.testing.strategies import RequestDraw, core_configs, workloads
from fnvllm.testing.toy import KVToyExecutor

Arrival = tuple[int, str, RequestDraw]


def _check_state(state: EngineState) -> None:
    for check in (
        invariants.check_blocks_conserved,
        invariants.check_ref_counts,
        invariants.check_queues,
        invariants.check_lengths,
        invariants.check_prefix_cache,
        invariants.check_derived,
    ):
        check(state)


def _run(
    config: CoreConfig,
    arrivals: Sequence[Arrival],
    aborts: Sequence[tuple[int, str]] = (),
    overlap: bool = True,
    max_steps: int = 2_000,
) -> tuple[dict[str, FinishedRequest], EngineLoop]:
    """Drive an EngineLoop: add each request before the step call of its index, abort likewise; check the
    state's invariants after every step. Returns the finished requests and the loop."""
    vocab = config.vocab_size or 32
    executor = KVToyExecutor(vocab, overlap=overlap, shadow=True)
    loop = EngineLoop(Engine(executor, config))
    assert loop.overlap is overlap
    finished: dict[str, FinishedRequest] = {}

    def record(state: EngineState, plan: StepPlan, out: EngineOutput) -> None:
        finished.update((f.request_id, f) for f in out.output.finished)

    loop.on_step = record
    calls = 0
    waiting_adds, waiting_aborts = sorted(arrivals, key=lambda a: a[0]), sorted(aborts)
    while waiting_adds or waiting_aborts or loop.has_unfinished:
        while waiting_adds and waiting_adds[0][0] <= calls:
            _, rid, draw = waiting_adds.pop(0)
            loop.add(rid, draw.prompt, draw.params, priority=draw.priority)
        while waiting_aborts and waiting_aborts[0][0] <= calls:
            loop.abort(waiting_aborts.pop(0)[1])
        if loop.has_unfinished:
            loop.step()
            _check_state(loop.state)
            _check_kv(loop, executor)
        calls += 1
        assert calls < max_steps, "the loop did not finish"
    assert loop.state.pool.num_free == config.num_blocks
    return finished, loop


def _check_kv(loop: EngineLoop, executor: KVToyExecutor) -> None:
    """The stale-KV oracle: every computed position of a running sequence and every block the prefix cache
    offers holds K/V of exactly the tokens the state claims (a block written by a dropped or ended speculative
    row and still registered fails here at once, before any later request hits it)."""
    assert executor.shadow is not None
    invariants.check_kv(loop.state, executor.shadow)


@st.composite
def _scenarios(
    draw: st.DrawFn, with_aborts: bool, reuse: bool = False
) -> tuple[CoreConfig, list[Arrival], list[tuple[int, str]]]:
    """A config, requests with arrival calls, and aborts. ``reuse``: prefix caching on, blocks of 1-2 tokens and a
    vocabulary of 4-6 ids (so EOS is sampled often, and a row that ends has often just been given a new block),
    arrivals spread out (so later prompts hit blocks that earlier ones left cached and free)."""
    if reuse:
        config = draw(
            core_configs(
                max_block_size=2,
                max_num_blocks=24,
                max_model_len=32,
                max_vocab_size=6,
                enable_prefix_caching=st.just(True),
            )
        )
    else:
        config = draw(core_configs(max_num_seqs=6, max_num_blocks=32, max_model_len=48))
    work = draw(workloads(config, max_size=7))
    if reuse:  # speculation is off while a row needs its token history: keep the stale-KV cases frequent
        work = list(map(_without_penalties, work))
    arrivals = [(draw(st.integers(0, 30 if reuse else 8)), f"r{i}", request) for i, request in enumerate(work)]
    aborts = []
    if with_aborts:
        ids = [rid for _, rid, _ in arrivals]
        aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(ids)), max_size=3))
    return config, arrivals, aborts


@settings(deadline=None)
@given(scenario=st.one_of(_scenarios(with_aborts=False), _scenarios(with_aborts=False, reuse=True)))
def test_overlapped_outputs_equal_plain(scenario: tuple[CoreConfig, list[Arrival], list[tuple[int, str]]]) -> None:
    """Every request finishes with the same tokens and reason as under plain stepping."""
    config, arrivals, _ = scenario
    expected, _ = _run(config, arrivals, overlap=False)
    actual, loop = _run(config, arrivals)
    assert {rid: (f.reason, f.output) for rid, f in actual.items()} == {
        rid: (f.reason, f.output) for rid, f in expected.items()
    }
    stats = loop.overlap_stats
    assert stats.launched == stats.kept + stats.dropped


@settings(deadline=None)
@given(scenario=_scenarios(with_aborts=True))
def test_overlapped_aborts_leave_other_outputs_alone(
    scenario: tuple[CoreConfig, list[Arrival], list[tuple[int, str]]],
) -> None:
    """Aborts at any point, in flight included, free every block and change no other request's output."""
    config, arrivals, aborts = scenario
    expected, _ = _run(config, arrivals, overlap=False)
    actual, _ = _run(config, arrivals, aborts)
    aborted = {rid for _, rid in aborts}
    for rid, f in actual.items():
        assert (f.reason, f.output) == (expected[rid].reason, expected[rid].output)
    assert set(expected) - aborted <= set(actual)


def _decoding(config: CoreConfig, n: int, max_tokens: int = 30) -> list[Arrival]:
    return [
        (0, f"d{i}", RequestDraw((i + 1, 2, 3), SamplingParams(max_tokens=max_tokens, ignore_eos=i != 1)))
        for i in range(n)
    ]


Verdict = tuple[Speculation, Reconciled]


def _run_spying(config: CoreConfig, arrivals: list[Arrival]) -> tuple[list[Verdict], OverlapStats]:
    """The overlapped run, checked equal to the plain one: every speculation the loop reconciled with its
    verdict, and the loop's overlap counts."""
    expected, _ = _run(config, arrivals, overlap=False)
    verdicts: list[Verdict] = []

    def spy(committed: EngineState, speculation: Speculation) -> Reconciled:
        verdict = reconcile(committed, speculation)
        verdicts.append((speculation, verdict))
        return verdict

    def spy_fold(state: EngineState, plan: StepPlan, speculation: Speculation, sampled: Sequence[int]) -> Folded | None:
        folded = fold_speculation(state, plan, speculation, sampled)
        if folded is not None:  # kept whole: the speculative plan with the real tokens
            verdicts.append((speculation, Reconciled(True, folded.state, folded.plan, (True,) * folded.plan.num_seqs)))
        return folded

    loop_module.reconcile = spy  # type: ignore[assignment]
    core_module.fold_speculation = spy_fold  # type: ignore[assignment]
    try:
        actual, loop = _run(config, arrivals)
    finally:
        loop_module.reconcile = reconcile
        core_module.fold_speculation = fold_speculation
    assert {r: (f.reason, f.output) for r, f in actual.items()} == {
        r: (f.reason, f.output) for r, f in expected.items()
    }
    return verdicts, loop.overlap_stats


def _trimmed(verdicts: list[Verdict]) -> list[bool]:
    """Per speculative step: kept with some rows trimmed (they ended at the step before)."""
    return [verdict.kept and not all(verdict.keep) for _, verdict in verdicts]


def test_speculation_kept_and_trimmed() -> None:
    """A decode batch keeps its speculative steps, and a row that samples EOS is trimmed from a kept one."""
    config = CoreConfig(
        block_size=64, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8, eos_token_ids={5}, vocab_size=12
    )
    verdicts, stats = _run_spying(config, _decoding(config, 4))
    assert stats.kept > 20 and stats.dropped == 0
    assert any(_trimmed(verdicts)), "d1's EOS should have been trimmed from a kept speculative step"


def test_speculation_dropped_when_a_waiting_request_gets_in() -> None:
    """With max_num_seqs full, d1's EOS lets the waiting request in: the real plan admits it, which the
    speculative plan could not know, so that speculative step is dropped."""
    config = CoreConfig(
        block_size=64, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4, eos_token_ids={5}, vocab_size=12
    )
    late = (0, "late", RequestDraw((9, 9, 9, 9), SamplingParams(max_tokens=4, ignore_eos=True)))
    _, stats = _run_spying(config, [*_decoding(config, 4), late])
    assert stats.kept > 10 and stats.dropped >= 1


def test_placeholder_avoids_every_stop_id() -> None:
    config = CoreConfig(block_size=4, num_blocks=8, eos_token_ids={0, 1}, vocab_size=4)
    loop = EngineLoop(Engine(KVToyExecutor(4), config), overlap=False)
    loop.add("a", (3, 3), SamplingParams(max_tokens=2, stop_token_ids=(2,)))
    assert placeholder_token(loop.state) == 3
    loop.add("b", (3, 3), SamplingParams(max_tokens=2, stop_token_ids=(3,)))
    assert placeholder_token(loop.state) is None


def test_can_feed_needs_sampled_one_token_rows() -> None:
    config = CoreConfig(block_size=4, num_blocks=16, max_num_batched_tokens=3, vocab_size=16)
    loop = EngineLoop(Engine(KVToyExecutor(16), config), overlap=False)
    loop.add("a", (1, 2, 3, 4, 5), SamplingParams(max_tokens=4))
    from fnvllm.state import schedule

    state, first = schedule(loop.state)  # a 3-token chunk of "a": samples nothing
    assert not first.sample[0]
    after_first = speculate(state, first)  # the rest of the prompt: host tokens only, nothing to feed
    assert after_first is not None and after_first.fed == (False,) and after_first.plan.input_tokens == ((4, 5),)
    loop.step()  # the chunk
    state, second = schedule(loop.state)  # the rest of the prompt, then a sample
    spec = speculate(state, second)
    assert spec is not None and spec.plan.seq_ids == ("a",) and spec.fed == (True,) and can_feed(second, spec.plan)
    assert not can_feed(spec.plan, second), "a row the device feeds cannot feed two tokens"


def test_dead_row_block_leaves_the_prefix_cache() -> None:
    """A row ends (EOS) while the speculative step after it has just handed it a fresh block, one the prefix
    cache still offers: the speculative run writes into that block, so the block must leave the cache, or the
    next request with that prefix reads K/V written for another position.

    Block size 2, four blocks. "seed" (prompt 1..7) leaves [1, 2], [3, 4] and [5, 6] cached and free, [5, 6]'s
    block second in the free queue. "d" (prompt 7) takes the first free block, and its third token (position 2)
    needs the next one: [5, 6]'s. EOS is d's second sampled token, so d ends exactly when the speculative step
    that feeds that token has taken the block. "again" (prompt 1..7) then looks the prompt up in the cache."""
    seed = RequestDraw(tuple(range(1, 8)), SamplingParams(max_tokens=1, ignore_eos=True))
    probe = RequestDraw((7,), SamplingParams(max_tokens=4, ignore_eos=True))
    config = CoreConfig(block_size=2, num_blocks=4, max_model_len=8, vocab_size=16)
    alone, _ = _run(config, [(0, "d", probe)], overlap=False)
    first, second = alone["d"].output[:2]
    assert first != second, "d must outlive its first token (pick another vocab_size if the toy changes)"
    config = attrs.evolve(config, eos_token_ids=frozenset({second}))
    d = RequestDraw((7,), SamplingParams(max_tokens=4))
    arrivals = [(0, "seed", seed), (4, "d", d), (12, "again", seed)]
    expected, _ = _run(config, arrivals, overlap=False)
    assert expected["d"].output == (first, second) and expected["d"].reason == "stop"
    actual, loop = _run(config, arrivals)
    assert {r: f.output for r, f in actual.items()} == {r: f.output for r, f in expected.items()}
    assert loop.overlap_stats.launched >= 1


def test_mixed_steps_are_speculated_and_kept() -> None:
    """Prompts admitted chunk by chunk while earlier ones decode: the speculative mixed steps (prompt chunks from
    the host, decodes fed from the device, new admissions) are the real plans, so none is dropped; the prompt
    tokens the prefix cache served to admissions inside them are counted as in plain stepping."""
    config = CoreConfig(block_size=16, num_blocks=64, max_num_batched_tokens=48, max_num_seqs=8, vocab_size=50)
    shared = tuple(range(3, 19))  # one full block that every prompt starts with
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    arrivals = [
        (0, f"p{i}", RequestDraw(shared + tuple((7 * i + j) % 50 for j in range(14)), params)) for i in range(8)
    ]
    _, plain = _run(config, arrivals, overlap=False)
    verdicts, stats = _run_spying(config, arrivals)
    mixed = [any(len(t) > 1 for t in spec.plan.input_tokens) and verdict.kept for spec, verdict in verdicts]
    assert stats.dropped == 0 and sum(mixed) >= 3, (stats, mixed)
    _, overlapped = _run(config, arrivals)
    assert overlapped.stats.num_cached_tokens == plain.stats.num_cached_tokens > 0


# ----- request ids reused while a step is in flight -----

IDS = ("a", "b", "c")


@attrs.frozen
class Event:
    """At loop call ``call``: add a new life of ``rid`` (skipped while ``rid`` is live), abort ``rid`` (skipped
    unless live), or "reuse": abort ``rid`` if live and add the new life at once. ``in_hook`` runs it inside the
    ``on_step`` hook, after the step's commit with the next step already launched, instead of between calls."""

    call: int
    kind: str
    rid: str
    draw: RequestDraw | None
    in_hook: bool


@st.composite
def _reuse_scenarios(draw: st.DrawFn) -> tuple[CoreConfig, list[Event], bool]:
    """Three ids added, aborted and reused at every point of the loop; with ``reuse_at_finish`` an id that
    finished is re-added inside the very hook that saw it finish (the next step already in flight)."""
    config = draw(core_configs(max_block_size=2, max_num_blocks=24, max_model_len=24, max_vocab_size=8, max_num_seqs=3))
    work = draw(workloads(config, min_size=4, max_size=10))
    events = []
    for request in map(_without_penalties, work):
        kind = draw(st.sampled_from(["add", "add", "reuse"]))
        events.append(Event(draw(st.integers(0, 12)), kind, draw(st.sampled_from(IDS)), request, draw(st.booleans())))
    aborts = draw(st.lists(st.tuples(st.integers(0, 12), st.sampled_from(IDS), st.booleans()), max_size=3))
    events += [Event(call, "abort", rid, None, hook) for call, rid, hook in aborts]
    return config, sorted(events, key=lambda e: e.call), draw(st.booleans())


def _without_penalties(request: RequestDraw) -> RequestDraw:
    """The request with its penalties off: a row that needs its token history is never speculated on today,
    and the drawn params would otherwise hold one in nearly every scenario."""
    params = attrs.evolve(request.params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    return attrs.evolve(request, params=params)


def _alone(config: CoreConfig, request: RequestDraw) -> tuple[str, tuple[int, ...]]:
    """The finish reason and tokens of ``request`` run alone, plainly, on a fresh toy."""
    finished, _ = _run(config, [(0, "solo", request)], overlap=False)
    return finished["solo"].reason, finished["solo"].output


def _run_reusing(config: CoreConfig, events: list[Event], reuse_at_finish: bool) -> list[tuple[RequestDraw, object]]:
    """Drive an overlapped loop through ``events``; returns each request life with its result: the finished
    record's (reason, output), or "aborted"."""
    executor = KVToyExecutor(config.vocab_size or 32, overlap=True, shadow=True)
    loop = EngineLoop(Engine(executor, config))
    lives: dict[str, int] = {}  # rid -> index in results of its live request
    results: list[list[object]] = []
    pending = list(events)
    spares = [e.draw for e in events if e.draw is not None]

    def apply(event: Event) -> None:
        live = event.rid in loop.state.requests
        if event.kind == "reuse" and live:
            apply(Event(event.call, "abort", event.rid, None, event.in_hook))
            live = False
        if event.kind != "abort" and not live and event.draw is not None:
            loop.add(event.rid, event.draw.prompt, event.draw.params)
            lives[event.rid] = len(results)
            results.append([event.draw, None])
        elif event.kind == "abort" and live:
            loop.abort(event.rid)
            results[lives.pop(event.rid)][1] = "aborted"

    def hook(state: EngineState, plan: StepPlan, out: EngineOutput) -> None:
        for f in out.output.finished:
            results[lives.pop(f.request_id)][1] = (f.reason, f.output)
            if reuse_at_finish and spares:  # the id is reused at once, while the next step is in flight
                apply(Event(0, "add", f.request_id, spares.pop(), True))
        while pending and pending[0].in_hook and pending[0].call <= calls:
            apply(pending.pop(0))

    loop.on_step = hook
    calls = 0
    while pending or loop.has_unfinished:
        while pending and pending[0].call <= calls:
            apply(pending.pop(0))
        if loop.has_unfinished:
            loop.step()
            _check_state(loop.state)
            _check_kv(loop, executor)
        calls += 1
        assert calls < 2_000, "the loop did not finish"
    assert loop.state.pool.num_free == config.num_blocks
    return [(draw, result) for draw, result in results]  # type: ignore[misc]


@settings(deadline=None)
@given(scenario=_reuse_scenarios())
def test_reused_ids_get_their_own_tokens(scenario: tuple[CoreConfig, list[Event], bool]) -> None:
    """Ids aborted or finished and reused at once, between steps or inside the hook of a step whose successor is
    already in flight: every request life gets exactly the tokens it gets when run alone, and the KV the state
    claims is what the device holds after every step."""
    config, events, reuse_at_finish = scenario
    for draw, result in _run_reusing(config, events, reuse_at_finish):
        assert result is not None, "a request life neither finished nor was aborted"
        if result != "aborted":
            assert result == _alone(config, draw)


def test_reused_id_after_abort_is_not_fed_the_old_token() -> None:
    """The issue's case: "a" and "b" run two overlapped steps, "a" is aborted and its id reused with a 1-token
    prompt while a step is in flight; the new "a" gets its own tokens, not the old "a"'s sample."""
    config = CoreConfig(block_size=4, num_blocks=64, vocab_size=200)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    new = RequestDraw((77,), SamplingParams(max_tokens=5, ignore_eos=True))
    events = [Event(0, "add", "a", RequestDraw((1, 2, 3), params), False)]
    events += [Event(0, "add", "b", RequestDraw((4, 5, 6), params), False)]
    events += [Event(2, "reuse", "a", new, False)]
    results = _run_reusing(config, events, reuse_at_finish=False)
    assert results[2] == (new, _alone(config, new))


# ----- planted bugs: the stale-KV oracle kills both reconcile mutants -----

HUNT = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
)


def _keeps_ended_rows_registered(
    state: EngineState, plan: StepPlan, rows: tuple[bool, ...] | None = None
) -> EngineState:
    """Mutant: a kept speculative run does not unregister the free blocks its ended rows wrote."""
    return state if rows is not None else forget_written_blocks(state, plan)


def _drop_keeps_registrations(state: EngineState, plan: StepPlan, rows: tuple[bool, ...] | None = None) -> EngineState:
    """Mutant: a dropped speculative run leaves the blocks it wrote registered."""
    return forget_written_blocks(state, plan, rows) if rows is not None else state


@pytest.mark.parametrize("mutant", [_keeps_ended_rows_registered, _drop_keeps_registrations])
def test_stale_kv_oracle_kills_reconcile_mutants(mutant: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """With either mutation of ``reconcile``'s bookkeeping planted, the overlapped workloads of this module find a
    block whose KV is not what the prefix cache claims."""
    monkeypatch.setattr(overlap_module, "forget_written_blocks", mutant)

    @HUNT
    @given(scenario=_scenarios(with_aborts=True, reuse=True))
    def hunt(scenario: tuple[CoreConfig, list[Arrival], list[tuple[int, str]]]) -> None:
        config, arrivals, aborts = scenario
        _run(config, arrivals, aborts)

    with pytest.raises((invariants.InvariantViolation, AssertionError)):
        hunt()

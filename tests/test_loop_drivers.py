"""Drivers that run a step's calls by hand (profilers, timers) go through ``EngineLoop.drain`` and
``EngineLoop.adopt`` and get exactly the tokens, metrics and stats of ``step``; a hand-run step that does not
continue the loop's state is refused with nothing changed.

The KV-reading toy executor makes a request's tokens a hash of its context, so a lost or misrouted token shows.
"""

from __future__ import annotations

import pytest

from fnvllm.engine.core import Engine
from fnvllm.engine.loop import EngineLoop
from fnvllm.engine.output import RequestTracker
from fnvllm.state import CoreConfig, PlanMismatchError, SamplingParams, schedule
from fnvllm.testing.toy import KVToyExecutor

CONFIG = CoreConfig(block_size=4, num_blocks=64, max_num_seqs=3, vocab_size=256)
PROMPTS = [(5, 6, 7), (9,) * 6, (5, 6, 7, 8, 10), (9,) * 4 + (40, 41)]  # the last one waits, then hits r1's block
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _loop(overlap: bool) -> tuple[EngineLoop, list[RequestTracker]]:
    """A loop on the toy executor with every prompt queued, each with its own tracker."""
    loop = EngineLoop(Engine(KVToyExecutor(256, overlap=overlap), CONFIG), overlap=overlap)
    trackers = [RequestTracker(i, f"r{i}", None, p, PARAMS, None) for i, p in enumerate(PROMPTS)]
    for tracker in trackers:
        loop.add(tracker.request_id, tracker.prompt_ids, tracker.params, tracker)
    return loop, trackers


def _by_hand(loop: EngineLoop) -> None:
    """One step run by hand, as benchmarks/profile_decode.py times it."""
    state, plan = schedule(loop.state)
    state, out = loop.engine.step(state, plan)
    loop.adopt(state, plan, out)


def _outputs(trackers: list[RequestTracker]) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(t.token_ids), t.num_cached_tokens) for t in trackers]


@pytest.mark.parametrize("overlap", [False, True])
def test_hand_run_steps_match_loop_steps(overlap: bool) -> None:
    """Steps run by hand after ``drain`` and handed back with ``adopt`` give the tokens, prefix-cache hits and
    stats of a loop that only calls ``step``; the loop then steps on (overlapped again when it was)."""
    reference, expected = _loop(overlap)
    while reference.has_unfinished:
        reference.step()
    loop, trackers = _loop(overlap)
    for _ in range(3):
        loop.step()
    assert loop.drain() is not None or not overlap
    for _ in range(4):
        _by_hand(loop)
    while loop.has_unfinished:
        loop.step()
    assert _outputs(trackers) == _outputs(expected)
    assert all(t.finished for t in trackers) and trackers[-1].num_cached_tokens == CONFIG.block_size
    assert loop.stats == reference.stats


def test_adopt_refuses_a_step_in_flight() -> None:
    """``adopt`` while the loop has a step in flight (no ``drain``) raises PlanMismatchError and changes nothing."""
    loop, _ = _loop(overlap=True)
    loop.step()
    before = loop.state
    with pytest.raises(PlanMismatchError, match="drain"):
        loop.adopt(before, *_stale_step(loop))
    assert loop.state is before


def _stale_step(loop: EngineLoop) -> tuple:
    """A (plan, output) pair from a throw-away engine of the same config (never adopted by a correct driver)."""
    other = EngineLoop(Engine(KVToyExecutor(256), CONFIG), overlap=False)
    other.add("x", (1, 2, 3), PARAMS)
    state, plan = schedule(other.state)
    return plan, other.engine.step(state, plan)[1]


def test_adopt_refuses_a_plan_from_another_state() -> None:
    """A plan that does not continue the loop's state (another step index) is refused, the loop unchanged."""
    loop, trackers = _loop(overlap=False)
    loop.step()
    state, plan = schedule(loop.state)
    state, out = loop.engine.step(state, plan)
    before = loop.state
    with pytest.raises(PlanMismatchError, match=r"plan\.step"):
        loop.adopt(state, *_stale_step(loop))
    with pytest.raises(PlanMismatchError, match="committed"):
        loop.adopt(before, plan, out)
    assert loop.state is before and loop.stats.num_steps == 1
    loop.adopt(state, plan, out)
    assert loop.stats.num_steps == 2 and all(len(t.token_ids) == 2 for t in trackers[:3])

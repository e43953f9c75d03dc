"""User code run by the engine loop (``on_delta`` callbacks, the ``on_step`` hook) cannot corrupt it, and the
output processor's bookkeeping (metrics on a fake clock, stop strings) is what it claims.

Every run uses the KV-reading toy executor, overlapped (a speculative step in flight whenever user code runs) and
plain: a request's tokens are a hash of its context, so a lost, duplicated or misrouted token changes them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fnvllm.detokenizer import IncrementalDetokenizer
from fnvllm.engine.core import Engine, EngineOutput
from fnvllm.engine.loop import EngineLoop
from fnvllm.engine.output import RequestTracker, StreamDelta
from fnvllm.state import CoreConfig, EngineState, SamplingParams, StepPlan
from fnvllm.testing.tokenizer import build_test_tokenizer
from fnvllm.testing.toy import KVToyExecutor

CONFIG = CoreConfig(block_size=4, num_blocks=64, max_num_seqs=3, vocab_size=256, eos_token_ids={1})
PROMPTS = [(5, 6, 7), (9,) * 6, (11, 12), (40, 41, 42, 43, 44)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


class Boom(Exception):
    """The user code's error."""


def _loop(overlap: bool) -> EngineLoop:
    loop = EngineLoop(Engine(KVToyExecutor(256, overlap=overlap), CONFIG), overlap=overlap)
    assert loop.overlap is overlap
    return loop


def _drive(loop: EngineLoop, on_delta: Callable[[StreamDelta], None] | None = None) -> tuple[list, list[Boom]]:
    """Add every prompt with a tracker, step until all finish; returns (trackers, errors ``step`` raised)."""
    trackers = [RequestTracker(i, f"r{i}", None, p, PARAMS, None, on_delta) for i, p in enumerate(PROMPTS)]
    for t in trackers:
        loop.add(t.request_id, t.prompt_ids, t.params, t)
    raised: list[Boom] = []
    for _ in range(200):
        if all(t.finished for t in trackers) and not loop.has_unfinished:
            break
        try:
            loop.step()
        except Boom as error:
            raised.append(error)
    return trackers, raised


def _expected(overlap: bool) -> list[tuple[int, ...]]:
    trackers, raised = _drive(_loop(overlap))
    assert not raised
    return [tuple(t.token_ids) for t in trackers]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("at", [0, 1, 5, 13, 31])
def test_on_delta_raising_once_surfaces_once_and_loses_nothing(overlap: bool, at: int) -> None:
    """A consumer callback raising at its ``at``-th delta: ``step`` raises that error once; every request still
    finishes with exactly the tokens of an undisturbed run (none duplicated, lost or stuck)."""
    count = [0]

    def on_delta(delta: StreamDelta) -> None:
        count[0] += 1
        if count[0] == at + 1:
            raise Boom(f"delta {at}")

    trackers, raised = _drive(_loop(overlap), on_delta)
    assert [str(e) for e in raised] == [f"delta {at}"]
    assert [tuple(t.token_ids) for t in trackers] == _expected(overlap)
    assert all(t.finish_reason == "length" and len(t.token_ids) == PARAMS.max_tokens for t in trackers)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("at", [0, 2, 7])
def test_on_step_raising_once_surfaces_once_and_loses_nothing(overlap: bool, at: int) -> None:
    """The ``on_step`` hook raising at step ``at`` (the next step already launched when overlapped): ``step``
    raises it once, and the run goes on to the undisturbed tokens."""
    loop = _loop(overlap)
    seen: list[int] = []

    def hook(state: EngineState, plan: StepPlan, out: EngineOutput) -> None:
        seen.append(plan.step)
        if len(seen) == at + 1:
            raise Boom(f"step {at}")

    loop.on_step = hook
    trackers, raised = _drive(loop)
    assert [str(e) for e in raised] == [f"step {at}"]
    assert [tuple(t.token_ids) for t in trackers] == _expected(overlap)
    assert seen == sorted(set(seen)), "every committed step is seen once, in order"


@pytest.mark.parametrize("overlap", [False, True])
def test_callback_may_abort_and_add_requests(overlap: bool) -> None:
    """A callback aborting one request and adding another mid-step acts on the loop's current state: the abort
    frees the request's blocks and the new request finishes with its own tokens."""
    loop = _loop(overlap)
    late = RequestTracker(9, "late", None, (77,), PARAMS, None)
    done = [False]

    def on_delta(delta: StreamDelta) -> None:
        if delta.request_id == "r0" and not done[0]:
            done[0] = True
            loop.abort("r1")
            loop.add("late", (77,), PARAMS, late)

    trackers, raised = _drive(loop, on_delta)
    while not late.finished:
        loop.step()
    assert not raised and trackers[1].finish_reason == "abort"
    alone = _loop(False)
    solo = RequestTracker(0, "late", None, (77,), PARAMS, None)
    alone.add("late", (77,), PARAMS, solo)
    while not solo.finished:
        alone.step()
    assert late.token_ids == solo.token_ids
    while loop.has_unfinished:
        loop.step()
    assert loop.state.pool.num_free == CONFIG.num_blocks


class FakeClock:
    """Advances one second per step (the test moves it)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("overlap", [False, True])
def test_metrics_follow_the_clock(overlap: bool) -> None:
    """With a fake clock advanced by one second per step: arrival is when the request was made, the first token
    time is the step of the first token (not of a later one), the finish time the step of the last."""
    clock = FakeClock()
    loop = EngineLoop(Engine(KVToyExecutor(256, overlap=overlap), CONFIG), overlap=overlap, clock=clock)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    tracker = RequestTracker(0, "a", None, (5, 6, 7), params, None, arrival_time=clock())
    loop.add("a", (5, 6, 7), params, tracker)
    times: list[float] = []  # the clock at each step that routed a token of "a"
    while not tracker.finished:
        clock.now += 1.0
        before = len(tracker.token_ids)
        loop.step()
        times += [clock.now] * (len(tracker.token_ids) - before)
    metrics = tracker.metrics()
    assert metrics.arrival_time == 100.0
    assert metrics.first_token_time == times[0] and metrics.finish_time == times[-1]
    assert metrics.ttft == times[0] - 100.0 and len(times) == 5 > len(set(times[:1]))
    assert metrics.tpot(5) == pytest.approx((times[-1] - times[0]) / 4)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_string_ends_the_request_in_the_core(overlap: bool) -> None:
    """A stop string seen by the detokenizer ends the request in the core at that step: it leaves the state and
    its KV blocks return to the pool (not held until max_tokens)."""
    tokenizer = build_test_tokenizer(vocab_size=256)
    loop = _loop(overlap)
    probe = RequestTracker(0, "p", None, (70, 71, 72), PARAMS, IncrementalDetokenizer(tokenizer, (70, 71, 72), True))
    loop.add("p", (70, 71, 72), PARAMS, probe)
    while not probe.finished:
        loop.step()
    text = tokenizer.decode(probe.token_ids[2:3])
    assert text, "the third token decodes to some text"
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(text,))
    detok = IncrementalDetokenizer(tokenizer, (70, 71, 72), True, params.stop)
    tracker = RequestTracker(0, "s", None, (70, 71, 72), params, detok)
    loop.add("s", (70, 71, 72), params, tracker)
    while not tracker.finished:
        loop.step()
    assert tracker.finish_reason == "stop" and len(tracker.token_ids) <= 3
    assert "s" not in loop.state.requests, "the core was not told of the stop-string finish"
    loop.drain()
    assert loop.state.pool.num_free == CONFIG.num_blocks


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_cuda_device_without_cuda_is_a_config_error() -> None:
    """``LLM(ckpt, device="cuda")`` on a CPU-only torch is an InvalidConfigError naming the field, raised before
    the checkpoint is read (not an assertion from inside torch)."""
    from fnvllm.llm import LLM
    from fnvllm.state import InvalidConfigError

    with pytest.raises(InvalidConfigError, match=r"^device: 'cuda' was asked for"):
        LLM("/nonexistent/checkpoint", device="cuda")

"""The engine loop and output processor: interleaved streams, aborts, per-request metrics, error recovery."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tiny_models import write_family

from fnvllm.engine import StreamDelta
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

PROMPTS = [[5, 9, 13, 200, 7], [42] * 12, list(range(3, 40)), [250, 3]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    ckpt = write_family(tmp_path_factory.mktemp("loop"), "qwen3")
    return LLM(ckpt, dtype="float32", block_size=8, num_blocks=256)


def _with_timeout(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Run ``fn`` in a thread; fail the test (instead of hanging CI) if it does not return in time."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not finish within {seconds} s (a hang)"
    if errors:
        raise errors[0]
    return result[0]


def _collect(streams: list[Iterator[StreamDelta]]) -> list[list[StreamDelta]]:
    """Iterate the streams round-robin, one delta at a time, until all are exhausted."""
    got: list[list[StreamDelta]] = [[] for _ in streams]
    live = dict(enumerate(streams))
    while live:
        for i in list(live):
            delta = next(live[i], None)
            if delta is None:
                del live[i]
            else:
                got[i].append(delta)
    return got


def test_interleaved_streams_get_exactly_their_own_tokens(llm: LLM) -> None:
    """Three streams iterated in turn each receive exactly their own requests' tokens and finish, no hang."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 3, 11)]
    expected = [llm.generate([p], q, use_tqdm=False)[0].token_ids for p, q in zip(PROMPTS, params, strict=False)]
    streams = [llm.stream([p], q) for p, q in zip(PROMPTS, params, strict=False)]
    got = _with_timeout(lambda: _collect(streams))
    for deltas, want in zip(got, expected, strict=True):
        ids = tuple(itertools.chain.from_iterable(d.new_token_ids for d in deltas))
        assert ids == want
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
    assert not llm.state.has_unfinished


def test_stream_interleaved_with_generate(llm: LLM) -> None:
    """A generate call between two pulls of a stream finishes its own requests; the stream then completes."""
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want_stream = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].token_ids
    want_gen = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids
    stream = llm.stream([PROMPTS[2]], params)
    first = next(stream)
    mid = _with_timeout(lambda: llm.generate([PROMPTS[0]], params, use_tqdm=False))
    rest = _with_timeout(lambda: list(stream))
    assert mid[0].token_ids == want_gen
    assert tuple(itertools.chain(first.new_token_ids, *(d.new_token_ids for d in rest))) == want_stream


def test_closed_stream_aborts_its_requests(llm: LLM) -> None:
    """Closing a stream early aborts its unfinished requests and frees their blocks."""
    free_before = llm.state.pool.num_free
    stream = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.state.has_unfinished
    assert llm.state.pool.num_free == free_before


def test_request_metrics_are_ordered(llm: LLM) -> None:
    """Each output carries arrival <= first token <= finish times, and TTFT/TPOT derived from them."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.finish_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finish_time
        assert m.ttft is not None and m.ttft >= 0
        tpot = m.tpot(len(out.token_ids))
        assert tpot is not None and tpot >= 0


def test_scheduled_time_splits_ttft_into_queue_and_prefill(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each output records when the plan that first admitted it was made: arrival <= scheduled <= first token,
    queue + prefill time = TTFT; with room for one request at a time, the second is admitted only after the
    first finished (its queue time covers the first's run)."""
    ckpt = write_family(tmp_path_factory.mktemp("sched"), "qwen3")
    llm = LLM(ckpt, dtype="float32", block_size=8, num_blocks=64, max_num_seqs=1)
    first, second = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), False)
    for out in (first, second):
        m = out.metrics
        assert m is not None and m.scheduled_time is not None and m.first_token_time is not None
        assert m.arrival_time <= m.scheduled_time <= m.first_token_time
        assert m.queue_time is not None and m.prefill_time is not None and m.ttft is not None
        assert m.queue_time + m.prefill_time == pytest.approx(m.ttft)
        assert m.inference_time == pytest.approx(m.prefill_time + m.decode_time)  # type: ignore[operator]
    assert first.metrics is not None and second.metrics is not None and first.metrics.finish_time is not None
    assert second.metrics.scheduled_time >= first.metrics.finish_time  # type: ignore[operator]
    llm.close()


def test_prefix_cache_hits_reported_per_request(llm: LLM) -> None:
    """A prompt whose blocks are cached reports those tokens as served from the cache; the totals agree."""
    prompt = list(range(100, 140))  # 40 tokens = 5 full blocks of 8
    before = llm.stats.num_cached_tokens
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.metrics is not None and again.metrics.num_cached_tokens == 39  # all but the last prompt token
    assert llm.stats.num_cached_tokens - before == 39


def test_failed_step_keeps_requests_and_engine_usable(llm: LLM) -> None:
    """An executor error mid-run re-raises, keeps the engine in step, and a retry finishes the work."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].token_ids
    real_collect = llm.executor.collect  # execute and the overlapped loop (on a GPU) both collect each step
    calls = {"n": 0}

    def flaky(launched: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real_collect(launched)

    llm.executor.collect = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="device fell over"):
            llm.generate([PROMPTS[1]], params, use_tqdm=False)
    finally:
        del llm.executor.collect
    assert not llm.state.has_unfinished  # the failed call aborted its own request
    assert llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].token_ids == want


def test_loop_add_many_is_atomic(llm: LLM) -> None:
    """If one request of a batch is invalid, none of the batch is queued."""
    from fnvllm.state import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPTS[0], [10**9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.state.has_unfinished
    assert llm.loop.processor.trackers == {}

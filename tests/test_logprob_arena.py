"""Logprob rows of many steps in arena blocks (``StepLogprobs.from_host``), a request's entries gathered from them in
bulk when read (``LogprobList``, ``LogprobView``), and the output loop handing each tracker its step's rows."""

from __future__ import annotations

import random

import pytest
import torch

import fnvllm.executor.logprob_rows as rows_module
from fnvllm.engine.core import EngineOutput
from fnvllm.engine.output import OutputProcessor, RequestTracker, discard_delta
from fnvllm.executor.base import TokenLogprobs
from fnvllm.executor.logprob_rows import LogprobList, LogprobView, RequestLogprobs, StepLogprobs
from fnvllm.state import SamplingParams
from fnvllm.state.request import FinishedRequest, StepOutput


def _step(rng: random.Random, tokens: list[int], asked: tuple[int | None, ...], width: int) -> StepLogprobs:
    """A step's logprobs from random tensors of the rows that asked (as the executor's host copies hold them)."""
    num = sum(n is not None for n in asked)
    ids = torch.tensor([[rng.randrange(150_000) for _ in range(width)] for _ in range(num)], dtype=torch.int64)
    values = torch.tensor([[rng.uniform(-9, 0) for _ in range(width)] for _ in range(num)], dtype=torch.float32)
    sampled = torch.tensor([rng.uniform(-9, 0) for _ in range(num)], dtype=torch.float32)
    return StepLogprobs.from_host(tokens, asked, sampled, ids.reshape(num, width), values.reshape(num, width))


def _history(rng: random.Random, num_steps: int, width: int) -> tuple[list[RequestLogprobs], list[TokenLogprobs]]:
    """Steps of 4 shuffled requests (one, "z", never asks); request "x"'s references and its entries one by one."""
    sources, want = [], []
    for s in range(num_steps):
        ids = ["x", "y", "z", "w"]
        rng.shuffle(ids)
        asked = tuple(None if rid == "z" else width for rid in ids)
        step = _step(rng, [10 * s + i for i in range(4)], asked, width)
        sources.append(RequestLogprobs(tuple(ids), step))
        want.append(step[ids.index("x")])
    return sources, want


@pytest.mark.parametrize("width", [0, 1, 5])
def test_bulk_build_equals_rows_built_one_by_one(width: int) -> None:
    """Many steps (the bulk path), the request's row moving and other rows not asking: the same entries as each
    row built alone, for top widths 0, 1 and 5."""
    sources, want = _history(random.Random(width), 3 * rows_module.BULK_MIN_ROWS, width)
    entries = LogprobList("x")
    for source in sources:
        entries.append(source)
    assert entries.materialize() == tuple(want)


def test_bulk_build_across_arena_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With blocks of a few rows only, a request's rows lie in many blocks and still build to the right entries;
    a block full before a step's rows fit gives way to a fresh one."""
    monkeypatch.setattr(rows_module, "BLOCK_BYTES", 10 * (4 + 12 * 3))  # 10 rows of width 3 per block
    monkeypatch.setattr(rows_module, "_arena", rows_module.threading.local())
    sources, want = _history(random.Random(7), 2 * rows_module.BULK_MIN_ROWS, 3)
    assert len({id(source._step._block) for source in sources}) > 3
    entries = LogprobList("x")
    for source in sources:
        entries.append(source)
    assert entries.view() == tuple(want)


def test_bulk_build_of_selected_rows() -> None:
    """A step's ``select`` (the rows an overlapped step keeps) shares its block: bulk reads of the kept rows match."""
    rng = random.Random(3)
    entries, want = LogprobList("b"), []
    for s in range(2 * rows_module.BULK_MIN_ROWS):
        step = _step(rng, [s, s + 1, s + 2], (2, 2, 2), 2)
        kept = step.select((False, True, True))
        entries.append(RequestLogprobs(("b", "c"), kept))
        want.append(step[1])
    assert entries.materialize() == tuple(want)


def test_newest_slices_build_and_release_their_steps() -> None:
    """Reading the newest entries step after step (as the server does) returns them, keeps them built and drops
    the references to their steps; a slice that skips unbuilt entries builds nothing."""
    sources, want = _history(random.Random(1), 6, 2)
    entries = LogprobList("x")
    for i, source in enumerate(sources[:4]):
        entries.append(source)
        assert entries[i:] == (want[i],)
    assert all(isinstance(s, TokenLogprobs) for s in entries._sources)
    entries.append(sources[4])
    entries.append(sources[5])
    assert entries[5:] == (want[5],) and isinstance(entries._sources[4], RequestLogprobs)
    assert entries.materialize() == tuple(want)


def test_processor_hands_trackers_their_steps_rows() -> None:
    """Through ``OutputProcessor.process``, a tracker that asked gets its own row of each step (wherever its row
    is), one that did not ask gets none, and a finished request's output builds them only when read."""
    rng = random.Random(5)
    asking = SamplingParams(logprobs=2, max_tokens=8)
    processor = OutputProcessor()
    trackers = {
        rid: RequestTracker(i, rid, None, (1, 2), asking if rid != "q" else SamplingParams(max_tokens=8), None)
        for i, rid in enumerate(("p", "q", "r"))
    }
    for tracker in trackers.values():
        processor.add(tracker)
    want: dict[str, list[TokenLogprobs]] = {"p": [], "r": []}
    for s in range(3):
        order = ["p", "q", "r"] if s % 2 == 0 else ["r", "q", "p"]
        step = _step(rng, [s, s + 10, s + 20], tuple(None if rid == "q" else 2 for rid in order), 2)
        finished = tuple(FinishedRequest(rid, 2, (), "length") for rid in order if s == 2)
        out = StepOutput(s, tuple(order), (s, s + 10, s + 20), finished)
        processor.process(None, EngineOutput(out, RequestLogprobs(tuple(order), step)))  # type: ignore[arg-type]
        for rid in want:
            want[rid].append(step[order.index(rid)])
    outputs = {rid: t.result() for rid, t in trackers.items()}
    assert outputs["q"].logprobs is None and len(trackers["q"].logprobs) == 0
    for rid in want:
        got = outputs[rid].logprobs
        assert isinstance(got, LogprobView) and got._entries is None  # not built until read
        assert got == tuple(want[rid])


def test_processor_builds_no_delta_for_a_discarding_tracker() -> None:
    """A tracker whose ``on_delta`` is ``discard_delta`` (``LLM.generate``'s) gets no outbox entry, yet records its
    token and finishes; a queueing tracker beside it gets its delta."""
    processor = OutputProcessor()
    params = SamplingParams(max_tokens=1)
    dropping = RequestTracker(0, "d", None, (1,), params, None, on_delta=discard_delta)
    queueing = RequestTracker(1, "k", None, (1,), params, None)
    processor.add(dropping)
    processor.add(queueing)
    finished = tuple(FinishedRequest(rid, 1, (7,), "length") for rid in ("d", "k"))
    _, outbox = processor.process(None, EngineOutput(StepOutput(0, ("d", "k"), (7, 8), finished)))  # type: ignore[arg-type]
    assert [tracker for tracker, _ in outbox] == [queueing] and outbox[0][1].finish_reason == "length"
    assert dropping.finished and dropping.token_ids == [7] and dropping.result().finish_reason == "length"


def test_building_leaves_the_collector_as_it_found_it() -> None:
    """A bulk build pauses the garbage collector and restores its state: on stays on, off stays off."""
    import gc

    sources, want = _history(random.Random(9), rows_module.BULK_MIN_ROWS, 2)
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            entries = LogprobList("x")
            for source in sources:
                entries.append(source)
            assert entries.materialize() == tuple(want) and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()

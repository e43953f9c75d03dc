"""Logprobs on the host: a step's tensors as lazy per-row TokenLogprobs (``_host_logprobs``, ``StepLogprobs``), by
request (``RequestLogprobs``), per request (``LogprobList``), and the engine keeping none built while requests run."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path

import pytest
import torch
from tiny_models import write_family

from fnvllm.engine.output import RequestTracker
from fnvllm.executor.base import TokenLogprobs
from fnvllm.executor.logprob_rows import LogprobList, RequestLogprobs
from fnvllm.executor.model_executor import _host_logprobs
from fnvllm.executor.sampler import Logprobs
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams


def _logprobs(num_rows: int, width: int) -> Logprobs:
    """Distinct, recognisable values: row k's j-th entry is id 100 k + j with logprob -(k + j / 10)."""
    ids = torch.tensor([[100 * k + j for j in range(width)] for k in range(num_rows)], dtype=torch.int64)
    values = torch.tensor([[-(k + j / 10) for j in range(width)] for k in range(num_rows)], dtype=torch.float32)
    sampled = torch.tensor([-0.5 * k for k in range(num_rows)], dtype=torch.float32)
    return Logprobs(values.reshape(num_rows, width), ids.reshape(num_rows, width), sampled)


def _expected(lp: Logprobs, tokens: list[int], asked: tuple[int | None, ...]) -> tuple[TokenLogprobs | None, ...]:
    """The per-row reference: one TokenLogprobs per row that asked, its first n entries."""
    out: list[TokenLogprobs | None] = []
    k = 0
    for i, n in enumerate(asked):
        if n is None:
            out.append(None)
            continue
        ids, values = lp.top_ids[k, :n].tolist(), lp.top_logprobs[k, :n].tolist()
        out.append(TokenLogprobs(tokens[i], float(lp.sampled_logprobs[k]), tuple(zip(ids, values, strict=True))))
        k += 1
    return tuple(out)


def test_every_row_asking_the_same_count() -> None:
    """When every row asked for the tensors' width, each row gets its own sampled logprob and top entries."""
    lp, tokens = _logprobs(4, 3), [7, 8, 9, 10]
    got = _host_logprobs(lp, tokens, (3, 3, 3, 3))
    assert got == _expected(lp, tokens, (3, 3, 3, 3))
    assert got[2] == TokenLogprobs(9, -1.0, ((200, -2.0), (201, _f32(-2.1)), (202, _f32(-2.2))))


def _f32(value: float) -> float:
    """``value`` rounded through float32, as the tensors hold it."""
    return torch.tensor(value, dtype=torch.float32).item()


def test_mixed_counts_and_rows_that_did_not_ask() -> None:
    """Rows asking fewer entries keep the first ones, rows that did not ask get None, and n 0 gives no top."""
    asked = (2, None, 0, 2, None)
    lp, tokens = _logprobs(3, 2), [1, 2, 3, 4, 5]
    got = _host_logprobs(lp, tokens, asked)
    assert got == _expected(lp, tokens, asked)
    assert got[1] is None and got[2] is not None and got[2].top == ()


def test_every_row_asking_zero() -> None:
    """logprobs=0 on every row: the sampled token's logprob with an empty top list."""
    lp, tokens = _logprobs(2, 0), [4, 5]
    got = _host_logprobs(lp, tokens, (0, 0))
    assert got == (TokenLogprobs(4, 0.0, ()), TokenLogprobs(5, -0.5, ()))


def test_step_logprobs_select_keeps_flagged_rows() -> None:
    """``select`` keeps the flagged rows' entries (built from the shared lists), in order."""
    asked = (2, None, 2, 1)
    lp, tokens = _logprobs(3, 2), [1, 2, 3, 4]
    step = _host_logprobs(lp, tokens, asked)
    full = _expected(lp, tokens, asked)
    assert step.select((True, False, False, True)) == (full[0], full[3])
    assert (
        _host_logprobs(lp, tokens[:3], (2, 2, 2)).select((False, True, True)) == _expected(lp, [1, 2, 3], (2, 2, 2))[1:]
    )


def test_request_logprobs_maps_only_rows_that_asked() -> None:
    """By request id: rows that asked map to their entry, the others are absent; a reference names the row."""
    asked = (2, None, 2)
    lp, tokens = _logprobs(2, 2), [5, 6, 7]
    step = _host_logprobs(lp, tokens, asked)
    by_id = RequestLogprobs(("a", "b", "c"), step)
    assert dict(by_id) == {"a": step[0], "c": step[2]}
    assert "b" not in by_id and by_id.reference("b") is None and by_id.reference("c") == (step, 2)


def test_logprob_list_builds_references_once() -> None:
    """A request's list reads step references (its own row found by id) and given entries alike, and
    ``materialize`` keeps what it built."""
    lp, tokens = _logprobs(2, 2), [5, 6]
    step = _host_logprobs(lp, tokens, (2, 2))
    given = TokenLogprobs(9, -0.25, ((9, -0.25),))
    entries, other = LogprobList("b"), LogprobList("a")
    for target in (entries, other):
        target.append(RequestLogprobs(("a", "b"), step))
    entries.append(given)
    entries.append(RequestLogprobs(("b", "c"), step))
    assert entries[-1] == step[0] and entries[1:] == (given, step[0]) and other[0] == step[0]
    built = entries.materialize()
    assert built == (step[1], given, step[0]) and entries.materialize()[0] is built[0]


def test_logprob_list_raises_for_a_step_without_its_row() -> None:
    """Reading an entry whose step holds no row of the request (it did not ask there) raises KeyError."""
    step = _host_logprobs(_logprobs(1, 2), [5, 6], (2, None))
    entries = LogprobList("b")
    entries.append(RequestLogprobs(("a", "b"), step))
    with pytest.raises(KeyError):
        entries.materialize()


def test_logprob_view_is_a_lazy_immutable_tuple() -> None:
    """A view holds the entries appended before it was taken, builds nothing until read, and compares, hashes,
    prints and pickles as the tuple of its entries (loading as a plain tuple)."""
    step = _host_logprobs(_logprobs(2, 2), [5, 6], (2, 2))
    entries = LogprobList("a")
    entries.append(RequestLogprobs(("a", "b"), step))
    view = entries.view()
    entries.append(RequestLogprobs(("b", "a"), step))
    assert len(view) == 1 and entries._built == []  # nothing built yet
    want = (step[0],)
    assert view == want and want == view and hash(view) == hash(want) and repr(view) == repr(want)
    assert view[0] == step[0] and view[-1:] == want and list(view) == list(want)
    assert pickle.loads(pickle.dumps(view)) == want and type(pickle.loads(pickle.dumps(view))) is tuple
    assert entries.materialize() == (step[0], step[1])


def test_trackers_keep_no_token_logprobs_while_requests_run(tmp_path: Path) -> None:
    """While requests with logprobs run, and after they finish until their outputs' logprobs are read, the engine
    keeps no TokenLogprobs objects (rows are built when read); the outputs carry every entry."""
    llm = LLM(write_family(tmp_path, "qwen3"), dtype="float32", block_size=8, num_blocks=64)
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=2)
    trackers = [RequestTracker(i, f"r{i}", None, (3, 4, 5 + i), params, None) for i in range(3)]
    llm.loop.add_many([(t.request_id, t.prompt_ids, t.params, t) for t in trackers])
    for _ in range(4):
        llm.loop.step()
    assert llm.loop.has_unfinished and all(len(t.logprobs) >= 2 for t in trackers)
    assert not any(type(o) is TokenLogprobs for o in gc.get_objects())
    while llm.loop.has_unfinished:
        llm.loop.step()
    outputs = [t.result() for t in trackers]
    assert all(o.logprobs is not None and len(o.logprobs) == 6 for o in outputs)
    assert not any(type(o) is TokenLogprobs for o in gc.get_objects())  # finished, but not read yet: none built
    assert all(isinstance(lp, TokenLogprobs) and len(lp.top) == 2 for o in outputs for lp in o.logprobs or ())


def test_pinned_ring_logprob_views_hold_each_tensor() -> None:
    """A ring slot's second buffer gives views shaped like the step's logprob tensors (16-byte aligned, an empty
    tensor gets none) that hold what is copied into them, and refuses tensors that do not fit."""
    from fnvllm.executor.model_executor import PinnedRing

    ring = PinnedRing.__new__(PinnedRing)  # the buffers, without pinned memory (a CPU machine has none)
    ring.extras = [torch.zeros(256, dtype=torch.uint8)]
    lp = _logprobs(3, 5)
    tensors = [lp.top_logprobs, lp.top_ids, lp.sampled_logprobs, torch.empty(3, 0)]
    views = ring.extra_views(0, tensors)
    assert views is not None and views[3] is None
    for view, t in zip(views[:3], tensors[:3], strict=True):
        assert view is not None and view.dtype == t.dtype and view.shape == t.shape
        view.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(views[:3], tensors[:3], strict=True) if v is not None)
    offsets = [v.data_ptr() - ring.extras[0].data_ptr() for v in views[:3] if v is not None]
    assert offsets == [0, 64, 192]  # 60 bytes -> 64, 120 -> 128 more
    assert ring.extra_views(0, [torch.zeros(40, dtype=torch.int64)]) is None  # 320 bytes > 256


def test_logprob_list_of_references_builds_what_each_row_gives() -> None:
    """A list of step references only (one request's rows across steps, bulk-built) equals its rows built one by
    one, with n 0 too, and with the request's row moving between steps."""
    for width, asked in ((3, (3, None, 3)), (0, (0, None, 0))):
        steps = [_host_logprobs(_logprobs(2, width), [10 * s, 10 * s + 1, 10 * s + 2], asked) for s in range(3)]
        entries = LogprobList("x")
        for s, step in enumerate(steps):
            ids = ("x", "y", "z") if s % 2 == 0 else ("z", "y", "x")  # rows 0, 2, 0: both asked
            entries.append(RequestLogprobs(ids, step))
        want = (steps[0][0], steps[1][2], steps[2][0])
        assert entries.materialize() == want and all(e is not None for e in want)

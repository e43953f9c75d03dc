"""The grammar process (``Grammars(process=True)``): its masks are the in-process matchers' bit for bit through
accepts, fills and advances; it ends matchers on stop ids, forgets pruned ones, counts its work in the stats and
reports its failures; and an engine with overlapped steps fills every mask there (counted, not timed)."""

from __future__ import annotations

import gc
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fnvllm.demo
from fnvllm.engine.loop import EngineLoop
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.executor.structured import Grammars, Matcher, RemoteMatcher
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams, StructuredOutput

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")

VOCAB = 300
STOP = 0
SCHEMA = StructuredOutput.json_schema(
    {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}
)


@pytest.fixture(scope="module")
def info() -> object:
    """A small vocabulary's TokenizerInfo: the stop token, byte tokens, then JSON-ish strings."""
    rng = random.Random(0)
    vocab = [b"<eos>"] + [bytes([i]) for i in range(32, 127)]
    while len(vocab) < VOCAB:
        vocab.append(bytes(rng.choice(b'abc{}[]":, 0123456789') for _ in range(rng.randint(2, 5))))
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[STOP])


@pytest.fixture(scope="module")
def remote(info: object) -> Grammars:
    """Grammars whose matchers live in a grammar process (one for the module: it takes a second to start)."""
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=2, process=True)
    yield grammars
    grammars.close()


def _pick(bitmask: torch.Tensor, rng: random.Random) -> list[int]:
    """A random allowed token per row of an (R, W) int32 bitmask."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    return [rng.choice(np.flatnonzero(row).tolist()) for row in bits]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_the_loop_thread_and_the_process_split_the_cores(info: object) -> None:
    """(First in the module: its other tests' grammar process holds the split.) Starting a grammar process splits
    the cores: the calling (engine loop) thread keeps some, the process gets the others (disjoint, all of them), so
    that a socket write never runs the process on the writer's core; close gives the thread its cores back. The
    split keeps a physical core's hyperthreads on one side and gives the loop a quarter of the cores."""
    before = os.sched_getaffinity(0)
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=1, process=True)
    process = grammars._process()
    mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(process._proc.pid)
    assert mine and theirs and not mine & theirs and mine | theirs == before
    grammars.close()
    assert os.sched_getaffinity(0) == before


def test_the_split_keeps_hyperthreads_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 8 physical cores of two hyperthreads each (cpu k and k + 8), the loop keeps two whole physical cores and
    the process gets the other six; one physical core is not split."""
    from fnvllm.executor import structured

    monkeypatch.setattr(structured, "_siblings", lambda cpu: f"{cpu % 8},{cpu % 8 + 8}")
    mine, theirs = structured._halves(set(range(16)))
    assert mine == [0, 8, 1, 9] and theirs == [2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    assert structured._halves({0, 8}) == ([], [])


def test_process_masks_equal_this_process_masks(remote: Grammars, info: object) -> None:
    """Walking five matchers for 60 steps (random allowed tokens, steps alternating accept-then-masks and
    advance-then-wait, an unconstrained row among them), the grammar process's masks and rows equal the in-process
    matchers' every step, and both end the same matchers."""
    _walk_both(remote, info, 60)


def test_process_workers_fill_as_one_does(info: object) -> None:
    """A grammar process with two worker threads (each accepting and filling its chunk of the rows) gives the
    in-process matchers' masks every step too."""
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=2, num_workers=2, process=True)
    _walk_both(grammars, info, 30)
    grammars.close()


def _walk_both(remote: Grammars, info: object, steps: int) -> None:
    """Walk five matchers in ``remote``'s process and five here for ``steps`` steps; assert equal masks each."""
    local = Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=2, process=False)
    process = remote._process()
    theirs = [process.new(SCHEMA) for _ in range(5)]
    ours = [Matcher(xgr.GrammarMatcher(local._compile(SCHEMA))) for _ in range(5)]
    ids = [f"r{k}" for k in range(5)]
    rng = random.Random(1)
    tokens: list[int] | None = None
    for step in range(steps):
        batch_theirs, batch_ours = [theirs[0], None, *theirs[1:]], [ours[0], None, *ours[1:]]
        if tokens is None or step % 2:
            if tokens is not None:
                remote.accept(ids, theirs, tokens)
            got = remote.masks(batch_theirs)
        else:
            pending = remote.advance(ids, theirs, tokens, batch_theirs)
            assert pending is not None and pending.ticket is not None
            got = remote.wait(pending)
        if tokens is not None:
            local.accept(ids, ours, tokens)
        expected = local.masks(batch_ours)
        assert got is not None and expected is not None
        assert torch.equal(got.bitmask, expected.bitmask)
        assert got.rows.tolist() == expected.rows.tolist() == [0, 2, 3, 4, 5]
        tokens = _pick(expected.bitmask, rng)
    assert [m.ended for m in theirs] == [m.matcher.is_terminated() for m in ours]


def test_a_stop_id_ends_the_matcher_and_prune_forgets_it(remote: Grammars) -> None:
    """A matcher given a stop id (allowed once its grammar is complete) ends: it leaves the live matchers, and its
    next mask allows every token; prune drops the others' matchers, there and here."""
    process = remote._process()
    done, other = process.new(SCHEMA), process.new(SCHEMA)
    remote._live.update({"done": done, "other": other})
    text = '{"name": "a", "n": 1}'
    for ch in text.encode():
        remote.accept(["done"], [done], [ch - 31])  # byte tokens: id = byte - 31
        remote.masks([done])
    remote.accept(["done"], [done], [STOP])
    assert done.ended and "done" not in remote._live and done.accepted == len(text) + 1
    host = remote.masks([done, other])
    assert host is not None and bool((host.bitmask[0] == -1).all()) and not bool((host.bitmask[1] == -1).all())
    remote.prune(())
    assert remote.num_live == 0


def test_stats_count_the_process_fills(remote: Grammars) -> None:
    """Each fill of the grammar process counts in Grammars.stats (its rows, its times), each wait too."""
    process = remote._process()
    a, b = process.new(SCHEMA), process.new(SCHEMA)
    remote.reset_stats()
    remote.masks([a, None, b])
    pending = remote.advance(["a", "b"], [a, b], [ord("{") - 31, ord("{") - 31], [a, b])
    assert pending is not None
    remote.wait(pending)
    stats = remote.reset_stats()
    assert (stats.num_fills, stats.rows_filled, stats.num_waits) == (2, 4, 1)
    assert stats.fill_s > 0 and stats.accept_s > 0


def test_the_process_stops_with_its_grammars(info: object) -> None:
    """The grammar process and its shared file go away on every exit path: the file is unlinked once both sides
    mapped it, close stops the process, and a Grammars dropped without close stops its process when collected
    (the loop thread's cores come back too)."""
    before = os.sched_getaffinity(0)
    for closing in (True, False):
        grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=1, process=True)
        process = grammars._process()
        assert grammars.masks([process.new(SCHEMA)]) is not None
        path, proc = process._maps[-1][1], process._proc
        assert not os.path.exists(path)  # the grammar process unlinked it after mapping it
        if closing:
            grammars.close()
        else:
            del grammars, process
            gc.collect()
        assert proc.wait(timeout=10) == 0
    assert os.sched_getaffinity(0) == before  # (the split, when another grammar process still holds it, stays)


def test_a_dead_process_is_a_clear_error(info: object) -> None:
    """When the grammar process has died, the next fill raises RuntimeError saying so (not a hang); a cancelled
    pending mask is dropped without raising."""
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=1, process=True)
    process = grammars._process()
    live = process.new(SCHEMA)
    assert grammars.masks([live]) is not None
    pending = grammars.advance(["a"], [live], [ord("{") - 31], [live])
    assert pending is not None
    grammars.wait(pending)
    process._proc.kill()
    process._proc.wait()
    with pytest.raises(RuntimeError, match="grammar process"):
        grammars.masks([live])
    grammars.close()


DEMO = Path(fnvllm.demo.__file__).parent / "checkpoint"


def test_overlapped_engine_fills_every_mask_in_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine with overlapped steps (as on a GPU) and the grammar process: constrained and unconstrained seeded
    rows give plain stepping's tokens, the constrained outputs follow their schema, and every mask was filled in
    the grammar process (this process's fill never ran); a deferred step's tokens went to the process in the
    collect that brought them (advance) and its masks were received in the next launch (wait), as the docs say."""
    monkeypatch.setattr(ModelExecutor, "supports_overlap", property(lambda self: True))
    llm = LLM(DEMO, dtype="float32", block_size=8, num_blocks=256, max_num_seqs=8)
    grammars = llm.engine.executor.grammars
    assert isinstance(grammars, Grammars) and llm.engine.executor.sample_deferred_at == "launch"
    grammars.process = True
    local_fills: list[int] = []
    fill = Grammars._fill
    monkeypatch.setattr(Grammars, "_fill", lambda self, *a: local_fills.append(1) or fill(self, *a))
    inside: list[str] = []  # the executor call running now
    calls: list[tuple[str, str]] = []  # (grammars call, executor call it ran in)
    for name in ("launch", "collect"):
        monkeypatch.setattr(ModelExecutor, name, _marking(getattr(ModelExecutor, name), name, inside))
    for name in ("advance", "wait"):
        original = getattr(Grammars, name)
        monkeypatch.setattr(Grammars, name, _recording(original, name, inside, calls))
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}})
    params = [
        SamplingParams(max_tokens=40, seed=k, structured=schema if k % 2 else None, ignore_eos=k % 2 == 0)
        for k in range(6)
    ]
    prompts = ["The story", "def f", "Once", "A", "import", "x"]
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=False)
    plain = llm.generate(prompts, params, use_tqdm=False)
    grammars.reset_stats()
    llm.loop = EngineLoop(llm.engine, state=llm.loop.state, overlap=True)
    overlapped = llm.generate(prompts, params, use_tqdm=False)
    stats = grammars.reset_stats()
    assert llm.loop.overlap_stats.kept > 0
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    assert all(isinstance(m, RemoteMatcher) for m in grammars._live.values())
    assert stats.num_fills > 0 and stats.num_waits > 0 and not local_fills
    assert {"advance", "wait"} <= {name for name, _ in calls}
    assert all(where == ("collect" if name == "advance" else "launch") for name, where in calls), calls
    for out in overlapped[1::2]:
        assert out.finish_reason == "stop" and json.loads(out.text) in ({"a": "x"}, {"a": "y"}, {}), out.text
    grammars.close()


def _marking(method: Any, name: str, inside: list[str]) -> Any:
    """``method`` that pushes ``name`` on ``inside`` while it runs."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        inside.append(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            inside.pop()

    return run


def _recording(method: Any, name: str, inside: list[str], calls: list[tuple[str, str]]) -> Any:
    """``method`` that records (``name``, the executor call it ran in) in ``calls``."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((name, inside[-1] if inside else ""))
        return method(self, *args, **kwargs)

    return run

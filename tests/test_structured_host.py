"""The host side of grammar-constrained rows: batched mask fills, the grammar thread's accept-then-fill, the one-copy
mask buffer, and the in-place mask kernel against its torch reference."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from fnvllm.executor.sampler import GrammarMask, HostGrammarMask, Sampler, apply_grammar_mask, prepare_sampling
from fnvllm.executor.structured import Grammars, Matcher, _chunks
from fnvllm.kernels.grammar_mask import mask_rows, mask_rows_ref
from fnvllm.state import SamplingParams, StructuredOutput

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the serve extra)")

VOCAB = 300  # not a multiple of 32: the last bitmask word is partly padding
STOP = 0
SCHEMA = StructuredOutput.json_schema(
    {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}
)


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    """Grammars over a small vocabulary: the stop token, byte tokens, then JSON-ish strings."""
    rng = random.Random(0)
    vocab = [b"<eos>"] + [bytes([i]) for i in range(32, 127)]
    while len(vocab) < VOCAB:
        vocab.append(bytes(rng.choice(b'abc{}[]":, 0123456789') for _ in range(rng.randint(2, 5))))
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[STOP])
    return Grammars(None, VOCAB, [STOP], tokenizer_info=info, num_threads=2)


def _matchers(grammars: Grammars, prefixes: list[str]) -> list[Matcher]:
    """One matcher of SCHEMA per prefix, advanced by that prefix."""
    out = []
    for prefix in prefixes:
        matcher = xgr.GrammarMatcher(grammars._compile(SCHEMA))
        assert matcher.accept_string(prefix)
        out.append(Matcher(matcher))
    return out


PREFIXES = ['{"name": "a', '{"name": "abc", "n": 1', "", '{"name": ""', '{"name": "x", "n": -']


def test_batched_fill_equals_one_fill_per_row(grammars: Grammars) -> None:
    """Grammars.masks (one batched xgrammar call on several threads, unconstrained rows skipped) gives each
    constrained row exactly its own matcher's fill_next_token_bitmask, and records the rows it applies to."""
    matchers = _matchers(grammars, PREFIXES)
    batch: list[Matcher | None] = [matchers[0], None, matchers[1], matchers[2], None, matchers[3], matchers[4]]
    host = grammars.masks(batch)
    assert host is not None and host.rows.tolist() == [0, 2, 3, 5, 6]
    expected = xgr.allocate_token_bitmask(len(matchers), VOCAB)
    for row, live in enumerate(matchers):
        live.matcher.fill_next_token_bitmask(expected, row)
    assert torch.equal(host.bitmask, expected)
    assert grammars.masks([None, None]) is None


def test_an_ended_grammar_allows_any_token(grammars: Grammars) -> None:
    """A row whose matcher already accepted the stop token (a dropped speculative row) allows every token."""
    (ended,) = _matchers(grammars, ['{"name": "a", "n": 1}'])
    assert ended.matcher.accept_token(STOP) and ended.matcher.is_terminated()
    (live,) = _matchers(grammars, ['{"name": "a'])
    host = grammars.masks([live, ended])
    assert host is not None and bool((host.bitmask[1] == -1).all()) and not bool((host.bitmask[0] == -1).all())


def _allowed(bitmask: torch.Tensor, row: int) -> list[int]:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


@pytest.mark.parametrize("workers", [1, 2])
def test_advance_accepts_then_fills_as_accept_and_masks_do(grammars: Grammars, workers: int) -> None:
    """Grammars.advance (on one grammar thread, or on two, each accepting and filling its chunk of the rows)
    leaves the matchers and the next masks exactly as accept followed by masks, and once waited for it forgets the
    matchers whose grammar ended."""
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=grammars.tokenizer_info, num_threads=2, num_workers=workers)
    ids = ["a", "b", "c"]
    threaded = _matchers(grammars, ['{"name": "abc", "n": 12}', '{"name": "a', '{"name": "a", "n": 1'])
    inline = _matchers(grammars, ['{"name": "abc", "n": 12}', '{"name": "a', '{"name": "a", "n": 1'])
    grammars._live.update({"a": threaded[0], "b": threaded[1]})
    first = grammars.masks(inline)
    assert first is not None
    tokens = [STOP, _allowed(first.bitmask, 1)[-1], _allowed(first.bitmask, 2)[0]]
    pending = grammars.advance(ids, threaded, tokens, threaded)
    assert pending is not None
    grammars.accept(ids, inline, tokens)
    after = grammars.masks(inline)
    host = grammars.wait(pending)
    assert after is not None and torch.equal(host.bitmask, after.bitmask)
    assert [m.accepted for m in threaded] == [m.accepted for m in inline] == [1, 1, 1]
    assert threaded[0].matcher.is_terminated() and "a" not in grammars._live and "b" in grammars._live
    grammars.prune(())


def test_host_mask_buffer_holds_bitmask_and_rows_for_one_copy() -> None:
    """HostGrammarMask: the (R, W) bitmask and the int64 rows are views of one int32 buffer, and upload keeps them."""
    host = HostGrammarMask.allocate([4, 9, 1_000_000], words=3, pinned=False)
    host.bitmask.copy_(torch.arange(9, dtype=torch.int32).view(3, 3))
    assert host.rows.tolist() == [4, 9, 1_000_000] and host.bitmask.data_ptr() == host.flat.data_ptr()
    mask = host.upload("cpu", scratch=True)
    assert mask.rows.tolist() == [4, 9, 1_000_000] and mask.rows.dtype == torch.int64 and mask.scratch
    assert torch.equal(mask.bitmask, torch.arange(9, dtype=torch.int32).view(3, 3))
    assert torch.equal(GrammarMask.upload(host.bitmask, [4, 9, 1_000_000], "cpu").bitmask, mask.bitmask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [37, 300])
def test_mask_kernel_matches_its_reference(dtype: torch.dtype, vocab: int) -> None:
    """mask_rows (Triton: on the GPU, or in the interpreter) writes exactly what mask_rows_ref writes, in place,
    and leaves the unconstrained rows alone."""
    generator = torch.Generator().manual_seed(vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = (torch.randn(5, vocab, generator=generator) * 3).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, (vocab + 31) // 32), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    rows = torch.tensor([3, 1])
    value = max(-1e30, torch.finfo(dtype).min)
    expected = logits.clone()
    mask_rows_ref(expected, bitmask, rows, value)
    out = logits.clone().to(device)
    mask_rows(out, bitmask.to(device), rows.to(device), value)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(expected[[0, 2, 4]], logits[[0, 2, 4]]) and not torch.equal(expected[1], logits[1])


def test_scratch_logits_are_masked_in_place_unless_a_row_asks_for_logprobs() -> None:
    """A scratch GrammarMask masks the sampler's input itself; with a logprobs row the input stays raw (and the
    logprobs are those of the raw logits), and a plain mask never touches the input."""
    logits = torch.arange(2 * 40, dtype=torch.float32).view(2, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    before = logits.clone()
    assert torch.equal(apply_grammar_mask(logits, GrammarMask(bitmask, torch.tensor([1]))), _masked(before))
    assert torch.equal(logits, before)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1)]
    batch = prepare_sampling(params, [0, 0], [None, None], 40, "cpu")
    scratch = GrammarMask(bitmask, torch.tensor([1]), scratch=True)
    out = Sampler().sample(logits, _with_mask(batch, scratch))
    assert out.token_ids.tolist() == [39, 35] and torch.equal(logits, before)
    assert out.logprobs is not None and out.logprobs.top_ids.tolist() == [[39]]
    out = Sampler().sample(logits, _with_mask(prepare_sampling(params[:1] * 2, [0, 0], [None] * 2, 40, "cpu"), scratch))
    assert out.token_ids.tolist() == [39, 35] and torch.equal(logits, _masked(before))


def _masked(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (2, 40) with row 1 masked to token 35."""
    out = logits.clone()
    out[1, :35] = -1e30
    out[1, 36:] = -1e30
    return out


def _with_mask(batch: object, mask: GrammarMask) -> object:
    import attrs

    return attrs.evolve(batch, grammar_mask=mask)


def test_cancel_never_raises_and_restores_the_switch_interval(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grammars.cancel (a dropped step) waits for the worker without raising what it raised, and the GIL switch
    interval lowered by advance is back to what it was; a successful advance still forgets its ended matchers."""
    before = sys.getswitchinterval()
    (live,) = _matchers(grammars, ['{"name": "a'])
    with monkeypatch.context() as patch:
        patch.setattr(grammars, "_fill", lambda *_: 1 / 0)  # the worker raises
        broken = grammars.advance(["a"], [live], [ord("b") - 31], [live])
        assert broken is not None and sys.getswitchinterval() < before
        grammars.cancel(broken)
    assert sys.getswitchinterval() == before
    (done,) = _matchers(grammars, ['{"name": "a", "n": 1}'])
    grammars._live["d"] = done
    pending = grammars.advance(["d"], [done], [STOP], [live])
    assert pending is not None
    grammars.cancel(pending)
    assert "d" not in grammars._live and sys.getswitchinterval() == before


def test_chunks_keep_each_accept_before_its_own_fill(grammars: Grammars) -> None:
    """advance's chunks: each chunk accepts the tokens of the matchers it fills (so a matcher accepts before its
    mask is filled), and accepts of matchers with nothing to fill go to the first chunk."""
    a, b, c, d = _matchers(grammars, ["", "", "", ""])
    accepts = [("a", a, 1), ("b", b, 2), ("c", c, 3)]
    chunks = _chunks(accepts, [(0, b), (1, c), (2, d)], 2)
    assert chunks == [([("b", b, 2), ("c", c, 3), ("a", a, 1)], [(0, b), (1, c)]), ([], [(2, d)])]
    assert _chunks(accepts, [(0, d)], 4) == [(accepts, [(0, d)])]


def test_two_engines_restore_the_original_switch_interval(grammars: Grammars) -> None:
    """Two Grammars whose advances overlap (two engines in one process) put the original GIL switch interval back
    once both have waited, whichever waits first."""
    before = sys.getswitchinterval()
    other = Grammars(None, VOCAB, [STOP], tokenizer_info=grammars.tokenizer_info, num_threads=1)
    (a,) = _matchers(grammars, ['{"name": "a'])
    (b,) = _matchers(other, ['{"name": "a'])
    token = ord("b") - 31
    first, second = grammars.advance(["a"], [a], [token], [a]), other.advance(["b"], [b], [token], [b])
    assert first is not None and second is not None
    grammars.wait(first)
    assert sys.getswitchinterval() < before
    other.wait(second)
    assert sys.getswitchinterval() == before


def test_stats_count_fills_accepts_and_waits(grammars: Grammars) -> None:
    """Grammars.stats counts each fill and the rows it filled (an ended row is not filled), the accepts' time and
    each wait for a mask of advance; reset_stats hands them back and counts from zero again."""
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=grammars.tokenizer_info, num_threads=2)
    live, other, ended = _matchers(grammars, ['{"name": "a', '{"name": "a", "n": 1', '{"name": "a", "n": 1}'])
    assert ended.matcher.accept_token(STOP)
    grammars.masks([live, None, other, ended])
    pending = grammars.advance(["a", "b"], [live, other], [ord("b") - 31, STOP], [live])
    assert pending is not None
    grammars.wait(pending)
    stats = grammars.reset_stats()
    assert (stats.num_fills, stats.rows_filled, stats.num_waits) == (2, 3, 1)
    assert stats.fill_s > 0 and stats.accept_s > 0 and stats.wait_s >= 0
    assert grammars.stats.num_fills == grammars.stats.rows_filled == grammars.stats.num_waits == 0


def test_a_small_fill_starts_few_threads(grammars: Grammars) -> None:
    """A batched fill uses at most one xgrammar thread per ROWS_PER_FILL_THREAD rows (xgrammar starts its threads
    at every call), and never more than num_threads; the masks are the same whatever the thread count."""
    grammars = Grammars(None, VOCAB, [STOP], tokenizer_info=grammars.tokenizer_info, num_threads=8)
    matchers = _matchers(grammars, PREFIXES * 4)
    masks = [grammars.masks(matchers[:n]) for n in (2, 5, 20)]
    assert sorted(threads for _, threads in grammars._batches) == [1, 2, 8]
    assert all(mask is not None for mask in masks)
    assert torch.equal(masks[0].bitmask, masks[2].bitmask[:2]) and torch.equal(masks[1].bitmask, masks[2].bitmask[:5])

"""``SamplingMemo``: a decode step given the previous step's very params tuple reuses its SamplingBatch, and only
batches that depend on the params alone are kept."""

from __future__ import annotations

import torch

from fnvllm.executor.sampler import Sampler, SamplingMemo, prepare_sampling
from fnvllm.state import SamplingParams
from fnvllm.state.plan import TokenHistory

VOCAB = 32


def _prepare(params: tuple[SamplingParams, ...], memo: SamplingMemo, generated: int = 0) -> object:
    """One step's batch for ``params`` through ``memo`` (no histories: no penalised rows unless given)."""
    histories = [TokenHistory((1, 2), (3,)) if p.needs_history else None for p in params]
    return prepare_sampling(params, [generated] * len(params), histories, VOCAB, "cpu", memo=memo)


def test_same_params_object_reuses_the_batch() -> None:
    """The same params tuple gets the very batch back; an equal but distinct tuple, or another vocabulary, builds a
    new one (and that one is then kept)."""
    memo = SamplingMemo()
    params = (SamplingParams(temperature=0.6, top_k=5), SamplingParams(temperature=0.6, logprobs=2))
    first = _prepare(params, memo)
    assert _prepare(params, memo) is first
    other = tuple(params)[:1] + tuple(params)[1:]
    assert other == params and other is not params
    second = _prepare(other, memo)
    assert second is not first and _prepare(other, memo) is second
    wider = prepare_sampling(other, [0, 0], [None, None], VOCAB + 1, "cpu", memo=memo)
    assert wider is not second and wider.vocab_size == VOCAB + 1


def test_seeded_or_penalised_batches_are_not_kept() -> None:
    """A seeded row's uniforms depend on its count of generated tokens and a penalised row's penalties on its
    tokens, so such batches are rebuilt every step: a later count gives other uniforms."""
    memo = SamplingMemo()
    seeded = (SamplingParams(temperature=0.6, seed=3), SamplingParams(temperature=0.6))
    first = _prepare(seeded, memo, generated=0)
    later = _prepare(seeded, memo, generated=1)
    assert later is not first and not torch.equal(first.uniforms, later.uniforms)  # type: ignore[attr-defined]
    penalised = (SamplingParams(temperature=0.6, repetition_penalty=1.2),)
    assert _prepare(penalised, memo) is not _prepare(penalised, memo)


def test_reused_batch_samples_what_a_fresh_one_samples() -> None:
    """Sampling from the kept batch gives the tokens a freshly prepared batch gives, for the same logits and key."""
    params = tuple(SamplingParams(temperature=0.8, top_p=0.9, logprobs=1) for _ in range(4))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    memo = SamplingMemo()
    _prepare(params, memo)
    kept = _prepare(params, memo)
    fresh = prepare_sampling(params, [0] * 4, [None] * 4, VOCAB, "cpu")
    got = Sampler(seed=5, kernels=False).sample(logits, kept)  # type: ignore[arg-type]
    want = Sampler(seed=5, kernels=False).sample(logits, fresh)
    assert torch.equal(got.packed, want.packed)
    assert got.logprobs is not None and want.logprobs is not None
    assert torch.equal(got.logprobs.top_ids, want.logprobs.top_ids)

"""Logprobs in two launches into one packed tensor (``fnvllm.kernels.sampling.logprob_top``) against its torch
reference, its kept device scratch (``SamplingScratch``), and the packed tensor's host views (``Logprobs``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fnvllm.executor.sampler import Logprobs, Sampler, compute_logprobs, prepare_sampling
from fnvllm.kernels.sampling import SamplingScratch, logprob_top, logprob_top_ref
from fnvllm.state import SamplingParams
from fnvllm.state.plan import TokenHistory

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random logits (rows, vocab) on DEVICE."""
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4).to(DEVICE, dtype)


def _assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """Values and sampled logprobs close, ids equal (and int64)."""
    torch.testing.assert_close(got[0].cpu(), want[0].cpu())
    assert got[1].dtype == torch.int64 and torch.equal(got[1].cpu(), want[1].cpu())
    torch.testing.assert_close(got[2].cpu(), want[2].cpu())


@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_top", [0, 1, 3, 5])
def test_logprob_top_equals_its_reference(num_top: int, rows_dtype: torch.dtype) -> None:
    """Top-n logprobs, their ids and the sampled token's logprob of some rows equal the reference (a vocabulary
    ending in a partial chunk whose best tokens sit in it, n 0 included)."""
    logits = _logits(5, 1000, seed=num_top)
    logits[2, 990:] = 50.0 + torch.arange(10, dtype=logits.dtype, device=DEVICE)  # the best tokens in the last chunk
    rows = torch.tensor([4, 0, 2], dtype=rows_dtype, device=DEVICE)
    tokens = torch.tensor([1, 2, 995, 4, 999], dtype=torch.int64, device=DEVICE)
    values, ids, sampled, packed = logprob_top(logits, rows, num_top, 64, tokens)
    _assert_same((values, ids, sampled), logprob_top_ref(logits, rows, num_top, tokens))
    assert values.shape == ids.shape == (3, num_top) and packed.dtype == torch.uint8
    assert 3 * (12 * num_top + 4) <= packed.numel() <= 3 * (12 * num_top + 4) + 30  # the three outputs, padded
    for part in (values, ids, sampled):
        assert part.data_ptr() - packed.data_ptr() + part.numel() * part.element_size() <= packed.numel()


# the parts' offsets depend on rows * num_top modulo 4: 1 (5 gave the same offsets as 1) and 20 (a multiple of 4)
@pytest.mark.parametrize("num_top", [1, 20])
def test_logprob_and_chunk_scratch_views_start_16_byte_aligned_at_every_row_count(num_top: int) -> None:
    """The views the kernels write through (logprob_top's three packed outputs, the scratch's chunk argmax) start
    at 16-byte offsets for every row count, so a batch size never makes Triton compile another variant mid-run."""
    logits = _logits(9, 1300, seed=num_top)
    tokens = torch.arange(9, dtype=torch.int64, device=DEVICE)
    scratch, device = SamplingScratch(), torch.device(DEVICE)
    for num_rows in range(1, 10):
        rows = torch.arange(num_rows, dtype=torch.int32, device=DEVICE)
        values, ids, sampled, packed = logprob_top(logits, rows, num_top, 64, tokens, scratch)
        assert [(t.data_ptr() - packed.data_ptr()) % 16 for t in (ids, values, sampled)] == [0, 0, 0]
        for num_chunks in (1, 3, 21):
            stats, argmax = scratch.chunk_stats(num_rows, num_chunks, device)
            assert (argmax.data_ptr() - stats.data_ptr()) % 16 == 0
            assert argmax.data_ptr() >= stats.data_ptr() + stats.numel() * 4  # no overlap
        _assert_same((values, ids, sampled), logprob_top_ref(logits, rows, num_top, tokens))


def test_logprob_top_breaks_ties_by_the_lowest_id() -> None:
    """Equal logits across chunks and inside one come out lowest id first (as the stable reference)."""
    logits = torch.zeros(2, 512, device=DEVICE)
    logits[0, [400, 7, 300]] = 9.0  # three equal bests in three chunks
    logits[1, [40, 33]] = 5.0  # two in one chunk
    logits[1, 200] = 6.0
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([7, 33], device=DEVICE)
    values, ids, sampled, _ = logprob_top(logits, rows, 4, 32, tokens)
    assert ids.tolist() == [[7, 300, 400, 0], [200, 33, 40, 0]]
    _assert_same((values, ids, sampled), logprob_top_ref(logits, rows, 4, tokens))


def test_logprob_top_reads_bf16_logits() -> None:
    """bf16 logits (the model's dtype; many ties) give the reference's float32 logprobs and ids."""
    logits = _logits(4, 2048, seed=7, dtype=torch.bfloat16)
    rows = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([5, 6, 7, 8], device=DEVICE)
    got = logprob_top(logits, rows, 5, 128, tokens)[:3]
    _assert_same(got, logprob_top_ref(logits, rows, 5, tokens))


def test_logprob_top_rejects_more_tops_than_chunks() -> None:
    """num_top above the chunks is a ValueError naming the allowed range."""
    logits = _logits(2, 256, seed=1)
    rows = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"num_top must be in \[0, 4\]"):
        logprob_top(logits, rows, 5, 64, torch.zeros(2, dtype=torch.int64, device=DEVICE))


def test_scratch_is_kept_for_the_same_sizes_and_regrown_for_others() -> None:
    """The scratch hands out the same tensors for the same sizes, other ones (grown) for larger sizes, and the
    results stay the reference's through a growth and back (the zero scales are never overwritten)."""
    scratch = SamplingScratch()
    device = torch.device(DEVICE)
    first = (*scratch.chunk_stats(2, 16, device), scratch.zeros(4, device), scratch.drawn(4, device))
    again = (*scratch.chunk_stats(2, 16, device), scratch.zeros(4, device), scratch.drawn(4, device))
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert [tuple(t.shape) for t in first] == [(3, 2, 16), (2, 16), (4,), (3, 4)]
    assert first[1].dtype == torch.int32 and first[3].data_ptr() != first[0].data_ptr()
    tokens = torch.tensor([3, 1, 4, 1, 5, 9], device=DEVICE)
    small, large = _logits(6, 1000, seed=2), _logits(6, 1000, seed=3)
    few = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    every = torch.arange(6, dtype=torch.int32, device=DEVICE)
    for logits, rows in ((small, few), (large, every), (small, few)):
        got = logprob_top(logits, rows, 3, 64, tokens, scratch)[:3]
        _assert_same(got, logprob_top_ref(logits, rows, 3, tokens))
    assert bool((scratch.zeros(6, device) == 0).all())


def test_host_views_split_a_copy_of_the_packed_tensor() -> None:
    """A copy of ``Logprobs.packed`` (as the executor's one device -> host copy makes) splits into tensors equal to
    the three device views; without ``packed`` the three copies are taken as they are."""
    logits = _logits(3, 600, seed=4)
    rows = torch.tensor([0, 2], dtype=torch.int64, device=DEVICE)
    tokens = torch.tensor([10, 20, 30], device=DEVICE)
    lp = compute_logprobs(logits, tokens, rows, 2, kernels=True, scratch=SamplingScratch())
    assert lp.packed is not None and lp.copied() == (lp.packed,)
    host = lp.host_views([lp.packed.cpu().clone()])
    for got, want in ((host.top_logprobs, lp.top_logprobs), (host.top_ids, lp.top_ids)):
        assert got.dtype == want.dtype and torch.equal(got, want.cpu())
    assert torch.equal(host.sampled_logprobs, lp.sampled_logprobs.cpu())
    plain = compute_logprobs(logits, tokens, rows, 2, kernels=False)
    assert plain.packed is None and len(plain.copied()) == 3
    again = plain.host_views(plain.copied())
    assert again.top_ids is plain.top_ids and isinstance(again, Logprobs)


def test_sampler_keeps_one_scratch_and_matches_the_references() -> None:
    """Two kernel samples of a logprobs batch reuse one scratch, and each equals the references' logprobs."""
    vocab = 2000
    params = [SamplingParams(temperature=0.7, logprobs=3, seed=i) for i in range(3)] + [SamplingParams(seed=5)]
    batch = prepare_sampling(params, [0] * 4, [None] * 4, vocab, DEVICE)
    sampler, scratches = Sampler(kernels=True), []
    for seed in (1, 2):
        logits = _logits(4, vocab, seed=seed)
        got = sampler.sample(logits, batch).logprobs
        want = Sampler(kernels=False).sample(logits, batch).logprobs
        assert got is not None and want is not None and got.packed is not None
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs)
        assert torch.equal(got.top_ids, want.top_ids)
        torch.testing.assert_close(got.sampled_logprobs, want.sampled_logprobs)
        scratches.append(sampler._scratch)
    assert scratches[0] is not None and scratches[1] is scratches[0]


def test_logprobs_alone_keep_one_scratch_as_the_decode_graphs_call_them() -> None:
    """``Sampler.logprobs`` without an eager ``sample`` before it (a step the decode graphs sampled) makes the
    sampler's scratch once and reuses it, and gives the references' logprobs each step."""
    vocab = 2000
    rows = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([5, 6, 7], dtype=torch.int64, device=DEVICE)
    sampler, scratches = Sampler(kernels=True), []
    for seed in (3, 4):
        logits = _logits(3, vocab, seed=seed)
        got = sampler.logprobs(logits, tokens, rows, 4)
        want = Sampler(kernels=False).logprobs(logits, tokens, rows, 4)
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs)
        assert torch.equal(got.top_ids, want.top_ids)
        torch.testing.assert_close(got.sampled_logprobs, want.sampled_logprobs)
        scratches.append(sampler._scratch)
    assert scratches[0] is not None and scratches[1] is scratches[0]
    assert Sampler(kernels=False).logprobs(_logits(3, vocab, seed=5), tokens, rows, 4).packed is None


def test_one_sampler_keeps_its_scratch_across_batch_shapes() -> None:
    """A sampler whose scratch served other shapes before (plain, penalised and top-k rows, logprobs, fewer rows)
    draws each batch's tokens and logprobs as a fresh sampler does (seeded rows: the same uniforms)."""
    vocab = 512
    shapes = [
        [SamplingParams(temperature=0.8, seed=i) for i in range(4)],
        [SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, seed=i, logprobs=2) for i in range(3)],
        [SamplingParams(temperature=0.5, seed=9, logprobs=4), SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=0.8, seed=i) for i in range(4)],
    ]
    kept = Sampler(kernels=True)
    for k, params in enumerate(shapes):
        n = len(params)
        histories = [TokenHistory(prompt=(1, 2), output=(3,))] * n
        batch = prepare_sampling(params, [3] * n, histories, vocab, DEVICE)
        logits = _logits(n, vocab, seed=20 + k)
        got, want = kept.sample(logits, batch), Sampler(kernels=True).sample(logits, batch)
        assert torch.equal(got.packed, want.packed)
        if want.logprobs is not None:
            assert got.logprobs is not None  # the three parts equal (the packed tensor's padding is not written)
            a, b = got.logprobs, want.logprobs
            assert torch.equal(a.top_logprobs, b.top_logprobs) and torch.equal(a.top_ids, b.top_ids)
            assert torch.equal(a.sampled_logprobs, b.sampled_logprobs)


def test_sampler_ops_counts_fewer_host_ops_than_round_one() -> None:
    """``benchmarks/host_step.py --sampler-ops`` checks logprob_top against the reference and counts fewer
    allocations, torch ops and Triton launches for the logprobs now than round 1's path, and half the copies."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():  # on a GPU the script's 256 x 151,936 logits need the compiled kernels
        env["TRITON_INTERPRET"] = "1"
    script = str(root / "benchmarks" / "host_step.py")
    result = subprocess.run(
        [sys.executable, script, "--sampler-ops", "1"], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ids equal" in result.stdout
    rows = {line[:34].strip(): line[34:].split() for line in result.stdout.splitlines()}
    now, old = rows["compute_logprobs (now)"], rows["compute_logprobs (round 1)"]
    assert all(int(now[k]) < int(old[k]) for k in (0, 1, 3))  # aten ops, allocations, Triton launches
    assert "host copy now (2 tensors)" in rows and "host copy round 1 (4 tensors)" in rows

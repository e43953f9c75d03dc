"""``sample_rows_graphed`` (the form of ``sample_rows`` a decode CUDA graph captures, fnvllm/kernels/sampling.py):
for the same logits, settings and seed it gives ``sample_rows``' tokens, flags and uniforms for the live rows, and
writes nothing for a bucket's padding rows; the live row count and the seed are read from device memory."""

from __future__ import annotations

import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.kernels.sampling import (  # noqa: E402  (after the guard: it picks the interpreter)
    RowSampling,
    SamplingScratch,
    sample_rows,
    sample_rows_graphed,
)

VOCAB, BUCKET, CHUNK = 300, 8, 64  # 5 chunks a row, the last one partial


def _settings(n: int, seed_rows: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """(scale, fixed, uniforms) for BUCKET rows: row 0 greedy, the others at temperatures 0.5-1.5; ``seed_rows``
    take a fixed uniform; rows >= n hold garbage a padding row might hold."""
    g = torch.Generator().manual_seed(n)
    scale = 1.0 / (0.5 + torch.rand(BUCKET, generator=g))
    scale[0] = 0.0
    fixed = torch.zeros(BUCKET, dtype=torch.int32)
    fixed[list(seed_rows)] = 1
    uniforms = torch.rand(BUCKET, generator=g)
    scale[n:], uniforms[n:] = 7.0, 2.0
    return tuple(t.to(DEVICE) for t in (scale.float(), fixed, uniforms.float()))


@pytest.mark.parametrize(("n", "seed", "seed_rows"), [(BUCKET, 12345, ()), (5, 7, (1, 3)), (1, 2**31 - 1, (0,))])
def test_graphed_rows_sample_what_sample_rows_samples(n: int, seed: int, seed_rows: tuple[int, ...]) -> None:
    logits = torch.randn(BUCKET, VOCAB, generator=torch.Generator().manual_seed(seed % 97)).to(DEVICE) * 3
    logits[2, 17] = float("nan")  # a broken row is flagged on both paths
    scale, fixed, uniforms = _settings(n, seed_rows)

    expected = RowSampling(
        scale=scale[:n], fixed=fixed[:n], uniforms=uniforms[:n],
        drawn=torch.empty((3, n), device=DEVICE), out=torch.empty((2, n), dtype=torch.int64, device=DEVICE),
    )  # fmt: skip
    sample_rows(logits[:n], expected, seed, chunk=CHUNK)

    sentinel = -5
    out = torch.full((2 * BUCKET,), sentinel, dtype=torch.int64, device=DEVICE)
    live = torch.tensor([n, seed], dtype=torch.int32, device=DEVICE)
    scratch = SamplingScratch()
    sample_rows_graphed(logits, scale, fixed, uniforms, live, out, scratch, chunk=CHUNK)

    assert out[: 2 * n].view(2, n).tolist() == expected.out.tolist()
    assert (out[2 * n :] == sentinel).all(), "padding rows must store nothing"
    drawn = scratch.drawn(BUCKET, logits.device).reshape(-1)[: 3 * n].view(3, n)  # the same buffer (same device)
    assert torch.equal(drawn[0], expected.drawn[0])  # the uniforms: fixed ones, and Philox keyed by the loaded seed
    if n > 2:
        assert out[n + 2].item() == 1 and out[2].item() != sentinel


def test_no_live_rows_store_nothing() -> None:
    logits = torch.randn(BUCKET, VOCAB).to(DEVICE)
    scale, fixed, uniforms = _settings(0)
    out = torch.full((2 * BUCKET,), -5, dtype=torch.int64, device=DEVICE)
    live = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    sample_rows_graphed(logits, scale, fixed, uniforms, live, out, SamplingScratch(), chunk=CHUNK)
    assert (out == -5).all()


def test_graphed_arguments_are_checked() -> None:
    logits = torch.randn(BUCKET, VOCAB).to(DEVICE)
    scale, fixed, uniforms = _settings(BUCKET)
    out = torch.empty(2 * BUCKET, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="live must be a \\(2,\\) int32"):
        sample_rows_graphed(logits, scale, fixed, uniforms, torch.zeros(2, dtype=torch.int64, device=DEVICE), out,
                            SamplingScratch(), chunk=CHUNK)  # fmt: skip
    with pytest.raises(ValueError, match="out must be a \\(16,\\) int64"):
        sample_rows_graphed(logits, scale, fixed, uniforms, torch.zeros(2, dtype=torch.int32, device=DEVICE),
                            out[:4], SamplingScratch(), chunk=CHUNK)  # fmt: skip


FILTER_VOCAB = 600  # 10 chunks of CHUNK: top-k up to 10 takes the segments


@pytest.mark.parametrize("n", [BUCKET, 3])
def test_graphed_filter_redraws_what_segmented_pick_draws(n: int) -> None:
    """sample_rows_graphed then segmented_pick_graphed over the whole bucket: the live rows with a top-k (with and
    without top-p / min-p; flat rows whose candidates overflow a segment take the per-row path) draw what
    sample_rows + segmented_pick over those rows draw; the other live rows keep sample_rows' token; padding rows
    store nothing."""
    from fnvllm.kernels.sampling_segments import segmented_pick, segmented_pick_graphed

    g = torch.Generator().manual_seed(n)
    logits = torch.randn(BUCKET, FILTER_VOCAB, generator=g) * 2
    logits[1] = torch.randn(FILTER_VOCAB, generator=g) * 1e-3  # nearly flat: more candidates than a segment holds
    logits = logits.to(DEVICE)
    scale, fixed, uniforms = _settings(n, seed_rows=(2,))
    top_k = torch.tensor([0, 7, 3, 0, 10, 1, 5, 0], dtype=torch.int32)  # rows 0 (greedy) and 3, 7: no filter
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.05, 0.0])
    top_k, top_p, min_p = (t.to(DEVICE) for t in (top_k, top_p, min_p))
    seed = 99

    expected = RowSampling(
        scale=scale[:n], fixed=fixed[:n], uniforms=uniforms[:n],
        drawn=torch.empty((3, n), device=DEVICE), out=torch.empty((2, n), dtype=torch.int64, device=DEVICE),
    )  # fmt: skip
    stats = sample_rows(logits[:n], expected, seed, chunk=CHUNK)
    unfiltered = expected.out.clone()
    filtered = torch.tensor([i for i in range(n) if top_k[i] >= 1], dtype=torch.int32, device=DEVICE)
    settings = (scale[:n], top_k[:n], top_p[:n], min_p[:n], expected.drawn, expected.out)
    segmented_pick(logits[:n], filtered, filtered, filtered, stats, *settings, chunk=CHUNK)

    sentinel = -5
    out = torch.full((2 * BUCKET,), sentinel, dtype=torch.int64, device=DEVICE)
    live = torch.tensor([n, seed], dtype=torch.int32, device=DEVICE)
    scratch = SamplingScratch()
    sample_rows_graphed(logits, scale, fixed, uniforms, live, out, scratch, chunk=CHUNK)
    graph_stats, _ = scratch.chunk_stats(BUCKET, FILTER_VOCAB // CHUNK + 1, logits.device)
    drawn = scratch.drawn(BUCKET, logits.device)
    rows = torch.arange(BUCKET, dtype=torch.int32, device=DEVICE)
    segmented_pick_graphed(logits, rows, graph_stats, scale, top_k, top_p, min_p, drawn, out, live, chunk=CHUNK)

    assert out[: 2 * n].view(2, n).tolist() == expected.out.tolist()
    assert (out[2 * n :] == sentinel).all(), "padding rows must store nothing"
    redrawn = [i for i in filtered.tolist() if unfiltered[0, i] != expected.out[0, i]]
    assert redrawn, "some filtered row must draw another token than its unfiltered draw (else nothing is tested)"

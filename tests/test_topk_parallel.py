"""The parallel top-k path (fnvllm/kernels/sampling_segments.py): the candidate pass on a (rows, chunks) grid and the
per-row draw from the segments give exactly the tokens of the torch reference and of ``filtered_pick`` for the same
uniforms, including the rows it hands to the per-row fallback (a chunk overflowing its segment, a top-k above the
chunk count, no top-k). Tiny shapes: on CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from fnvllm.kernels import sampling, sampling_filters
from fnvllm.kernels.sampling_segments import segmented_pick

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _settings(num_rows: int, vocab: int, ks: list[int], ps: list[float], mins: list[float]) -> dict[str, torch.Tensor]:
    """Per-row scale (from a seeded generator), top_k, top_p and min_p cycling through the given lists."""
    index = torch.arange(num_rows)
    scale = 1.0 / (torch.rand(num_rows, generator=torch.Generator().manual_seed(num_rows)) * 2 + 0.2)
    return {
        "scale": scale.float(),
        "top_k": torch.tensor(ks)[index % len(ks)].clamp(max=vocab),
        "top_p": torch.tensor(ps)[index % len(ps)].float(),
        "min_p": torch.tensor(mins)[index % len(mins)].float(),
    }


def _draw(logits: torch.Tensor, settings: dict[str, torch.Tensor], uniforms: torch.Tensor, segment: int | None,
          chunk: int = 64) -> list[int]:  # fmt: skip
    """Tokens of every row by segmented_pick (segment given) or filtered_pick (None), after sample_rows."""
    num_rows = logits.shape[0]
    on = {k: v.to(DEVICE) for k, v in settings.items()}
    state = sampling.RowSampling(
        scale=on["scale"],
        fixed=torch.ones(num_rows, dtype=torch.int32, device=DEVICE),
        uniforms=uniforms.float().to(DEVICE),
        drawn=torch.empty((3, num_rows), device=DEVICE),
        out=torch.full((2, num_rows), -1, dtype=torch.int64, device=DEVICE),
    )
    stats = sampling.sample_rows(logits, state, seed=0, chunk=chunk)
    rows = torch.arange(num_rows, device=DEVICE, dtype=torch.int32)
    args = (logits, rows, rows, rows, stats, on["scale"], on["top_k"], on["top_p"], on["min_p"], state.drawn)
    if segment is None:
        sampling_filters.filtered_pick(*args, state.out, chunk=chunk, block=32)
    else:
        segmented_pick(*args, state.out, chunk=chunk, segment=segment, block=32)
    return state.out[0].tolist()


def _reference(logits: torch.Tensor, settings: dict[str, torch.Tensor], uniforms: torch.Tensor) -> list[int]:
    s = settings
    args = (logits.cpu(), s["scale"], s["top_k"], s["top_p"], s["min_p"], uniforms.cpu())
    return sampling_filters.filtered_sample_ref(*args).tolist()


@pytest.mark.parametrize("segment", [16, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_draw_the_reference_and_filter_kernel_tokens(dtype: torch.dtype, segment: int) -> None:
    """Random rows over five 64-token chunks, top-k with and without top-p and min-p (k up to and above the chunk
    count): the same tokens as the reference and as filtered_pick for the same uniforms, whether the segments hold
    every candidate (16) or many rows overflow and fall back (2)."""
    logits = (torch.randn(12, 300, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).to(DEVICE)
    settings = _settings(12, 300, [1, 2, 3, 5, 4, 7], [1.0, 0.9, 0.5, 1.0, 0.95, 0.3], [0.0, 0.0, 0.05, 0.2])
    for seed in (5, 6):
        uniforms = torch.rand(12, generator=torch.Generator().manual_seed(seed))
        want = _reference(logits, settings, uniforms)
        assert _draw(logits, settings, uniforms, segment) == want
        assert _draw(logits, settings, uniforms, None) == want


def test_flat_rows_full_of_ties() -> None:
    """bf16 rows of a random-weight checkpoint's spread (std 0.64: many equal logits) at top_k 3 / top_p 0.95 draw
    the reference's tokens at uniforms across (0, 1)."""
    logits = (torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) * 0.64).bfloat16().to(DEVICE)
    settings = _settings(16, 256, [3, 4, 2], [0.95, 1.0], [0.0])
    settings["scale"] = torch.full((16,), 1 / 0.6)
    uniforms = torch.linspace(0.02, 0.98, 16)
    assert _draw(logits, settings, uniforms, 4) == _reference(logits, settings, uniforms)


def test_a_chunk_with_more_candidates_than_its_segment_falls_back() -> None:
    """Ten tied maxima in one chunk and a segment of 4: drawing from the truncated segment would pick one of the
    first four ties; the row falls back to the per-row path and draws the reference's late tie."""
    row = torch.full((256,), -1.0)
    row[10:20] = 2.0  # ten ties in chunk 0, the row's best
    row[70], row[130], row[200] = 1.0, 1.5, 0.5  # the other chunks' maxima: the floor (k 2) is 1.5
    logits = row.expand(3, -1).contiguous().to(DEVICE)
    settings = _settings(3, 256, [2, 3, 4], [1.0], [0.0])
    settings["scale"] = torch.ones(3)
    uniforms = torch.tensor([0.95, 0.75, 0.55])
    want = _reference(logits, settings, uniforms)
    assert all(14 <= token < 20 for token in want)  # late ties, beyond a 4-slot segment (tokens 10-13)
    assert _draw(logits, settings, uniforms, 4) == want
    assert _draw(logits, settings, uniforms, 16) == want


def test_top_k_above_the_chunk_count_and_rows_without_top_k() -> None:
    """A top-k larger than the chunk count (no floor from the chunk maxima) and top-p / min-p rows without a top-k
    take the per-row path inside the same launch and still draw the reference's tokens."""
    logits = (torch.randn(6, 200, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)  # 4 chunks
    settings = _settings(6, 200, [9, 0, 150, 0, 4, 60], [1.0, 0.8, 0.9, 1.0, 0.7, 1.0], [0.0, 0.0, 0.0, 0.1])
    uniforms = torch.rand(6, generator=torch.Generator().manual_seed(4))
    assert _draw(logits, settings, uniforms, 8) == _reference(logits, settings, uniforms)


def test_segmented_pick_rejects_bad_arguments() -> None:
    """A segment that is not a power of two, stats of another chunking and mismatched row lists raise ValueError
    naming them."""
    logits = torch.zeros(2, 10, device=DEVICE)
    rows = torch.arange(2, device=DEVICE)
    stats = torch.zeros((3, 2, 1), device=DEVICE)
    f32 = torch.ones(2, device=DEVICE)
    k = torch.ones(2, dtype=torch.int64, device=DEVICE)
    tail = (f32, k, f32, f32, torch.ones((3, 2), device=DEVICE), torch.zeros((2, 2), dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="segment"):
        segmented_pick(logits, rows, rows, rows, stats, *tail, segment=12)
    with pytest.raises(ValueError, match="stats"):
        segmented_pick(logits, rows, rows, rows, stats, *tail, chunk=4)
    with pytest.raises(ValueError, match="rows, sources and programs"):
        segmented_pick(logits, rows, rows[:1], rows, stats, *tail)

"""The parallel top-k path (fnvllm/kernels/sampling_segments.py): the candidate pass on a (rows, chunks) grid and the
per-row draw from the segments give exactly the tokens of the torch reference and of ``filtered_pick`` for the same
uniforms, including the rows it hands to the per-row fallback (a chunk overflowing its segment, a top-k above the
chunk count, no top-k). Tiny shapes: on CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from fnvllm.kernels import penalties, sampling, sampling_filters, sampling_segments
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
    block = 32 if chunk < sampling_filters.BLOCK else sampling_filters.BLOCK  # tiny blocks for tiny chunks
    if segment is None:
        sampling_filters.filtered_pick(*args, state.out, chunk=chunk, block=block)
    else:
        segmented_pick(*args, state.out, chunk=chunk, segment=segment, block=block)
    return state.out[0].tolist()


def _reference(logits: torch.Tensor, settings: dict[str, torch.Tensor], uniforms: torch.Tensor) -> list[int]:
    s = settings
    args = (logits.cpu(), s["scale"], s["top_k"], s["top_p"], s["min_p"], uniforms.cpu())
    return sampling_filters.filtered_sample_ref(*args).tolist()


@pytest.mark.parametrize(("dtype", "segment"), [(torch.float32, 16), (torch.bfloat16, 2)])
def test_segments_draw_the_reference_and_filter_kernel_tokens(dtype: torch.dtype, segment: int) -> None:
    """Random rows over five 64-token chunks, top-k with and without top-p and min-p (k up to and above the chunk
    count): the same tokens as the reference and as filtered_pick for the same uniforms, whether the segments hold
    every candidate (16) or many rows overflow and fall back (2)."""
    logits = (torch.randn(12, 300, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).to(DEVICE)
    settings = _settings(12, 300, [1, 2, 3, 5, 4, 7], [1.0, 0.9, 0.5, 1.0, 0.95, 0.3], [0.0, 0.0, 0.05, 0.2])
    seed = 5 if dtype == torch.float32 else 6  # one set of uniforms a case (the interpreter takes ~9 s a set)
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


def _loop(monkeypatch: pytest.MonkeyPatch, programs: int, block: int, prefetch: int, fold: bool,
          skip: bool = False, warps: int = 2, total: int = 24) -> None:  # fmt: skip
    """Route segmented_pick's candidate pass to the loop kernel with these knobs."""
    for name, value in (("SEGMENTS_LOOP", True), ("SEGMENT_PROGRAMS", programs), ("SEGMENT_BLOCK", block),
                        ("SEGMENT_PREFETCH", prefetch), ("FOLD_FLOOR", fold), ("SEGMENT_TOTAL", total),
                        ("SKIP_EMPTY", skip), ("SEGMENT_WARPS", warps)):  # fmt: skip
        monkeypatch.setattr(sampling_segments, name, value)


@pytest.mark.parametrize(
    ("programs", "block", "prefetch", "fold", "skip", "segment"),
    [
        (2, 16, 1, True, False, 16),
        (1, 64, 0, False, True, 16),
        (0, 32, 2, False, False, 2),
        (3, 16, 2, True, True, 16),
        (8, 16, 0, True, True, 4),
    ],
)
def test_loop_kernel_draws_the_reference_tokens(
    monkeypatch: pytest.MonkeyPatch, programs: int, block: int, prefetch: int, fold: bool, skip: bool, segment: int
) -> None:
    """The loop kernel (a row's live chunks shared by 1, 2, 3, 8 or SEGMENT_TOTAL // rows programs, chunks of 64
    taken 16, 32 or 64 tokens a step, 0, 1 or 2 blocks loaded ahead, the floor folded in or by _floor_kernel, blocks
    without a candidate skipped or not) gives the
    reference's tokens on random rows with top-k, top-p and min-p, k up to above the chunk count, and rows that
    overflow a segment of 2 or 4 and fall back."""
    logits = (torch.randn(12, 300, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE)
    settings = _settings(12, 300, [1, 2, 3, 5, 4, 7], [1.0, 0.9, 0.5, 1.0, 0.95, 0.3], [0.0, 0.0, 0.05, 0.2])
    uniforms = torch.rand(12, generator=torch.Generator().manual_seed(5))
    _loop(monkeypatch, programs, block, prefetch, fold, skip)
    assert _draw(logits, settings, uniforms, segment) == _reference(logits, settings, uniforms)


def test_grid_kernel_draws_the_reference_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With SEGMENTS_LOOP off (_floor_kernel + _segment_kernel, one program per (row, chunk)) the same random rows
    draw the reference's tokens, with segments that hold every candidate (16) and with overflowing ones (2)."""
    monkeypatch.setattr(sampling_segments, "SEGMENTS_LOOP", False)
    logits = (torch.randn(12, 300, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE)
    settings = _settings(12, 300, [1, 2, 3, 5, 4, 7], [1.0, 0.9, 0.5, 1.0, 0.95, 0.3], [0.0, 0.0, 0.05, 0.2])
    uniforms = torch.rand(12, generator=torch.Generator().manual_seed(5))
    want = _reference(logits, settings, uniforms)
    assert _draw(logits, settings, uniforms, 16) == want
    assert _draw(logits, settings, uniforms, 2) == want


def test_loop_kernel_counts_a_chunk_across_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten tied maxima across two 16-token blocks of one chunk: the loop kernel carries the chunk's count from block
    to block (segment 16: the late ties are drawn from the segment; segment 4: the row falls back), as the
    reference; and flat bf16 rows full of ties draw the reference's tokens."""
    row = torch.full((256,), -1.0)
    row[10:20] = 2.0  # ten ties in chunk 0 (tokens 10-15 in its first block of 16, 16-19 in the second)
    row[70], row[130], row[200] = 1.0, 1.5, 0.5
    logits = row.expand(3, -1).contiguous().to(DEVICE)
    settings = _settings(3, 256, [2, 3, 4], [1.0], [0.0])
    settings["scale"] = torch.ones(3)
    uniforms = torch.tensor([0.95, 0.75, 0.55])
    want = _reference(logits, settings, uniforms)
    _loop(monkeypatch, 2, 16, 2, True, True)
    assert _draw(logits, settings, uniforms, 16) == want
    assert _draw(logits, settings, uniforms, 4) == want
    flat = (torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) * 0.64).bfloat16().to(DEVICE)
    settings = _settings(16, 256, [3, 4, 2], [0.95, 1.0], [0.0])
    settings["scale"] = torch.full((16,), 1 / 0.6)
    uniforms = torch.linspace(0.02, 0.98, 16)
    assert _draw(flat, settings, uniforms, 4) == _reference(flat, settings, uniforms)


def test_loop_kernel_rejects_a_block_that_is_not_a_power_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """SEGMENT_BLOCK 48 raises ValueError naming it."""
    logits = torch.zeros(2, 128, device=DEVICE)
    settings = _settings(2, 128, [2], [1.0], [0.0])
    _loop(monkeypatch, 2, 48, 1, True)
    with pytest.raises(ValueError, match="SEGMENT_BLOCK"):
        _draw(logits, settings, torch.rand(2), 4)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_rows_copies_the_chosen_rows_upcast(dtype: torch.dtype) -> None:
    """float_rows gives exactly the float32 values of the chosen rows (a vocabulary ending in a partial block), and
    of every row when no list is given; the source is untouched."""
    from fnvllm.kernels.penalties import _COPY_BLOCK, float_rows, float_rows_ref

    logits = (torch.randn(5, _COPY_BLOCK + 37, generator=torch.Generator().manual_seed(9)) * 4).to(dtype).to(DEVICE)
    before = logits.clone()
    rows = torch.tensor([4, 1, 3], dtype=torch.int32, device=DEVICE)
    assert torch.equal(float_rows(logits, rows), float_rows_ref(logits, rows))
    assert torch.equal(float_rows(logits), logits.float())
    assert torch.equal(logits, before)


def test_sampler_routes_top_k_rows_to_segments_and_copies_penalised_rows_by_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With TOP_K_BY_SEGMENTS and PENALISED_COPY_BY_KERNEL on, a batch of top-k rows (plain and penalised, k within
    and above the 4 chunks of sample_rows' 4096) draws exactly the references' tokens for the same (seeded)
    uniforms, and the tokens of the default route; a greedy row takes its argmax."""
    import attrs

    from fnvllm.executor import fused_sampling
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams
    from fnvllm.state.plan import TokenHistory

    vocab = 3 * sampling.CHUNK + 50
    rows = [
        SamplingParams(temperature=0.6, top_k=3, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=0.8, top_k=4, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
        SamplingParams(temperature=0.6, top_k=3, top_p=0.95, repetition_penalty=1.05),
        SamplingParams(temperature=0.0),
    ]
    params = [attrs.evolve(p, seed=200 + i) for i, p in enumerate(rows)]
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(len(params), vocab, generator=gen) * 0.64).bfloat16().to(DEVICE)
    top = logits[4].float().topk(4).indices.tolist()  # the penalised row has seen its best tokens
    history = TokenHistory(prompt=tuple(top[:2]), output=tuple(top[2:]))
    histories = [history if p.needs_history else None for p in params]
    batch = prepare_sampling(params, [2] * len(params), histories, vocab, DEVICE)
    want = Sampler(kernels=True).sample(logits, batch).token_ids.tolist()
    monkeypatch.setattr(fused_sampling, "TOP_K_BY_SEGMENTS", True)
    monkeypatch.setattr(fused_sampling, "PENALISED_COPY_BY_KERNEL", True)
    calls = _count_calls(monkeypatch, [(sampling_segments, "segmented_pick"), (penalties, "float_rows")])
    got = Sampler(kernels=True).sample(logits, batch).token_ids.tolist()
    assert calls == {"segmented_pick": 2, "float_rows": 1}  # the plain and the penalised group; one copy
    assert got == want == Sampler(kernels=False).sample(logits, batch).token_ids.tolist()
    assert got[5] == int(logits[5].argmax())


def _count_calls(monkeypatch: pytest.MonkeyPatch, targets: list[tuple[object, str]]) -> dict[str, int]:
    """Wrap each module function so that calls are counted (the real function still runs); returns the counts."""
    calls = {name: 0 for _, name in targets}
    for module, name in targets:
        real = getattr(module, name)

        def counted(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spread", [0.64, 3.0])
def test_gpu_segments_equal_the_filter_kernel_at_real_sizes(spread: float) -> None:
    """256 rows x 151,936 bf16 (flat and std-3 logits), Qwen3's top_k 20 / top_p 0.95, k above the chunk count and
    min-p rows: segmented_pick draws filtered_pick's tokens for the same uniforms in every row, by the grid kernel
    and by loop kernels of several shapes."""
    vocab = 151936
    logits = (torch.randn(256, vocab, generator=torch.Generator().manual_seed(5)) * spread).bfloat16().cuda()
    settings = _settings(256, vocab, [20, 20, 5, 64, 1000, 20], [0.95, 1.0, 0.9, 0.95, 1.0, 0.5], [0.0, 0.05])
    uniforms = torch.rand(256, generator=torch.Generator().manual_seed(7))
    old = _draw(logits, settings, uniforms, None, chunk=sampling.CHUNK)
    assert _draw(logits, settings, uniforms, 16, chunk=sampling.CHUNK) == old  # the defaults
    with pytest.MonkeyPatch.context() as patch:  # the grid kernel, then loop kernels of several shapes
        patch.setattr(sampling_segments, "SEGMENTS_LOOP", False)
        assert _draw(logits, settings, uniforms, 16, chunk=sampling.CHUNK) == old
        for programs, block, prefetch, skip, warps in (
            (4, 4096, 1, False, 8),
            (8, 1024, 2, True, 4),
            (0, 512, 2, True, 1),
        ):
            _loop(patch, programs, block, prefetch, True, skip, warps, total=4096)
            assert _draw(logits, settings, uniforms, 16, chunk=sampling.CHUNK) == old


def test_penalties_from_source_on_the_copy_equal_penalize() -> None:
    """penalize_from_ without a bitmask, on the float_rows copy (edits read from the source: rows with a repetition
    penalty alone take the count-free launch, the others the three passes) leaves exactly what penalize_ leaves."""
    from fnvllm.kernels.penalties import float_rows, penalize_, penalize_from_

    vocab, num_rows = 300, 4
    gen = torch.Generator().manual_seed(24)
    logits = (torch.randn(6, vocab, generator=gen) * 3).bfloat16().to(DEVICE)
    rows = torch.tensor([5, 0, 3, 2], dtype=torch.int64, device=DEVICE)
    tokens = torch.randint(0, 40, (num_rows + 1, 90), generator=gen, dtype=torch.int32).to(DEVICE)  # many repeats
    meta = torch.tensor([[4, 0, 2, 1], [90, 60, 1, 33], [40, 0, 1, 33]], device=DEVICE)
    factors = torch.tensor([[1.3, 0.8, 1.05, 2.0], [0.0, 0.0, -1.0, 0.2], [0.0, 0.0, 0.7, -0.4]], device=DEVICE)
    counts = torch.zeros(2, vocab, dtype=torch.int32, device=DEVICE)
    want = penalize_(float_rows(logits, rows), tokens, meta, factors, counts)
    got = penalize_from_(float_rows(logits, rows), logits, rows, tokens, meta, factors, counts, None)
    assert torch.equal(got, want) and not counts.any()
    assert not torch.equal(want, float_rows(logits, rows))  # the case does penalise


def _first_pass(logits: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """sample_rows' chunk summaries (3, R, C) of batch rows ``rows`` of logits (every batch row at its index)."""
    num_rows = logits.shape[0]
    state = sampling.RowSampling(
        scale=scale,
        fixed=torch.zeros(num_rows, dtype=torch.int32, device=logits.device),
        uniforms=torch.zeros(num_rows, device=logits.device),
        drawn=torch.empty((3, num_rows), device=logits.device),
        out=torch.empty((2, num_rows), dtype=torch.int64, device=logits.device),
    )
    return sampling.sample_rows(logits, state, seed=0, rows=rows, chunk=chunk).clone()


@pytest.mark.parametrize("loop", [False, True])
def test_top_k_above_the_chunks_takes_finer_maxima_on_the_segments_route(
    monkeypatch: pytest.MonkeyPatch, loop: bool
) -> None:
    """With TOP_K_BY_SEGMENTS, a batch whose largest top-k exceeds sample_rows' chunks (here 4 of 4096; HF's top_k
    50 against 38 in a real vocabulary) takes finer chunk maxima (SEGMENTS_FINE_CHUNK) so the segments have a floor,
    and draws exactly the references' tokens (plain rows and a whole penalised batch), by either candidate pass."""
    if loop:
        _loop(monkeypatch, 2, 256, 1, True)
    import attrs

    from fnvllm.executor import fused_sampling
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams
    from fnvllm.state.plan import TokenHistory

    vocab = 3 * sampling.CHUNK + 50
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(23)) * 0.64).bfloat16().to(DEVICE)
    rows = [
        SamplingParams(temperature=0.6, top_k=9, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=6, min_p=0.02),
        SamplingParams(temperature=0.8, top_k=3),
    ]
    monkeypatch.setattr(fused_sampling, "TOP_K_BY_SEGMENTS", True)
    calls = _count_calls(monkeypatch, [(sampling, "chunk_summaries"), (sampling_segments, "segmented_pick")])
    for penalty in (1.0, 1.2):
        params = [attrs.evolve(p, seed=300 + i, repetition_penalty=penalty) for i, p in enumerate(rows)]
        seen = TokenHistory(prompt=(1, 2, 3), output=tuple(logits[0].float().topk(3).indices.tolist()))
        histories = [seen if p.needs_history else None for p in params]
        batch = prepare_sampling(params, [2] * 3, histories, vocab, DEVICE)
        got = Sampler(kernels=True).sample(logits, batch).token_ids.tolist()
        assert got == Sampler(kernels=False).sample(logits, batch).token_ids.tolist()
    assert calls == {"chunk_summaries": 2, "segmented_pick": 2}

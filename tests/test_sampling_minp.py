"""Min-p-only rows on a (rows, chunks) grid (fnvllm/kernels/sampling_minp.py): for the same uniforms, the same tokens
as ``filtered_pick`` and the torch reference; draws fit softmax restricted to the min-p set (chi-square); the
sampler takes the route behind MIN_P_BY_CHUNKS. Tiny shapes: on CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from test_sampling_mixed import P_VALUE_FLOOR, chi_square_p_value, filtered_distribution

from fnvllm.kernels import sampling, sampling_filters, sampling_minp
from fnvllm.kernels.sampling_minp import minp_pick
from fnvllm.state import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 32  # tiny chunks: several per row in the interpreter


def _state(scale: torch.Tensor, uniforms: torch.Tensor | None) -> sampling.RowSampling:
    """RowSampling of len(scale) rows: the given uniforms (None: Philox draws them), out filled with -1."""
    num_rows = scale.shape[0]
    fixed = torch.full((num_rows,), 0 if uniforms is None else 1, dtype=torch.int32)
    return sampling.RowSampling(
        scale=scale.float().to(DEVICE),
        fixed=fixed.to(DEVICE),
        uniforms=(torch.zeros(num_rows) if uniforms is None else uniforms).float().to(DEVICE),
        drawn=torch.empty((3, num_rows), device=DEVICE),
        out=torch.full((2, num_rows), -1, dtype=torch.int64, device=DEVICE),
    )


def _draw(logits: torch.Tensor, scale: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor | None,
          route: str, chunk: int = CHUNK, seed: int = 0) -> list[int]:  # fmt: skip
    """Tokens of every row after sample_rows: the filtered rows (scale > 0 and min_p > 0) redrawn by ``route``
    ("grid": minp_pick; "filter": filtered_pick), the other rows as sample_rows left them."""
    state = _state(scale, uniforms)
    stats = sampling.sample_rows(logits, state, seed=seed, chunk=chunk)
    rows = torch.nonzero((scale > 0) & (min_p > 0)).flatten().int().to(DEVICE)
    min_p = min_p.float().to(DEVICE)
    if route == "filter":
        zeros = torch.zeros(scale.shape[0], dtype=torch.int64, device=DEVICE)
        ones = torch.ones(scale.shape[0], device=DEVICE)
        args = (state.scale, zeros, ones, min_p, state.drawn, state.out)
        sampling_filters.filtered_pick(logits, rows, rows, rows, stats, *args, chunk=chunk, block=min(chunk, 32))
    else:
        minp_pick(logits, rows, rows, rows, stats, state.scale, min_p, state.drawn, state.out, chunk=chunk)
    return state.out[0].tolist()


def _reference(logits: torch.Tensor, scale: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """The sorting reference's tokens (greedy rows: the argmax), the same uniforms."""
    num_rows = logits.shape[0]
    no_k, no_p = torch.zeros(num_rows, dtype=torch.int64), torch.ones(num_rows)
    tokens, _ = sampling.sample_rows_ref(logits.cpu(), scale.float(), no_k, no_p, min_p.float(), uniforms.float())
    return tokens.tolist()


def test_worked_example_of_the_module_doc() -> None:
    """The module doc's example (chunks of 4, min_p 0.25, u 0.6) draws token 3."""
    logits = torch.tensor([[0.0, -1, -3, 0, -2, -1, -5, -5, -4, -6, -5, -9]], device=DEVICE)
    args = (logits, torch.ones(1), torch.tensor([0.25]), torch.tensor([0.6]))
    assert _draw(*args, "grid", chunk=4) == [3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minp_pick_draws_the_filter_kernels_and_the_references_tokens(dtype: torch.dtype) -> None:
    """Rows over a vocabulary of 3 chunks and a partial one, with different min_p and temperatures, seeded uniforms
    and greedy rows mixed in: minp_pick draws filtered_pick's and the reference's tokens; greedy rows keep their
    argmax."""
    num_rows, vocab = 10, 3 * CHUNK + 7
    gen = torch.Generator().manual_seed(11 if dtype == torch.float32 else 12)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 2.5).to(dtype).to(DEVICE)
    scale = torch.tensor([1 / 0.6, 0.0, 1.0, 1 / 1.3, 2.0, 0.0, 1 / 0.7, 1.0, 1 / 0.6, 1 / 0.9])
    min_p = torch.tensor([0.05, 0.1, 0.2, 0.01, 0.5, 0.0, 0.1, 0.9, 1e-4, 0.3])
    uniforms = torch.rand(num_rows, generator=gen)
    want = _reference(logits, scale, min_p, uniforms)
    assert want[1] == int(logits[1].float().argmax()) and want[5] == int(logits[5].float().argmax())
    assert _draw(logits, scale, min_p, uniforms, "filter") == want
    assert _draw(logits, scale, min_p, uniforms, "grid") == want


def test_one_chunk_holds_every_kept_token() -> None:
    """Rows whose kept set lies in one chunk (the other chunks' maxima below the threshold, so they exit without
    reading) draw the reference's tokens at uniforms across (0, 1), including the last kept token at u near 1."""
    row = torch.full((3 * CHUNK + 5,), -8.0)
    row[CHUNK + 3], row[CHUNK + 9], row[CHUNK + 20], row[2 * CHUNK + 1] = 1.0, 0.5, 0.8, -6.0
    logits = row.expand(5, -1).contiguous().to(DEVICE)
    scale, min_p = torch.ones(5), torch.full((5,), 0.3)
    uniforms = torch.tensor([0.01, 0.3, 0.55, 0.8, 0.9999])
    want = _reference(logits, scale, min_p, uniforms)
    assert want == [CHUNK + 3, CHUNK + 3, CHUNK + 9, CHUNK + 20, CHUNK + 20]
    assert _draw(logits, scale, min_p, uniforms, "grid") == want


def test_a_group_of_rows_from_a_dense_copy_and_from_the_logits() -> None:
    """As the sampler's groups: penalised rows sampled from a dense (P, V) copy (sources and programs their
    positions there) and plain rows from the whole logits (sources their batch rows, programs their positions in
    the group) draw the reference's tokens; rows outside the group stay untouched."""
    num_rows, vocab = 6, 2 * CHUNK + 3
    gen = torch.Generator().manual_seed(21)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 2).to(DEVICE)
    scale = torch.tensor([1.0, 1 / 0.6, 0.0, 1.0, 1 / 0.8, 1 / 0.6])
    min_p = torch.tensor([0.1, 0.05, 0.0, 0.2, 0.02, 0.4])
    uniforms = torch.rand(num_rows, generator=gen)
    want = _reference(logits, scale, min_p, uniforms)
    group = torch.tensor([5, 1, 2, 3], dtype=torch.int32, device=DEVICE)  # batch rows of the group (row 2 greedy)
    filtered = torch.tensor([5, 1, 3], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)  # their places in the group
    for dense in (True, False):
        state = _state(scale, uniforms)
        source = logits.index_select(0, group.long()).contiguous() if dense else logits
        stats = sampling.sample_rows(source, state, seed=0, rows=group, dense=dense, chunk=CHUNK)
        sources = positions if dense else filtered
        args = (state.scale, min_p.to(DEVICE), state.drawn, state.out)
        minp_pick(source, filtered, sources, positions, stats, *args, chunk=CHUNK)
        got = state.out[0].tolist()
        assert [got[i] for i in (5, 1, 2, 3)] == [want[i] for i in (5, 1, 2, 3)]
        assert got[0] == got[4] == -1


def test_minp_pick_draws_softmax_restricted_to_the_min_p_set() -> None:
    """Over 240 rows with Philox uniforms (a vocabulary of 10 in chunks of 4), the tokens fit softmax(x / T)
    restricted to the tokens with probability >= min_p * max, renormalised (chi-square; none outside the set)."""
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2, -2.0, 0.8])
    params = SamplingParams(temperature=1.2, min_p=0.2)
    num_rows = 240
    logits = row.expand(num_rows, -1).contiguous().to(DEVICE)
    scale, min_p = torch.full((num_rows,), 1 / 1.2), torch.full((num_rows,), 0.2)
    tokens = torch.tensor(_draw(logits, scale, min_p, None, "grid", chunk=4, seed=77))
    probs = filtered_distribution(row, params)
    assert 3 <= int((probs > 0).sum()) < row.numel()  # the filter does cut
    counts = torch.bincount(tokens, minlength=row.numel())
    assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR, counts.tolist()


def test_minp_pick_rejects_bad_arguments() -> None:
    """Stats of another chunking, a chunk that is not a power of two and mismatched row lists raise ValueError
    naming them."""
    logits = torch.zeros(2, 10, device=DEVICE)
    rows = torch.arange(2, device=DEVICE)
    stats = torch.zeros((3, 2, 1), device=DEVICE)
    f32 = torch.ones(2, device=DEVICE)
    tail = (f32, f32, torch.ones((3, 2), device=DEVICE), torch.zeros((2, 2), dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="stats"):
        minp_pick(logits, rows, rows, rows, stats, *tail, chunk=4)
    with pytest.raises(ValueError, match="chunk"):
        minp_pick(logits, rows, rows, rows, stats, *tail, chunk=12)
    with pytest.raises(ValueError, match="rows, sources and programs"):
        minp_pick(logits, rows, rows[:1], rows, stats, *tail)


def test_sampler_routes_min_p_only_batches_to_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """With MIN_P_BY_CHUNKS on, a min-p-only batch (plain rows, a penalised row, a greedy row) is drawn by minp_pick
    (once per group) and gives exactly the references' tokens and the old route's for the same (seeded)
    uniforms; a batch with a top-p row keeps the old route."""
    import attrs

    from fnvllm.executor import fused_sampling
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state.plan import TokenHistory

    vocab = 2 * sampling.CHUNK + 50  # sample_rows' chunks of 4096: three a row
    rows = [
        SamplingParams(temperature=0.6, min_p=0.05),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, min_p=0.1, repetition_penalty=1.2),
        SamplingParams(temperature=0.7),
    ]
    params = [attrs.evolve(p, seed=400 + i) for i, p in enumerate(rows)]
    logits = (torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(31)) * 2).bfloat16().to(DEVICE)
    seen = TokenHistory(prompt=(1, 2), output=tuple(logits[3].float().topk(3).indices.tolist()))
    histories = [seen if p.needs_history else None for p in params]
    batch = prepare_sampling(params, [2] * len(params), histories, vocab, DEVICE)
    assert batch.min_p_only
    want = Sampler(kernels=True).sample(logits, batch).token_ids.tolist()  # the old route
    monkeypatch.setattr(fused_sampling, "MIN_P_BY_CHUNKS", True)
    calls = {"minp_pick": 0}
    real = sampling_minp.minp_pick

    def counted(*args: object, **kwargs: object) -> None:
        calls["minp_pick"] += 1
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling_minp, "minp_pick", counted)
    got = Sampler(kernels=True).sample(logits, batch).token_ids.tolist()
    assert calls["minp_pick"] == 2  # the plain and the penalised group
    assert got == want == Sampler(kernels=False).sample(logits, batch).token_ids.tolist()
    assert got[2] == int(logits[2].float().argmax())
    mixed = [*params[:2], attrs.evolve(params[4], top_p=0.9)]
    Sampler(kernels=True).sample(logits[:3], prepare_sampling(mixed, [2] * 3, [None] * 3, vocab, DEVICE))
    assert calls["minp_pick"] == 2  # a top-p row in the batch: filtered_pick or sorting, as before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spread", [0.64, 3.0])
def test_gpu_minp_pick_equals_the_filter_kernel_at_real_sizes(spread: float) -> None:
    """256 rows x 151,936 bf16 (flat and std-3 logits), min_p 0.05 / 0.1 / 0.01 at T 0.6 and 1: minp_pick draws
    filtered_pick's tokens for the same uniforms in most rows, and where they differ the two tokens sit within
    float32 rounding of each other on the row's kept-mass CDF (float64): the routes sum the kept mass in different
    orders, and on flat rows that keep most of 151,936 tokens (min_p 0.01, each token ~1e-5 of the mass) a uniform
    often lands within that rounding of a step."""
    num_rows, vocab = 256, 151936
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(num_rows, vocab, generator=gen) * spread).bfloat16().cuda()
    scale = torch.tensor([1 / 0.6, 1.0])[torch.arange(num_rows) % 2]
    min_p = torch.tensor([0.05, 0.1, 0.01])[torch.arange(num_rows) % 3]
    uniforms = torch.rand(num_rows, generator=gen)
    old = torch.tensor(_draw(logits, scale, min_p, uniforms, "filter", chunk=sampling.CHUNK))
    new = torch.tensor(_draw(logits, scale, min_p, uniforms, "grid", chunk=sampling.CHUNK))
    assert (new == old).float().mean().item() >= 0.9
    s = logits.double().cpu() * scale.double()[:, None]
    weights = (s - s.amax(dim=1, keepdim=True)).exp()
    kept = torch.where(weights >= min_p.double()[:, None], weights, 0.0)
    cdf = kept.cumsum(dim=1) / kept.sum(dim=1, keepdim=True)  # (rows, vocab) kept-mass CDF, float64
    rows = torch.arange(num_rows)
    assert bool((kept[rows, new] > 0).all())  # every drawn token is inside its row's min-p set
    gap = (cdf[rows, new] - cdf[rows, old]).abs()
    assert gap.max().item() <= 1e-4, gap.max().item()

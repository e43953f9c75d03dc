"""The top-k / top-p / min-p kernel and the log-partition kernel (fnvllm/kernels/sampling_filters.py) against
their torch references (fnvllm/kernels/sampling_ref.py): the same uniforms give exactly the same tokens, and
draws fit the exact filtered distribution (chi-square). Tiny shapes: on CPU the kernels run in Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch
from test_sampling_mixed import P_VALUE_FLOOR, chi_square_p_value, filtered_distribution

from fnvllm.kernels import sampling, sampling_filters
from fnvllm.state import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _settings(num_rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-row scale, top_k, top_p, min_p cycling through every combination (top_k up to vocab - 1)."""
    gen = torch.Generator().manual_seed(seed)
    ks = torch.tensor([0, 1, 2, 5, vocab - 1, 17, 0, 3])
    ps = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.999, 0.3, 1e-30, 0.95])
    mins = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0, 0.01])
    index = torch.arange(num_rows) % 8
    return {
        "scale": (1.0 / (torch.rand(num_rows, generator=gen) * 2 + 0.2)).float(),
        "top_k": ks[index].clamp(max=vocab - 1),
        "top_p": ps[index].float(),
        "min_p": mins[index].float(),
    }


def _run_kernel(
    logits: torch.Tensor,
    settings: dict[str, torch.Tensor],
    uniforms: torch.Tensor,
    chunk: int = 64,
    block: int = 32,
    capacity: int = 1024,
) -> torch.Tensor:
    """Tokens of filtered_pick over every row (after sample_rows, whose chunk summaries and row maxima it reads;
    every uniform given)."""
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
    rows = torch.arange(num_rows, device=DEVICE)
    args = (on["scale"], on["top_k"], on["top_p"], on["min_p"], state.drawn, state.out)
    sampling_filters.filtered_pick(logits, rows, rows, rows, stats, *args, chunk=chunk, block=block, capacity=capacity)
    return state.out[0].cpu()


def _reference(logits: torch.Tensor, settings: dict[str, torch.Tensor], uniforms: torch.Tensor) -> torch.Tensor:
    s = settings
    return sampling_filters.filtered_sample_ref(
        logits.cpu(), s["scale"], s["top_k"], s["top_p"], s["min_p"], uniforms.cpu()
    )


@pytest.mark.parametrize("capacity", [256, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_pick_equals_reference_given_the_same_uniforms(dtype: torch.dtype, capacity: int) -> None:
    """Random rows (bf16 ones full of ties) over several 32-token blocks: every filter mix picks exactly the
    reference's token for the same uniforms, whether top-k rows sort their candidates or (more candidates than
    the capacity) search."""
    logits = (torch.randn(16, 200, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).to(DEVICE)
    settings = _settings(16, 200, seed=2)  # each of the 8 filter mixes on two rows
    uniforms = torch.rand(16, generator=torch.Generator().manual_seed(5))
    got = _run_kernel(logits, settings, uniforms, capacity=capacity)
    assert got.tolist() == _reference(logits, settings, uniforms).tolist()


@pytest.mark.parametrize("capacity", [128, 8])
@pytest.mark.parametrize(
    "kind", ["all equal", "adjacent floats", "two values", "one spike", "negative and zero", "huge spread"]
)
def test_threshold_search_on_hard_rows(kind: str, capacity: int) -> None:
    """Rows that stress the key search -- ties everywhere, values one float32 ulp apart, two distinct values, one
    token holding all the mass, -0.0 beside +0.0, logits over 1e4 apart -- still match the reference."""
    vocab, num_rows = 70, 8
    base = {
        "all equal": torch.full((vocab,), 1.5),
        "adjacent floats": _ulps(vocab),
        "two values": torch.where(torch.arange(vocab) % 3 == 0, 2.0, -1.0),
        "one spike": torch.where(torch.arange(vocab) == 40, 30.0, 0.0),
        "negative and zero": torch.where(torch.arange(vocab) % 2 == 0, -0.0, torch.linspace(-3, 0, vocab)),
        "huge spread": torch.linspace(-2e4, 2e4, vocab)[torch.randperm(vocab, generator=torch.Generator())],
    }[kind]
    logits = base.expand(num_rows, -1).contiguous().to(DEVICE)
    settings = _settings(num_rows, vocab, seed=3)
    settings["scale"] = torch.ones(num_rows)  # keep the crafted spacing exact
    uniforms = torch.linspace(0.01, 0.99, num_rows)
    got = _run_kernel(logits, settings, uniforms, capacity=capacity)
    assert got.tolist() == _reference(logits, settings, uniforms).tolist()


def _ulps(vocab: int) -> torch.Tensor:
    """vocab float32 values 1.0, 1.0 + 1 ulp, 1.0 + 2 ulp, ... shuffled."""
    bits = torch.tensor(1.0).view(torch.int32) + torch.arange(vocab, dtype=torch.int32)
    return bits.view(torch.float32)[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]


# one setting that searches its top-p threshold (no top-k) and one that sorts its top-k candidates, with min-p in
# the final draw (min-p alone only skips both); the exact-equality tests above check every mix against the reference
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7, min_p=0.05),
    ],
)
def test_filtered_pick_draws_the_filtered_distribution(params: SamplingParams) -> None:
    """Over 240 rows with Philox uniforms, the kernel's tokens fit the exact filtered distribution (chi-square; few
    draws, as the interpreter is slow: the exact-equality tests above carry the rest, and test_sampling_mixed checks
    the reference over many draws)."""
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2, -2.0, 0.8])
    num_rows = 240
    settings = {
        "scale": torch.full((num_rows,), 1.0 / params.temperature, dtype=torch.float32),
        "top_k": torch.full((num_rows,), params.top_k or 0),
        "top_p": torch.full((num_rows,), params.top_p),
        "min_p": torch.full((num_rows,), params.min_p),
    }
    uniforms = sampling.philox_uniforms(num_rows, 77, DEVICE)
    tokens = _run_kernel(row.expand(num_rows, -1).contiguous().to(DEVICE), settings, uniforms, capacity=16)
    counts = torch.bincount(tokens, minlength=row.numel())
    assert chi_square_p_value(counts, filtered_distribution(row, params)) > P_VALUE_FLOOR, counts.tolist()


def test_log_partition_matches_reference() -> None:
    """log sum exp of selected rows (bf16, several blocks, very negative and large values) equals the reference."""
    logits = (torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 20).bfloat16().to(DEVICE)
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    got = sampling_filters.log_partition(logits, rows, block=64)
    torch.testing.assert_close(got.cpu(), sampling_filters.log_partition_ref(logits[rows].cpu()))


def test_filtered_pick_rejects_bad_arguments() -> None:
    """Bad shapes, a float top_k, stats of another chunking and a block that is not a power of two raise
    ValueError naming them."""
    logits = torch.zeros(2, 10, device=DEVICE)
    rows = torch.arange(2, device=DEVICE)
    stats = torch.zeros((3, 2, 1), device=DEVICE)
    f32 = torch.ones(2, device=DEVICE)
    out = torch.zeros((2, 2), dtype=torch.int64, device=DEVICE)
    k = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    drawn = torch.ones((3, 2), device=DEVICE)
    settings = (f32, k, f32, f32, drawn, out)
    with pytest.raises(ValueError, match="rows, sources and programs"):
        sampling_filters.filtered_pick(logits, rows, rows[:1], rows, stats, *settings)
    with pytest.raises(ValueError, match="top_k"):
        sampling_filters.filtered_pick(logits, rows, rows, rows, stats, f32, f32, f32, f32, drawn, out)
    with pytest.raises(ValueError, match="stats"):
        sampling_filters.filtered_pick(logits, rows, rows, rows, stats, *settings, chunk=4)
    with pytest.raises(ValueError, match="block"):
        sampling_filters.filtered_pick(logits, rows, rows, rows, stats, *settings, block=24)
    with pytest.raises(ValueError, match="logits"):
        sampling_filters.filtered_pick(logits[0], rows, rows, rows, stats, *settings)


@gpu
@pytest.mark.gpu
def test_gpu_filtered_pick_real_sizes() -> None:
    """256 rows x 151,936 bf16, Qwen3's top_k 20 / top_p 0.95 and min-p rows: the kernel agrees with the float64
    reference on the same uniforms (allow one row in a hundred within rounding of a step)."""
    vocab = 151936
    logits = (torch.randn(256, vocab, generator=torch.Generator().manual_seed(5)) * 4).bfloat16().cuda()
    settings = _settings(256, vocab, seed=6)
    uniforms = torch.rand(256, generator=torch.Generator().manual_seed(7))
    got = _run_kernel(logits, settings, uniforms, chunk=sampling.CHUNK, block=sampling_filters.BLOCK)
    assert (got == _reference(logits, settings, uniforms)).float().mean().item() >= 0.99


def test_logprob_candidates_give_the_log_partition_and_hold_the_top_n() -> None:
    """One chunk-summary pass gives logsumexp of the asked rows, and its candidates hold each row's n best logits
    (a vocabulary that ends in a partial chunk, whose padding never wins)."""
    from fnvllm.kernels.sampling import logprob_candidates

    logits = (torch.randn(5, 1000) * 4).to(DEVICE)
    logits[2, 990:] = 50.0  # the best tokens of row 2 in the partial last chunk
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    lse, values, ids = logprob_candidates(logits, rows, 3, chunk=64)
    torch.testing.assert_close(lse.cpu(), sampling_filters.log_partition_ref(logits[rows.long()].cpu()))
    top = values.topk(3, dim=-1)
    want = logits[rows.long()].topk(3, dim=-1)
    torch.testing.assert_close(top.values.cpu(), want.values.float().cpu())
    picked = ids.gather(1, top.indices)
    assert bool((picked < 1000).all()) and all(len(set(r)) == 3 for r in picked.tolist())


def test_logprob_candidates_are_the_chosen_chunks_copied() -> None:
    """Each candidate slot holds whole chunks of its row: the logit of each id, -inf past the vocabulary,
    and the chunks are the rows' n with the largest maxima, best first."""
    from fnvllm.kernels.sampling import logprob_candidates

    logits = (torch.randperm(1200, generator=torch.Generator().manual_seed(3)).view(4, 300) / 100.0).to(DEVICE)
    rows = torch.tensor([3, 1], dtype=torch.int64, device=DEVICE)  # distinct logits: no tie among chunk maxima
    _, values, ids = logprob_candidates(logits, rows, 2, chunk=64)
    source = logits[rows.long()].float().cpu()  # (2, 300)
    ids, values = ids.cpu(), values.cpu()
    inside = ids < 300
    assert torch.equal(values[inside], source.gather(1, ids.clamp(max=299))[inside])
    assert bool(torch.isinf(values[~inside]).all()) and int((~inside).sum()) in (0, 20, 40)
    maxima = torch.nn.functional.pad(source, (0, 20), value=float("-inf")).view(2, 5, 64).amax(-1)  # (2, 5)
    assert torch.equal(ids[:, ::64] // 64, maxima.topk(2, dim=-1).indices)


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
def test_candidates_pick_matches_the_sorting_reference(top_p: float) -> None:
    """The candidates kernel draws what filtered_sample_sorted draws over the same candidates and uniforms
    (top-k, top-p of the top-k, min-p), and only tokens among each row's top-k."""
    from fnvllm.kernels.sampling_filters import candidates_pick
    from fnvllm.kernels.sampling_ref import filtered_sample_sorted

    num_rows, vocab, num_candidates = 12, 500, 40
    gen = torch.Generator().manual_seed(int(top_p * 10))
    logits = (torch.randn(num_rows, vocab, generator=gen) * 2).to(DEVICE)
    scale = torch.full((num_rows,), 1 / 0.7, device=DEVICE)
    top_k = torch.randint(1, 30, (num_rows,), generator=gen).to(DEVICE, torch.int32)
    top_p_t = torch.full((num_rows,), top_p, device=DEVICE)
    min_p = torch.tensor([0.0, 0.05] * (num_rows // 2), device=DEVICE)
    drawn = torch.rand(3, num_rows, generator=gen).to(DEVICE)
    ids = logits.topk(num_candidates, dim=-1).indices.sort(dim=-1).values
    values = logits.gather(1, ids)
    out = torch.zeros(2, num_rows, dtype=torch.int64, device=DEVICE)
    rows = torch.arange(num_rows, dtype=torch.int32, device=DEVICE)
    candidates_pick(values, ids, rows, scale, top_k, top_p_t, min_p, drawn, out)
    want = ids.gather(1, filtered_sample_sorted(values, scale, top_k, top_p_t, min_p, drawn[0])[:, None])[:, 0]
    assert torch.equal(out[0], want)
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k.long() - 1)[:, None])[:, 0]
    assert bool((logits.gather(1, out[0][:, None])[:, 0] >= kth).all())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, top_k=6, top_p=0.7), SamplingParams(temperature=0.8, top_k=5, min_p=0.1)],
)
def test_candidates_pick_draws_the_filtered_distribution(params: SamplingParams) -> None:
    """Over 400 draws at random uniforms (the interpreter is slow), the candidates kernel's tokens fit the exact
    filtered distribution (chi-square against the sorting oracle of test_sampling_mixed)."""
    from fnvllm.kernels.sampling_filters import candidates_pick

    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2, -2.0, 0.8])
    num_rows = 400
    ids = row.topk(8).indices.sort().values.expand(num_rows, -1).contiguous().to(DEVICE)  # 8 candidates
    values = row.to(DEVICE)[ids]
    full = {"dtype": torch.float32, "device": DEVICE}
    settings = (
        torch.full((num_rows,), 1.0 / params.temperature, **full),
        torch.full((num_rows,), params.top_k or 0, dtype=torch.int32, device=DEVICE),
        torch.full((num_rows,), params.top_p, **full),
        torch.full((num_rows,), params.min_p, **full),
        torch.rand(3, num_rows, generator=torch.Generator().manual_seed(8)).to(DEVICE),
    )
    out = torch.zeros(2, num_rows, dtype=torch.int64, device=DEVICE)
    candidates_pick(values, ids, torch.arange(num_rows, device=DEVICE), *settings, out)
    counts = torch.bincount(out[0].cpu(), minlength=row.numel())
    assert chi_square_p_value(counts, filtered_distribution(row, params)) > P_VALUE_FLOOR, counts.tolist()


def test_sampler_logprobs_by_kernels_equal_the_references() -> None:
    """Logprobs through the kernels' chunk candidates (asked rows only, n 5 and 0) equal log_softmax's top-n and
    the sampled token's log-probability from the references' path."""
    from fnvllm.executor.sampler import Sampler, prepare_sampling

    vocab = 2000
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
    params = [SamplingParams(temperature=0.7, logprobs=5, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.7, logprobs=0, seed=8)]
    batch = prepare_sampling(params, [0] * 6, [None] * 6, vocab, DEVICE)
    got = Sampler(kernels=True).sample(logits, batch).logprobs
    want = Sampler(kernels=False).sample(logits, batch).logprobs
    assert got is not None and want is not None
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs)
    assert torch.equal(got.top_ids, want.top_ids)
    torch.testing.assert_close(got.sampled_logprobs, want.sampled_logprobs)
    expected = logits.float().log_softmax(dim=-1)[[0, 1, 2, 3, 5]].topk(5, dim=-1).values
    torch.testing.assert_close(got.top_logprobs, expected)


def test_finer_filter_chunks_draw_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With finer chunk maxima for the filter kernel (``FILTER_CHUNK``), top-k (and top-p) rows draw the tokens of
    the default path on the same uniforms (seeded rows), a greedy row beside them untouched."""
    from fnvllm.executor import fused_sampling
    from fnvllm.executor.sampler import Sampler, prepare_sampling

    vocab = 8192  # two chunks of sample_rows' 4096, sixteen of 512
    logits = (torch.randn(5, vocab, generator=torch.Generator().manual_seed(11)) * 3).to(DEVICE)
    settings = [(20, 0.95), (5, 1.0), (50, 0.5), (1000, 0.9)]
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=p, seed=i) for i, (k, p) in enumerate(settings)]
    params.append(SamplingParams(temperature=0.0))
    batch = prepare_sampling(params, [3] * 5, [None] * 5, vocab, DEVICE)
    want = Sampler(kernels=True).sample(logits, batch).token_ids
    monkeypatch.setattr(fused_sampling, "FILTER_CHUNK", 512)
    got = Sampler(kernels=True).sample(logits, batch).token_ids
    assert got.tolist() == want.tolist()
    assert got[4].item() == logits[4].argmax().item()

"""The penalty kernel (fnvllm/kernels/penalties.py, under TRITON_INTERPRET on CPU) against its torch reference and
against the sparse penalties built from full histories (fnvllm/executor/penalties.py), on the same inputs."""

from __future__ import annotations

import pytest
import torch

from fnvllm.executor.penalties import apply_penalties, prepare_penalties
from fnvllm.kernels.penalties import float_rows, float_rows_ref, penalised_rows, penalize_, penalize_ref
from fnvllm.state import SamplingParams, TokenHistory

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernel runs in Triton's interpreter
VOCAB = 300


def _case(seed: int, num_rows: int, max_len: int) -> tuple[torch.Tensor, ...]:
    """Logits (P, V), a token buffer with repeats (more slots than rows), meta and factors."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=gen) * 3
    tokens = torch.randint(0, 40, (num_rows + 2, max_len), generator=gen, dtype=torch.int32)  # many repeats
    slots = torch.randperm(num_rows + 2, generator=gen)[:num_rows]
    ctx = torch.randint(1, max_len + 1, (num_rows,), generator=gen)
    outputs = (ctx.float() * torch.rand(num_rows, generator=gen)).long()
    meta = torch.stack([slots, ctx, outputs])
    signed = (torch.rand(2, num_rows, generator=gen) * 4 - 2).unbind(0)  # frequency, presence in [-2, 2]
    factors = torch.stack([torch.rand(num_rows, generator=gen) + 0.5, *signed])
    return logits, tokens, meta, factors


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_reference(seed: int) -> None:
    """Kernel and reference give the same penalised logits (rows longer than one block included) and the kernel
    leaves its count scratch all zero."""
    logits, tokens, meta, factors = _case(seed, num_rows=5, max_len=1500)
    counts = torch.zeros(6, VOCAB, dtype=torch.int32, device=DEVICE)
    on = [t.to(DEVICE) for t in (tokens, meta, factors)]
    got = penalize_(logits.to(DEVICE).clone(), *on, counts)
    want = penalize_ref(logits.clone(), tokens, meta, factors)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    assert not counts.any()
    assert not torch.equal(want, logits)  # the case does penalise


def test_reference_equals_the_sparse_history_penalties() -> None:
    """The buffer-based reference equals apply_penalties over PenaltyBatch built from the same histories."""
    logits, tokens, meta, factors = _case(2, num_rows=4, max_len=50)
    params, histories = [], []
    for i in range(4):
        rep, freq, pres = (float(f) for f in factors[:, i])
        params.append(SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres))
        seq = tokens[int(meta[0, i]), : int(meta[1, i])].tolist()
        split = len(seq) - int(meta[2, i])
        histories.append(TokenHistory(tuple(seq[:split]), tuple(seq[split:])))
    batch = prepare_penalties(params, histories, VOCAB, torch.device("cpu"))
    assert batch is not None
    torch.testing.assert_close(penalize_ref(logits.clone(), tokens, meta, factors), apply_penalties(logits, batch))


def test_fewer_programs_than_rows_take_rows_in_turn() -> None:
    """With a two-row scratch (two programs) five rows are penalised as the reference does, scratch left zero."""
    logits, tokens, meta, factors = _case(5, num_rows=5, max_len=40)
    counts = torch.zeros(2, VOCAB, dtype=torch.int32, device=DEVICE)
    on = [t.to(DEVICE) for t in (tokens, meta, factors)]
    got = penalize_(logits.to(DEVICE).clone(), *on, counts)
    torch.testing.assert_close(got.cpu(), penalize_ref(logits.clone(), tokens, meta, factors), rtol=0, atol=0)
    assert not counts.any()


def test_kernel_rejects_a_scratch_of_another_vocabulary() -> None:
    """A count scratch whose width is not the vocabulary is refused with a message naming it."""
    logits, tokens, meta, factors = _case(3, num_rows=3, max_len=8)
    with pytest.raises(ValueError, match="counts"):
        penalize_(logits, tokens, meta, factors, torch.zeros(2, VOCAB - 1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_at_the_bench_size_never_syncs() -> None:
    """256 rows x 151,936 with ~600-token histories: the kernel makes no host synchronisation and equals the
    reference."""
    num_rows, vocab = 256, 151936
    gen = torch.Generator().manual_seed(4)
    work = (torch.randn(num_rows, vocab, generator=gen) * 3).cuda()
    tokens = torch.randint(0, vocab, (num_rows, 1024), generator=gen, dtype=torch.int32).cuda()
    ctx = torch.randint(500, 700, (num_rows,), generator=gen)
    meta = torch.stack([torch.arange(num_rows), ctx, ctx // 2]).cuda()
    factors = torch.tensor([[1.05], [0.3], [0.2]]).expand(3, num_rows).contiguous().cuda()
    counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device="cuda")
    want = penalize_ref(work.clone(), tokens, meta, factors)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = penalize_(work.clone(), tokens, meta, factors, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not counts.any()


def _two_launches(logits: torch.Tensor, rows: torch.Tensor | None, *pen: torch.Tensor) -> torch.Tensor:
    """Today's path: ``float_rows`` then ``penalize_`` with a zero count scratch."""
    counts = torch.zeros(2, logits.shape[1], dtype=torch.int32, device=logits.device)
    return penalize_(float_rows(logits, rows), *pen, counts)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit patterns (so -0.0 and NaN payloads compare too)."""
    return t.view(torch.int32).cpu()


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_rows_equal_copy_then_edits_bit_for_bit(seed: int) -> None:
    """``penalised_rows`` (one launch) gives today's float_rows + penalize_ rows bit for bit: rows of repetition
    alone and rows with presence / frequency, repeats, a subset of source rows, tokens outside the vocabulary, and
    vocabulary blocks and history blocks smaller than a row's."""
    logits, tokens, meta, factors = _case(seed, num_rows=5, max_len=70)
    factors[1:, 0] = 0.0  # row 0: repetition alone
    factors[1, 1] = 0.0  # row 1: presence only
    tokens[int(meta[0, 2]), 0], tokens[int(meta[0, 3]), 1] = VOCAB + 3, -2  # ignored ids
    source = torch.cat([logits, logits.flip(0)]).to(torch.bfloat16)
    rows = torch.tensor([7, 0, 3, 9, 4])
    on = [t.to(DEVICE) for t in (source, rows, tokens, meta, factors)]
    want = _two_launches(*on)
    got = penalised_rows(*on, block=64, history_block=16)
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.equal(want.cpu(), float_rows_ref(source, rows))  # the case does penalise


def test_fused_worked_example_edits_repeats_once() -> None:
    """The module doc's example with the repeated tokens on either side of a block edge: tokens (5, 7, 5 | 7, 7),
    r 2, frequency 1, presence 0.5 edit 5 to x / 2 and 7 to x / 2 - 2.5 once each, and nothing else."""
    logits = torch.arange(1, 13, dtype=torch.float32).reshape(1, 12)
    tokens = torch.tensor([[5, 7, 5, 7, 7, 0]], dtype=torch.int32)
    meta, factors = torch.tensor([[0], [5], [2]]), torch.tensor([[2.0], [1.0], [0.5]])
    on = [t.to(DEVICE) for t in (logits, tokens, meta, factors)]
    got = penalised_rows(on[0], None, *on[1:], block=4, history_block=2).cpu()
    want = logits.clone()
    want[0, 5], want[0, 7] = 6.0 / 2, 8.0 / 2 - 2.5
    assert torch.equal(got, want)


def test_fused_rejects_meta_of_another_row_count() -> None:
    """Meta that does not have one column per row is refused with a message naming it."""
    logits, tokens, meta, factors = _case(3, num_rows=3, max_len=8)
    with pytest.raises(ValueError, match="meta"):
        penalised_rows(logits, None, tokens, meta[:, :2], factors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_rows_at_the_bench_size_equal_copy_then_edits() -> None:
    """256 rows x 151,936 bf16, ~1,100-token histories, half the rows with presence / frequency: the one launch
    gives the two launches' rows bit for bit (the compiled kernels, fused multiply-adds included)."""
    num_rows, vocab = 256, 151936
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(torch.bfloat16).cuda()
    tokens = torch.randint(0, vocab, (num_rows, 1200), generator=gen, dtype=torch.int32).cuda()
    tokens[:, 600:700] = tokens[:, 500:600]  # repeats
    ctx = torch.randint(1000, 1200, (num_rows,), generator=gen)
    meta = torch.stack([torch.arange(num_rows), ctx, ctx - 110]).cuda()
    factors = torch.tensor([[1.05], [0.3], [0.2]]).repeat(1, num_rows)
    factors[1:, ::2] = 0.0
    factors = factors.cuda()
    want = _two_launches(logits, None, tokens, meta, factors)
    assert torch.equal(_bits(penalised_rows(logits, None, tokens, meta, factors)), _bits(want))


@pytest.mark.parametrize("every_row", [True, False])
@pytest.mark.parametrize(
    ("route", "counted"),
    [("PENALISED_COPY_FUSED", True), ("REPETITION_FROM_SOURCE", False), ("REPETITION_FROM_SOURCE", True)],
)
def test_penalised_copy_routes_give_the_same_rows(
    every_row: bool, route: str, counted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``penalised_copy`` on each route (the fused launch; repetition alone from the source, which rows with
    presence / frequency must not take) gives the rows the old route gives (copy, then penalties), bit for bit, for
    a batch whose every row is penalised and for one with unpenalised rows between."""
    from fnvllm.executor import fused_sampling
    from fnvllm.executor.history import SlotPenalties
    from fnvllm.executor.sampler import prepare_sampling
    from fnvllm.state import SamplingParams

    _, tokens, meta, factors = _case(6, num_rows=3, max_len=30)
    if not counted:
        factors[1:] = 0.0  # repetition alone
    pen = [SamplingParams(repetition_penalty=float(factors[0, i]), frequency_penalty=float(factors[1, i]),
                          presence_penalty=float(factors[2, i])) for i in range(3)]  # fmt: skip
    params = pen if every_row else [pen[0], SamplingParams(), pen[1], SamplingParams(top_k=3), pen[2]]
    source = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    counts = torch.zeros(2, VOCAB, dtype=torch.int32)
    penalties = SlotPenalties(tokens, meta, factors, counts, counted=counted)
    batch = prepare_sampling(params, [0] * len(params), [None] * len(params), VOCAB, "cpu", penalties)
    assert (batch.penalised is not None) and ((batch.penalised.rows is None) == every_row)
    for name in ("PENALISED_COPY_FUSED", "REPETITION_FROM_SOURCE", "PENALTIES_FROM_SOURCE"):
        monkeypatch.setattr(fused_sampling, name, False)
    want = fused_sampling.penalised_copy(source, batch, kernels=True)
    monkeypatch.setattr(fused_sampling, route, True)
    got = fused_sampling.penalised_copy(source, batch, kernels=True)
    assert want is not None and got is not None
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.equal(want, float_rows_ref(source, batch.penalised.rows))  # the rows are penalised


def test_repetition_from_source_without_the_count_launch_equals_penalize() -> None:
    """``penalize_from_`` told that no row is counted (one launch, each edit from the source) gives rows of
    repetition alone as float_rows + penalize_ give them, bit for bit, repeats and a subset of rows included."""
    from fnvllm.kernels.penalties import penalize_from_

    logits, tokens, meta, factors = _case(8, num_rows=4, max_len=50)
    factors[1:] = 0.0
    source = torch.cat([logits, logits.flip(0)]).to(torch.bfloat16)
    rows = torch.tensor([6, 1, 4, 0])
    on = [t.to(DEVICE) for t in (source, rows, tokens, meta, factors)]
    want = _two_launches(*on)
    counts = torch.zeros(2, VOCAB, dtype=torch.int32, device=DEVICE)
    got = penalize_from_(float_rows(on[0], on[1]), on[0], on[1], *on[2:], counts, None, counted=False)
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.equal(want.cpu(), float_rows_ref(source, rows))

"""The host side of penalised decode steps (issue 19): what is kept between steps while the rows do not change.

``SamplingMemo`` keeps a batch with penalised rows and swaps in each step's penalties; ``SlotHistory`` keeps the
penalised rows' selection (rows, slots, factors) and ``record`` reuses the (slot, context) columns ``penalties``
uploaded. Each cache must follow rows joining, leaving or moving, and params changing: these tests would fail on a
stale one.
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest
import torch
from tiny_models import write_family

import fnvllm.executor.history as history_module
from fnvllm.engine.loop import EngineLoop
from fnvllm.executor.history import SlotHistory
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.executor.sampler import Sampler, SamplingMemo, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams, StepPlan, TokenHistory

VOCAB = 24
CPU = torch.device("cpu")


def _histories(params: tuple[SamplingParams, ...], step: int) -> list[TokenHistory | None]:
    """Per row a history that changes with ``step`` (penalised rows only)."""
    return [
        TokenHistory((1 + i, 2), tuple((3 * i + 5 * k) % VOCAB for k in range(step + 1))) if p.needs_history else None
        for i, p in enumerate(params)
    ]


def _sample(params: tuple[SamplingParams, ...], step: int, memo: SamplingMemo | None) -> torch.Tensor:
    """Greedy-free tokens of one step from fixed logits, the batch through ``memo`` (None: a fresh batch)."""
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(step))
    histories = _histories(params, step)
    batch = prepare_sampling(params, [step] * len(params), histories, VOCAB, CPU, memo=memo)
    return Sampler(seed=step, kernels=False).sample(logits, batch).packed


def test_memo_keeps_a_penalised_batch_and_swaps_its_penalties() -> None:
    """The same params tuple reuses the kept batch's device tensors, with this step's penalties, not the kept ones."""
    params = (SamplingParams(temperature=0.7, repetition_penalty=1.3), SamplingParams(temperature=0.7, top_k=4))
    memo = SamplingMemo()
    first = prepare_sampling(params, [0, 0], _histories(params, 0), VOCAB, CPU, memo=memo)
    later = prepare_sampling(params, [1, 1], _histories(params, 3), VOCAB, CPU, memo=memo)
    assert later.scale is first.scale and later.penalised is first.penalised
    assert first.penalties is not None and later.penalties is not None
    assert not torch.equal(first.penalties.seen_ids, later.penalties.seen_ids)  # type: ignore[attr-defined]


def test_memo_samples_what_fresh_batches_sample_as_rows_change() -> None:
    """Over steps where rows join, leave, move and change params, sampling through the memo gives the tokens fresh
    batches give (a stale batch or stale penalties would pick other tokens)."""
    a = SamplingParams(temperature=0.5, repetition_penalty=3.0)
    b = SamplingParams(temperature=0.5, top_p=0.8, presence_penalty=2.0, frequency_penalty=1.0)
    c = SamplingParams(temperature=0.5)
    d = SamplingParams(temperature=0.5, repetition_penalty=0.4)
    schedule = [(a, b, c), (a, b, c), (a, b, c), (c, a, b), (c, a), (c, a), (d, a, b), (d, a, b)]
    memo = SamplingMemo()
    tuples: dict[tuple[int, ...], tuple[SamplingParams, ...]] = {}
    for step, rows in enumerate(schedule):
        params = tuples.setdefault(tuple(map(id, rows)), tuple(rows))  # the same object while rows are unchanged
        assert torch.equal(_sample(params, step, memo), _sample(params, step, None)), f"step {step}"


def test_memo_rejects_histories_of_the_wrong_length_on_reuse() -> None:
    """A reused penalised batch still checks that the histories have one entry per row."""
    params = (SamplingParams(repetition_penalty=1.2),)
    memo = SamplingMemo()
    prepare_sampling(params, [0], _histories(params, 0), VOCAB, CPU, memo=memo)
    try:
        prepare_sampling(params, [0], [], VOCAB, CPU, memo=memo)
    except ValueError as error:
        assert "histories" in str(error)
    else:
        raise AssertionError("no ValueError for missing histories")


def _plan(slots: tuple[int, ...], params: tuple[SamplingParams, ...], ctx: tuple[int, ...]) -> StepPlan:
    """A decode plan: row i in slot slots[i], feeding one token at position ctx[i] - 1."""
    n = len(slots)
    return StepPlan(
        step=0,
        block_size=4,
        seq_ids=tuple(f"s{s}" for s in slots),
        input_tokens=((1,),) * n,
        start_positions=tuple(c - 1 for c in ctx),
        block_tables=((0,),) * n,
        sample=(True,) * n,
        params=params,
        num_generated=tuple(c // 2 for c in ctx),
        histories=(None,) * n,
        slots=slots,
    )


def _expect(history: SlotHistory, plan: StepPlan) -> None:
    """The step's penalties name exactly the plan's penalised rows: their slots, contexts, counts and factors."""
    rows = range(plan.num_seqs)
    got = history.penalties(plan, rows)
    picked = [i for i in rows if plan.params[i].needs_history]
    assert got is not None
    want_meta = [[plan.slots[i] for i in picked], [plan.start_positions[i] + 1 for i in picked]]
    assert got.meta[:2].tolist() == want_meta
    assert got.meta[2].tolist() == [plan.num_generated[i] for i in picked]
    factors = [[plan.params[i].repetition_penalty for i in picked], [plan.params[i].frequency_penalty for i in picked]]
    assert torch.allclose(got.factors[:2], torch.tensor(factors, dtype=torch.float32))


def test_slot_history_follows_slots_and_params() -> None:
    """The kept selection is rebuilt when the slots move under the same params object, or the params change."""
    pen = (SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams(frequency_penalty=0.5))
    history = SlotHistory(num_slots=4, max_len=16, vocab_size=VOCAB, device=CPU)
    _expect(history, _plan((0, 1, 2), pen, (3, 4, 5)))
    _expect(history, _plan((0, 1, 2), pen, (4, 5, 6)))  # kept: only the contexts move
    _expect(history, _plan((2, 1, 0), pen, (5, 6, 7)))  # same params object, slots reordered
    other = (SamplingParams(), SamplingParams(repetition_penalty=0.7), SamplingParams(frequency_penalty=0.5))
    _expect(history, _plan((2, 1, 0), other, (6, 7, 8)))  # params changed
    _expect(history, _plan((2, 1), other[:2], (7, 8)))  # a row left


def test_record_writes_each_penalised_row_at_its_context() -> None:
    """``record`` after ``penalties`` writes every penalised row's token at its context length, skips unpenalised
    rows, and skips a row at max_len (the reused upload and the fallback alike)."""
    params = (SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams(presence_penalty=0.5))
    history = SlotHistory(num_slots=3, max_len=8, vocab_size=VOCAB, device=CPU)
    history.in_use = True
    for ctx, sampled in (((3, 4, 5), (11, 12, 13)), ((4, 5, 8), (14, 15, 16)), ((5, 6, 7), (17, 18, 19))):
        plan = _plan((0, 1, 2), params, ctx)
        history.penalties(plan, range(3))
        history.record(plan, range(3), torch.tensor(sampled))
    tokens = history._buffer()
    assert tokens[0, 3:6].tolist() == [11, 14, 17]
    assert tokens[1].tolist() == [0] * 8  # not penalised: never written
    assert tokens[2, 5].item() == 13 and tokens[2, 7].item() == 19  # ctx 8 = max_len: skipped
    plan = _plan((1, 0, 2), params, (6, 2, 2))  # moved rows, record without penalties first
    history.record(plan, range(3), torch.tensor([21, 22, 23]))
    assert tokens[1, 6].item() == 21 and tokens[2, 2].item() == 23 and tokens[0, 2].item() == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("penalty_host"), "qwen3")


def test_mixed_penalised_rows_leaving_equal_each_alone(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy requests with different penalties (and none), finishing at different steps in an overlapped loop (the
    kept batch and selection are rebuilt as rows leave), each produce what they produce alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 10))] for _ in range(5)]
    settings = [
        dict(repetition_penalty=1.8),
        dict(),
        dict(presence_penalty=1.5, frequency_penalty=0.7),
        dict(repetition_penalty=0.6, presence_penalty=-1.0),
        dict(repetition_penalty=1.8),
    ]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, **s) for i, s in enumerate(settings)]
    monkeypatch.setattr(ModelExecutor, "supports_overlap", property(lambda self: True))
    llm = LLM(checkpoint, dtype="float32", block_size=8, num_blocks=256)
    llm.loop = EngineLoop(llm.engine, overlap=True)
    together = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [list(llm.generate([p], [q], use_tqdm=False)[0].token_ids) for p, q in zip(prompts, params, strict=True)]
    assert together == alone
    assert llm.loop.overlap_stats.kept > 0


def _decode_plan(slots: tuple[int, ...], params: tuple[SamplingParams, ...], ctx: tuple[int, ...],
                 generated: tuple[int, ...], fed: tuple[int, ...] | None = None) -> StepPlan:  # fmt: skip
    """A plan whose row i (slot slots[i]) feeds fed[i] tokens (default 1) up to context ctx[i], generated[i] outputs."""
    fed = fed or (1,) * len(slots)
    return attrs.evolve(
        _plan(slots, params, ctx),
        input_tokens=tuple((1,) * f for f in fed),
        start_positions=tuple(c - f for c, f in zip(ctx, fed, strict=True)),
        num_generated=generated,
    )


def _meta_of(plan: StepPlan, max_len: int) -> list[list[int]]:
    """The (4, P) columns a fresh upload would hold: slot, context, outputs, slot * max_len + context."""
    picked = [i for i in range(plan.num_seqs) if plan.params[i].needs_history]
    ctx = [plan.start_positions[i] + len(plan.input_tokens[i]) for i in picked]
    slots = [plan.slots[i] for i in picked]
    flat = [s * max_len + c for s, c in zip(slots, ctx, strict=True)]
    return [slots, ctx, [plan.num_generated[i] for i in picked], flat]


def test_columns_moved_on_the_device_equal_fresh_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept rows whose contexts and outputs all move by one amount get the last columns plus that amount (no
    upload; the same tensor when nothing moved); rows moving unevenly, or new rows, are uploaded; every step's
    columns equal the plan's own, and ``penalties`` hands the kernels the first three."""
    uploads = []
    real = history_module.upload
    monkeypatch.setattr(history_module, "upload", lambda a, d: uploads.append(a.shape) or real(a, d))
    params = (SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams(frequency_penalty=0.5))
    history = SlotHistory(num_slots=4, max_len=32, vocab_size=VOCAB, device=CPU)
    history.advance = True  # as on a GPU
    steps = [  # (slots, ctx, generated, fed), uploads of (4, P) columns expected
        (((0, 1, 3), (5, 6, 9), (1, 0, 4), None), 1),  # new rows: uploaded
        (((0, 1, 3), (6, 7, 10), (2, 1, 5), None), 0),  # a decode step: + (0, 1, 1, 1) on the device
        (((0, 1, 3), (7, 8, 11), (3, 2, 6), None), 0),  # again
        (((0, 1, 3), (7, 8, 11), (3, 2, 6), None), 0),  # nothing moved: the same columns
        (((0, 1, 3), (9, 9, 12), (3, 2, 6), (2, 1, 1)), 1),  # penalised rows' contexts by 2 and 1: uploaded
        (((0, 1, 3), (11, 10, 14), (3, 2, 7), (2, 1, 2)), 1),  # contexts by 2, outputs by 0 and 1: uploaded
        (((0, 1, 3), (13, 11, 16), (3, 2, 7), (2, 1, 2)), 0),  # contexts by 2, outputs by 0: on the device
        (((3, 1, 0), (14, 12, 17), (4, 3, 8), None), 1),  # slots moved under the same params: new selection
    ]
    last = None
    for (slots, ctx, generated, fed), want_uploads in steps:
        del uploads[:]
        plan = _decode_plan(slots, params, ctx, generated, fed)
        got = history.penalties(plan, range(3))
        assert got is not None and history._step is not None
        assert history._step.meta.tolist() == _meta_of(plan, 32), (ctx, generated)
        assert got.meta.tolist() == _meta_of(plan, 32)[:3]
        assert uploads.count((4, 2)) == want_uploads, (ctx, uploads)  # the (4, P) columns, P = 2
        if ctx == (7, 8, 11) and last is not None and last[0] == ctx:
            assert history._step.meta is last[1]
        last = (ctx, history._step.meta)


def test_record_puts_tokens_at_the_moved_columns() -> None:
    """After columns moved on the device, ``record`` puts each penalised row's token at slot * max_len + ctx, and a
    row at max_len sends the step to the per-row fallback, which skips it."""
    params = (SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams(presence_penalty=0.5))
    history = SlotHistory(num_slots=3, max_len=8, vocab_size=VOCAB, device=CPU)
    history.in_use, history.advance = True, True
    for k in range(4):  # contexts (4, 5, 5) .. (7, 8, 8): the last step's rows 1, 2 are at max_len
        plan, rows = _decode_plan((0, 1, 2), params, (4 + k, 5 + k, 5 + k), (k, k, k)), range(3)
        history.penalties(plan, rows)
        history.record(plan, rows, torch.tensor([10 + k, 20 + k, 30 + k]))  # the same rows: the kept columns
    tokens = history._buffer()
    assert tokens[0, 4:8].tolist() == [10, 11, 12, 13]
    assert tokens[1].tolist() == [0] * 8  # not penalised
    assert tokens[2, 5:8].tolist() == [30, 31, 32]  # ctx 8 = max_len: the fourth token has no place


def test_penalties_say_whether_a_row_is_counted() -> None:
    """``SlotPenalties.counted`` is False when every penalised row has repetition alone (the one-launch route) and
    True as soon as one has a frequency or presence penalty."""
    history = SlotHistory(num_slots=3, max_len=16, vocab_size=VOCAB, device=CPU)
    alone = (SamplingParams(repetition_penalty=1.2), SamplingParams(), SamplingParams(repetition_penalty=0.9))
    got = history.penalties(_plan((0, 1, 2), alone, (3, 4, 5)), range(3))
    assert got is not None and not got.counted
    for extra in (dict(frequency_penalty=0.1), dict(presence_penalty=-0.5)):
        mixed = (*alone[:2], SamplingParams(repetition_penalty=0.9, **extra))
        got = history.penalties(_plan((0, 1, 2), mixed, (3, 4, 5)), range(3))
        assert got is not None and got.counted

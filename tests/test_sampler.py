"""Tests of the batched sampler (fnvllm/executor/sampler.py) on CPU tensors."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from fnvllm.executor.penalties import apply_penalties
from fnvllm.executor.sampler import Sampler, SamplingBatch, prepare_sampling
from fnvllm.executor.seeded_noise import seed_keys, seeded_uniforms
from fnvllm.state.errors import InvalidRequestError
from fnvllm.state.params import SamplingParams
from fnvllm.state.plan import TokenHistory

CHI2_CRITICAL_7DOF_P999 = 24.322


def _batch(
    params: list[SamplingParams],
    vocab_size: int,
    num_generated: list[int] | None = None,
    histories: list[TokenHistory | None] | None = None,
) -> SamplingBatch:
    """A CPU SamplingBatch with zero generated tokens and no histories unless given."""
    num_generated = num_generated if num_generated is not None else [0] * len(params)
    histories = histories if histories is not None else [None] * len(params)
    return prepare_sampling(params, num_generated, histories, vocab_size, "cpu")


def _logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Random float32 logits (num_rows, vocab_size) with a spread like a real model's."""
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def _draw_counts(sampler: Sampler, row: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """(V,) counts of `num_draws` samples of one logits row, drawn as one batch (seeded rows get seed + i)."""
    logits = row.expand(num_draws, -1).contiguous()
    rows = [params if params.seed is None else attrs.evolve(params, seed=params.seed + i) for i in range(num_draws)]
    tokens = sampler.sample(logits, _batch(rows, row.shape[-1])).token_ids
    return torch.bincount(tokens, minlength=row.shape[-1])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square statistic of observed counts against expected probabilities."""
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_greedy_equals_argmax() -> None:
    """Temperature-0 rows return the argmax of their logits."""
    logits = _logits(16, 100)
    out = Sampler().sample(logits, _batch([SamplingParams(temperature=0.0)] * 16, 100))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 5.0, 100.0])
def test_top_k_one_equals_greedy(temperature: float) -> None:
    """top_k=1 returns the argmax whatever the temperature."""
    logits = _logits(32, 50, seed=1)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i if i % 2 else None) for i in range(32)]
    assert torch.equal(Sampler(seed=3).sample(logits, _batch(params, 50)).token_ids, logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    """In a batch mixing greedy and random rows, the greedy rows still return their argmax."""
    logits = _logits(20, 64, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(20)]
    tokens = Sampler().sample(logits, _batch(params, 64)).token_ids
    assert torch.equal(tokens[1::2], logits.argmax(dim=-1)[1::2])


def test_seeded_rows_do_not_depend_on_batch_mates_or_row() -> None:
    """A seeded row draws the same tokens whatever its batch mates, row index and the shared RNG's state."""
    vocab = 500
    target = torch.zeros(vocab)  # flat logits: the token is decided by the noise alone
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(num_mates: int, row: int, sampler_seed: int, n: int) -> int:
        logits = _logits(num_mates + 1, vocab, seed=sampler_seed)
        logits[row] = target
        mates = [SamplingParams(temperature=0.9, seed=s) for s in range(num_mates)]
        rows = [*mates[:row], params, *mates[row:]]
        batch = _batch(rows, vocab, num_generated=[n] * (num_mates + 1))
        return int(Sampler(seed=sampler_seed).sample(logits, batch).token_ids[row])

    for n in range(5):
        alone = run(0, 0, 0, n)
        assert run(7, 3, 1, n) == alone
        assert run(12, 12, 2, n) == alone
    assert len({run(0, 0, 0, n) for n in range(20)}) > 10  # the n-th draw really moves with n


def test_seeded_uniforms_are_a_pure_function_of_seed_and_counter() -> None:
    """A draw's uniform depends only on its own (seed, counter), lies in (0, 1), and moves with either."""
    together = seeded_uniforms([1, 2, 3], [5, 5, 5])
    assert together[1] == seeded_uniforms([2], [5])[0]
    assert ((together > 0) & (together < 1)).all()
    assert seeded_uniforms([2], [6])[0] != together[1] and len(set(together.tolist())) == 3


def test_seed_keys_accept_any_int_seed() -> None:
    """Negative and larger-than-64-bit seeds give 32-bit keys, distinct for each (seed, counter)."""
    keys = seed_keys([-1, 2**70 + 5, 0, 0], [0, 0, 0, 1])
    assert keys.shape == (4, 2) and keys.min() >= 0 and keys.max() < 2**32
    assert len({tuple(k) for k in keys.tolist()}) == 4


def test_unseeded_rows_differ_across_draws() -> None:
    """Two draws of the shared generator differ, and two Sampler seeds give different streams."""
    logits = torch.zeros(64, 1000)
    batch = _batch([SamplingParams(temperature=1.0)] * 64, 1000)
    sampler = Sampler(seed=0)
    first, second = sampler.sample(logits, batch).token_ids, sampler.sample(logits, batch).token_ids
    assert not torch.equal(first, second)
    assert torch.equal(first, Sampler(seed=0).sample(logits, batch).token_ids)
    assert not torch.equal(first, Sampler(seed=1).sample(logits, batch).token_ids)


def _allowed(row: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens a filter may return, computed independently of the sampler (no ties in `row`)."""
    probs = (row / params.temperature).softmax(dim=-1)
    order = probs.argsort(descending=True).tolist()
    if params.top_k is not None:
        order = order[: params.top_k]
    kept = probs[order] / probs[order].sum()
    mass_before = torch.cumsum(kept, 0) - kept  # mass of the strictly more likely tokens
    order = [t for t, m in zip(order, mass_before.tolist(), strict=True) if m < params.top_p]
    return {t for t in order if probs[t] >= params.min_p * probs[order[0]]}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.8, min_p=0.15),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7),
        SamplingParams(temperature=2.0, top_k=6, top_p=0.9, min_p=0.2, seed=9),
    ],
)
def test_filters_never_sample_a_filtered_token(params: SamplingParams) -> None:
    """Over many draws, top-k / top-p / min-p return only allowed tokens, and every allowed token appears."""
    row = torch.linspace(3.0, -3.0, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(5))]
    counts = _draw_counts(Sampler(seed=4), row, params, 4000)
    sampled = set(counts.nonzero().flatten().tolist())
    allowed = _allowed(row, params)
    assert sampled == allowed, (sampled, allowed)
    assert 1 < len(allowed) < 12


def test_filters_in_a_mixed_batch_apply_per_row() -> None:
    """Rows with and without top-k, top-p and greedy in one batch each keep to their own allowed set."""
    row = torch.linspace(3.0, -3.0, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(6))]
    kinds = [
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=0.0),
    ]
    params = kinds * 1000
    logits = row.expand(len(params), -1).contiguous()
    tokens = Sampler(seed=5).sample(logits, _batch(params, 12)).token_ids
    for i, kind in enumerate(kinds[:3]):
        assert set(tokens[i :: len(kinds)].tolist()) == _allowed(row, kind)
    assert set(tokens[3 :: len(kinds)].tolist()) == {int(row.argmax())}


def test_temperature_sampling_matches_softmax_chi_square() -> None:
    """Counts of T=0.7 draws from the shared generator fit softmax(logits / T) (chi-square, 7 dof)."""
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    counts = _draw_counts(Sampler(seed=2024), row, SamplingParams(temperature=0.7), 20_000)
    assert _chi_square(counts, (row / 0.7).softmax(dim=-1)) < CHI2_CRITICAL_7DOF_P999


def test_seeded_sampling_matches_softmax_chi_square() -> None:
    """Counts over 20k differently seeded rows fit softmax(logits / T), so the hashed noise is unbiased."""
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(20_000)]
    logits = row.expand(len(params), -1).contiguous()
    tokens = Sampler().sample(logits, _batch(params, 8, num_generated=[3] * len(params))).token_ids
    counts = torch.bincount(tokens, minlength=8)
    assert _chi_square(counts, (row / 0.7).softmax(dim=-1)) < CHI2_CRITICAL_7DOF_P999


def test_repetition_penalty_matches_transformers() -> None:
    """Repetition penalty on prompt + output tokens equals transformers' RepetitionPenaltyLogitsProcessor."""
    vocab, penalties = 40, [1.0, 1.3, 0.7, 2.0]
    logits = _logits(len(penalties), vocab, seed=6)
    gen = torch.Generator().manual_seed(7)
    prompts = [tuple(torch.randint(0, vocab, (6,), generator=gen).tolist()) for _ in penalties]
    outputs = [tuple(torch.randint(0, vocab, (4,), generator=gen).tolist()) for _ in penalties]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    histories = [TokenHistory(prompt=p, output=o) for p, o in zip(prompts, outputs, strict=True)]
    batch = _batch(params, vocab, histories=histories)
    assert batch.penalties is not None and batch.penalised is not None and batch.penalised.rows is not None
    assert batch.penalised.rows.tolist() == [1, 2, 3]  # penalty 1.0 is no penalty: row 0 is sampled as it is
    ours = apply_penalties(logits[1:], batch.penalties)  # the penalties address the penalised rows' copy
    for i, penalty in enumerate(penalties[1:], start=1):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i - 1 : i], expected, rtol=0, atol=0)
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    tokens = Sampler().sample(logits, _batch(greedy, vocab, histories=histories)).token_ids
    assert torch.equal(tokens, torch.cat([logits[:1], ours]).argmax(dim=-1))


def test_presence_and_frequency_penalties_on_output_tokens() -> None:
    """Presence subtracts once per distinct output token, frequency per occurrence; prompt is untouched."""
    logits = torch.zeros(1, 6)
    history = TokenHistory(prompt=(0, 1), output=(2, 2, 2, 3))
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    batch = _batch([params], 6, histories=[history])
    assert batch.penalties is not None
    expected = torch.tensor([[0.0, 0.0, -0.5 - 0.75, -0.5 - 0.25, 0.0, 0.0]])
    torch.testing.assert_close(apply_penalties(logits, batch.penalties), expected)


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    """Top-n and sampled logprobs are the log_softmax of the raw logits, whatever penalties and filters."""
    logits = _logits(6, 30, seed=8)
    history = TokenHistory(prompt=(1, 2), output=(3,))
    params = [SamplingParams(temperature=0.8, top_k=4, logprobs=i % 4, repetition_penalty=1.5) for i in range(6)]
    out = Sampler().sample(logits, _batch(params, 30, histories=[history] * 6))
    assert out.logprobs is not None
    reference = logits.log_softmax(dim=-1)
    top = reference.topk(3, dim=-1)
    torch.testing.assert_close(out.logprobs.top_logprobs, top.values)
    assert torch.equal(out.logprobs.top_ids, top.indices)
    torch.testing.assert_close(out.logprobs.sampled_logprobs, reference.gather(1, out.token_ids[:, None])[:, 0])


def test_no_logprobs_unless_asked() -> None:
    """A batch where no row asked for logprobs returns none."""
    out = Sampler().sample(_logits(2, 10), _batch([SamplingParams()] * 2, 10))
    assert out.logprobs is None


def test_input_logits_are_not_modified() -> None:
    """Sampling with penalties and filters leaves the caller's logits tensor unchanged."""
    logits = _logits(3, 20, seed=9)
    before = logits.clone()
    params = [SamplingParams(top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=2.0)] * 3
    Sampler().sample(logits, _batch(params, 20, histories=[TokenHistory((1,), (2,))] * 3))
    assert torch.equal(logits, before)


def test_bad_inputs_raise_clear_errors() -> None:
    """Mismatched lengths, missing histories, out-of-vocab history ids and bad logits shapes are rejected."""
    with pytest.raises(ValueError, match="one entry per row"):
        prepare_sampling([SamplingParams()], [0, 0], [None], 10, "cpu")
    with pytest.raises(ValueError, match=r"histories\[0\]"):
        _batch([SamplingParams(repetition_penalty=1.2)], 10)
    with pytest.raises(InvalidRequestError, match=r"\[0, 10\)"):
        _batch([SamplingParams(presence_penalty=1.0)], 10, histories=[TokenHistory((1,), (10,))])
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler().sample(torch.zeros(2, 11), _batch([SamplingParams()] * 2, 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling_never_syncs_and_matches_cpu_on_deterministic_rows() -> None:
    """On CUDA, sample() makes no host synchronisation, and greedy and seeded rows give the CPU's tokens."""
    vocab = 4096
    logits = _logits(6, vocab, seed=10)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=50, seed=5, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=6),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, repetition_penalty=1.3, presence_penalty=0.5, seed=7),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, top_k=1),
    ]
    histories = [TokenHistory(prompt=(1, 2, 3), output=(4, 4, 5))] * len(params)
    num_generated = [3] * len(params)
    cpu = Sampler().sample(logits, prepare_sampling(params, num_generated, histories, vocab, "cpu"))
    batch = prepare_sampling(params, num_generated, histories, vocab, "cuda")
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = Sampler().sample(gpu_logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    deterministic = [0, 1, 2, 4, 5]
    assert torch.equal(gpu.token_ids.cpu()[deterministic], cpu.token_ids[deterministic])
    assert gpu.logprobs is not None and cpu.logprobs is not None
    torch.testing.assert_close(gpu.logprobs.top_logprobs.cpu(), cpu.logprobs.top_logprobs)


def test_graph_rows_worked_example() -> None:
    """Rows that sample by temperature alone (greedy rows with filters included: greedy ignores them) give their
    inverse temperatures and seeded rows, and no filter arrays; the uniforms, scales and seeded flags are
    prepare_sampling's."""
    from fnvllm.executor.sampler import graph_rows

    params = [
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=0.0, top_p=0.9, top_k=5),
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=2.0, seed=9, top_k=500),  # a top-k past the vocabulary is off
    ]
    rows = graph_rows(params, 100)
    assert rows is not None and rows.top_k is None and rows.top_p is None and rows.min_p is None
    assert rows.scale.dtype == np.float32 and rows.scale.tolist() == pytest.approx([1 / 0.6, 0.0, 1.0, 0.0, 0.5])
    assert rows.fixed.tolist() == [0, 0, 1, 0, 1] and rows.seeded.tolist() == [2, 4] and rows.seeds == (7, 9)
    num_generated = [3, 0, 11, 2, 5]
    batch = _batch(params, 100, num_generated)
    assert torch.equal(torch.from_numpy(rows.uniforms(num_generated)), batch.uniforms)
    assert torch.equal(torch.from_numpy(rows.scale), batch.scale)
    assert torch.equal(torch.from_numpy(rows.fixed), batch.fixed)


def test_graph_rows_with_top_k_carry_prepare_samplings_filters() -> None:
    """Rows with a top-k within the limit (with a top-p or a min-p too) beside plain and greedy rows: the filter
    arrays are prepare_sampling's, neutral on the other rows."""
    from fnvllm.executor.sampler import graph_rows

    params = [
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(temperature=1.1, top_k=38, min_p=0.05, seed=4),
    ]
    rows = graph_rows(params, 1000, max_top_k=38)
    assert rows is not None and rows.top_k is not None and rows.top_p is not None and rows.min_p is not None
    batch = _batch(params, 1000, [0, 0, 0, 6])
    assert rows.top_k.tolist() == [20, 0, 0, 38] and torch.equal(torch.from_numpy(rows.top_k), batch.top_k)
    assert torch.equal(torch.from_numpy(rows.top_p), batch.top_p)
    assert torch.equal(torch.from_numpy(rows.min_p), batch.min_p)
    assert graph_rows(params, 1000, max_top_k=37) is None, "a top-k past the limit samples eagerly"


@pytest.mark.parametrize(
    "extra",
    [
        {"top_p": 0.95},
        {"min_p": 0.05},
        {"top_k": 20, "repetition_penalty": 1.05},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"logit_bias": {3: 1.0}},
        {"top_k": 41},
    ],
)
def test_graph_rows_refuse_any_other_option(extra: dict[str, object]) -> None:
    """One row with a filter but no top-k within the limit, a penalty or a logit bias beside plain rows: the batch
    is not sampled in the graphs (they leave it to the eager sampler)."""
    from fnvllm.executor.sampler import graph_rows

    plain = SamplingParams(temperature=0.7)
    assert graph_rows([plain, plain], 100, max_top_k=40) is not None
    assert graph_rows([plain, SamplingParams(temperature=0.7, **extra), plain], 100, max_top_k=40) is None  # type: ignore[arg-type]


def test_graph_rows_refuse_a_grammar_row() -> None:
    """A grammar-constrained row (its mask is applied before sampling) is not sampled in the graphs."""
    from fnvllm.executor.sampler import graph_rows
    from fnvllm.state.params import StructuredOutput

    constrained = SamplingParams(temperature=0.7, structured=StructuredOutput.choice(["a", "b"]))
    assert graph_rows([SamplingParams(temperature=0.7), constrained], 100) is None


def test_graph_rows_name_the_logprob_rows() -> None:
    """Logprob rows sample in the graphs too: GraphRows names them (ascending) and the most any asked, as
    prepare_sampling does; without any, none."""
    from fnvllm.executor.sampler import graph_rows

    params = [
        SamplingParams(temperature=0.6, logprobs=2),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.9, top_k=4, logprobs=0),
    ]
    rows = graph_rows(params, 1000, max_top_k=10)
    batch = _batch(params, 1000)
    assert rows is not None and rows.logprob_rows == (0, 2, 3) and rows.max_logprobs == 5
    assert batch.logprob_rows is not None and batch.logprob_rows.tolist() == list(rows.logprob_rows)
    assert batch.max_logprobs == rows.max_logprobs
    plain = graph_rows([SamplingParams(temperature=0.6)], 1000)
    assert plain is not None and plain.logprob_rows == () and plain.max_logprobs is None


@st.composite
def _row_params(draw: st.DrawFn) -> SamplingParams:
    """One row's sampling: any mix of temperature (greedy included), top-k / top-p / min-p, seed, logprobs and, rarely,
    a penalty or a logit bias."""
    temperature = draw(st.sampled_from([0.0, 0.5, 1.0, 1.7]))
    return SamplingParams(
        temperature=temperature,
        top_k=draw(st.sampled_from([None, 1, 3, 12, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**31))),
        logprobs=draw(st.sampled_from([None, 0, 3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.0, 1.1])),
        logit_bias=draw(st.sampled_from([None, None, None, {2: 0.5}])),
    )


@given(params=st.lists(_row_params(), min_size=1, max_size=6), generated=st.integers(0, 40))
def test_graph_rows_agree_with_prepare_sampling(params: list[SamplingParams], generated: int) -> None:
    """For any batch: graph_rows refuses it exactly when a row has a penalty or a logit bias, or filters without a
    top-k in [1, 12]; otherwise every array it stages is prepare_sampling's (so the graphs draw what the eager
    sampler draws)."""
    from fnvllm.executor.sampler import graph_rows

    vocab = 40
    rows = graph_rows(params, vocab, max_top_k=12)
    batch = _batch(params, vocab, [generated + i for i in range(len(params))], [HISTORY_FOR_GRAPH] * len(params))
    filtered = [
        p for p in params
        if p.temperature >= 1e-5 and p.top_k != 1
        and ((p.top_k is not None and p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0)
    ]  # fmt: skip
    refused = any(p.needs_history or p.logit_bias for p in params) or any(
        p.top_k is None or not 1 <= p.top_k <= 12 for p in filtered
    )
    assert (rows is None) == refused
    if rows is None:
        return
    assert torch.equal(torch.from_numpy(rows.scale), batch.scale)
    assert torch.equal(torch.from_numpy(rows.fixed), batch.fixed)
    assert torch.equal(torch.from_numpy(rows.uniforms([generated + i for i in range(len(params))])), batch.uniforms)
    if rows.top_k is None:
        assert not filtered
    else:
        assert torch.equal(torch.from_numpy(rows.top_k), batch.top_k)
        assert torch.equal(torch.from_numpy(rows.top_p), batch.top_p)
        assert torch.equal(torch.from_numpy(rows.min_p), batch.min_p)
    asked = [] if batch.logprob_rows is None else batch.logprob_rows.tolist()
    assert list(rows.logprob_rows) == asked and rows.max_logprobs == batch.max_logprobs


HISTORY_FOR_GRAPH = TokenHistory((1, 2, 3), (4, 5))

"""The sampler's two backends (fnvllm/executor/fused_sampling.py): the Triton kernels (under TRITON_INTERPRET on
CPU) and their torch references give the same tokens for the same uniforms in mixed batches; one row's options
never change another row's token; non-finite rows are reported."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import write_family

from fnvllm.executor import fused_sampling
from fnvllm.executor.fused_sampling import NonFiniteLogitsError, check_finite
from fnvllm.executor.sampler import Sampler, SamplingBatch, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams
from fnvllm.state.plan import TokenHistory

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
VOCAB = 96
HISTORY = TokenHistory(prompt=(1, 2, 3, 50), output=(4, 4, 7, 60))
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.8, repetition_penalty=1.3),
    SamplingParams(temperature=1.2, top_p=0.7, presence_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=3),
    SamplingParams(temperature=0.6, top_k=1, logprobs=0),
    SamplingParams(temperature=1.0, top_k=VOCAB + 5, logprobs=2),
]


def _batch(params: list[SamplingParams], num_generated: int = 0) -> SamplingBatch:
    """A CPU batch; every row seeded (seed = row + 100) unless it already has a seed."""
    seeded = [p if p.seed is not None else _with_seed(p, 100 + i) for i, p in enumerate(params)]
    histories = [HISTORY if p.needs_history else None for p in seeded]
    return prepare_sampling(seeded, [num_generated] * len(params), histories, VOCAB, DEVICE)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import attrs

    return attrs.evolve(params, seed=seed)


def _logits(num_rows: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random logits with a real model's spread, on DEVICE."""
    return (torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("filter_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_and_references_sample_the_same_tokens_in_a_mixed_batch(
    dtype: torch.dtype, filter_kernel: bool
) -> None:
    """Every option mix (greedy, temperature, filters, penalties, logprobs), seeded: the kernels' tokens and
    logprobs equal the references' over several draws (the same uniforms, so exactly the same tokens), with the
    filtered rows drawn by sorting on the device (the default) or by the filter kernel."""
    for step in range(3):
        logits = _logits(len(MIXED), seed=step, dtype=dtype)
        batch = _batch(MIXED, num_generated=step)
        kernels = Sampler(kernels=True, filter_kernel=filter_kernel).sample(logits, batch)
        refs = Sampler(kernels=False).sample(logits, batch)
        assert kernels.token_ids.tolist() == refs.token_ids.tolist()
        assert kernels.non_finite.tolist() == [False] * len(MIXED)
        assert kernels.logprobs is not None and refs.logprobs is not None
        torch.testing.assert_close(kernels.logprobs.sampled_logprobs, refs.logprobs.sampled_logprobs)
        torch.testing.assert_close(kernels.logprobs.top_logprobs, refs.logprobs.top_logprobs)
    assert refs.token_ids[0] == logits[0].float().argmax()  # greedy rows are the argmax


def test_one_rows_options_do_not_change_another_rows_token() -> None:
    """A seeded row's token is the same alone, among plain rows, and among rows with filters, penalties, logprobs
    and greedy decoding, at any position (kernels)."""
    target = SamplingParams(temperature=0.9, seed=7)
    row = _logits(1, seed=9)
    alone = Sampler(kernels=True).sample(row, _batch([target])).token_ids[0]
    for mates in (MIXED[:4], MIXED[4:8], MIXED[8:]):
        for at in (0, len(mates)):
            params = [*mates[:at], target, *mates[at:]]
            logits = _logits(len(params), seed=at)
            logits[at] = row[0]
            assert Sampler(kernels=True).sample(logits, _batch(params)).token_ids[at] == alone


def test_penalised_and_filtered_rows_form_their_own_groups() -> None:
    """prepare_sampling sends only penalised rows to the penalised copy and only filtering rows to the filter
    kernel (greedy rows never filter, and a top_k at least the vocabulary is no filter)."""
    batch = _batch(MIXED)
    assert batch.plain is not None and batch.penalised is not None
    assert batch.penalised.rows is not None and batch.penalised.rows.tolist() == [6, 7, 8]
    assert batch.plain.filtered.tolist() == [2, 3, 4, 5]
    assert batch.plain.filtered_programs.tolist() == [2, 3, 4, 5]  # rows 0-5 are the plain rows 0-5
    assert batch.penalised.filtered.tolist() == [7] and batch.penalised.filtered_sources.tolist() == [1]
    assert batch.penalised.filtered_programs.tolist() == [1]
    assert batch.logprob_rows is not None and batch.logprob_rows.tolist() == [8, 9, 10]
    plain = _batch([SamplingParams(temperature=0.6)] * 3)
    assert plain.penalised is None and plain.plain is not None and plain.plain.rows is None
    assert plain.plain.filtered.numel() == 0 and plain.logprob_rows is None


def test_non_finite_rows_are_named() -> None:
    """Flags set -> NonFiniteLogitsError naming the sequences; no flags -> nothing."""
    check_finite([0, 0], ["a", "b"])
    with pytest.raises(NonFiniteLogitsError, match=r"1 sampled sequence\(s\), e.g. \['b'\]"):
        check_finite([0, 1], ["a", "b"])


def test_kernels_flag_a_non_finite_row_only() -> None:
    """A NaN in one row (filtered or not) sets that row's flag and no other."""
    logits = _logits(len(MIXED), seed=4)
    logits[3, 10] = math.nan
    logits[6, 0] = math.inf
    flags = Sampler(kernels=True).sample(logits, _batch(MIXED)).non_finite.tolist()
    assert flags == [i in (3, 6) for i in range(len(MIXED))]


def test_a_checkpoint_producing_nan_logits_is_reported_by_the_executor(tmp_path: Path) -> None:
    """NaN weights -> NonFiniteLogitsError naming the request (not a token 0 or an invalid id); the loop stays
    usable."""
    llm = LLM(write_family(tmp_path, "qwen3"), device="cpu", dtype="float32", attention_backend="torch")
    with torch.no_grad():
        llm.executor.model.model.norm.weight.fill_(math.nan)
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite logits for 1 sampled sequence"):
        llm.generate([[5, 9, 13]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert not llm.state.running


TOP_K_ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.8, top_k=12, min_p=0.05),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.2, top_k=7, top_p=0.5, repetition_penalty=1.3),
]


@pytest.mark.parametrize("by_filter_kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_rows_sort_only_their_candidates_and_match_the_references(
    dtype: torch.dtype, by_filter_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When every filtered row has a top-k, both routes (the filter kernel, or each row's best candidates by one
    topk and candidates_pick) give exactly the references' tokens for the same uniforms, across several draws."""
    monkeypatch.setattr(fused_sampling, "TOP_K_BY_FILTER_KERNEL", by_filter_kernel)
    batch = _batch(TOP_K_ROWS)
    assert batch.candidates is not None and batch.candidates < VOCAB
    for step in range(4):
        logits = _logits(len(TOP_K_ROWS), seed=10 + step, dtype=dtype)
        batch = _batch(TOP_K_ROWS, num_generated=step)
        kernels = Sampler(kernels=True).sample(logits, batch)
        refs = Sampler(kernels=False).sample(logits, batch)
        assert kernels.token_ids.tolist() == refs.token_ids.tolist()

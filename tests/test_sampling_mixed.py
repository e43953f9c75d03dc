"""Per-row sampling settings in mixed batches (issue 17): each row keeps its own filters, and ``logprobs=0``
returns the sampled token's logprob with no alternatives, through the sampler, the executor and ``LLM``."""

from __future__ import annotations

import pytest
import torch

from fnvllm.demo import model_path
from fnvllm.executor.sampler import Sampler, prepare_sampling
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

P_VALUE_FLOOR = 1e-4  # a correct sampler fails a test at this level about once in 10,000 runs


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (zero-probability cells must be empty)."""
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    live = probs > 0
    expected = probs[live].double() * counts.sum()
    stat = float(((counts[live].double() - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def filtered_distribution(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The exact distribution a row samples from, by sorting (an independent oracle): softmax(row / T) cut to the
    top-k, then to the nucleus top-p of the top-k renormalised mass, then below min_p * max, renormalised."""
    probs = (row.double() / params.temperature).softmax(dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    top = order[: params.top_k] if params.top_k is not None else order
    kept = probs[top] / probs[top].sum()
    mass_before = kept.cumsum(0) - kept
    keep[top[mass_before < params.top_p]] = True
    keep &= probs >= params.min_p * probs.max()
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


ROW = torch.tensor([2.0, 1.4, 1.1, 0.3, -0.2, -0.9, 0.7, -1.5])


@pytest.mark.parametrize(
    "kinds",
    [
        [SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=1.0)],
        [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, min_p=0.25)],
        [SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.2), SamplingParams(top_k=3)],
        [SamplingParams(temperature=0.8, top_k=4, min_p=0.2), SamplingParams(temperature=1.0, top_p=0.8)],
    ],
)
def test_each_row_of_a_mixed_batch_samples_its_own_filtered_distribution(kinds: list[SamplingParams]) -> None:
    """In a batch mixing rows with and without min-p / top-p / top-k, each kind's draws fit its own exact filtered
    distribution (chi-square), so one row without a filter never disables it for the others."""
    draws = 6000
    params = kinds * draws
    logits = ROW.expand(len(params), -1).contiguous()
    batch = prepare_sampling(params, [0] * len(params), [None] * len(params), ROW.numel(), "cpu")
    tokens = Sampler(seed=11).sample(logits, batch).token_ids
    for i, kind in enumerate(kinds):
        counts = torch.bincount(tokens[i :: len(kinds)], minlength=ROW.numel())
        assert chi_square_p_value(counts, filtered_distribution(ROW, kind)) > P_VALUE_FLOOR, (kind, counts.tolist())


def test_logprobs_zero_gives_the_sampled_logprob_and_no_alternatives_in_the_sampler() -> None:
    """Rows asking for 0 alternatives still get the sampled token's logprob (one entry per row that asked)."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    out = Sampler().sample(logits, prepare_sampling(params, [0] * 3, [None] * 3, 20, "cpu"))
    assert out.logprobs is not None
    expected = logits.log_softmax(dim=-1).gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs.sampled_logprobs, expected[[0, 2]])
    assert tuple(out.logprobs.top_ids.shape) == (2, 0)


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(model_path(), dtype="float32")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_zero_through_llm_generate(demo_llm: LLM, temperature: float) -> None:
    """LLM.generate with logprobs=0 returns, for every token, its own logprob (that of log_softmax) and an empty
    top list; a batch mate asking for 2 gets 2."""
    params = [
        SamplingParams(temperature=temperature, max_tokens=4, logprobs=0, seed=3, ignore_eos=True),
        SamplingParams(temperature=temperature, max_tokens=4, logprobs=2, seed=4, ignore_eos=True),
    ]
    zero, two = demo_llm.generate(["class A:", "def f("], params, use_tqdm=False)
    assert zero.logprobs is not None and len(zero.logprobs) == len(zero.token_ids) == 4
    assert [lp.token_id for lp in zero.logprobs] == list(zero.token_ids)
    assert all(lp.top == () and lp.logprob <= 0.0 for lp in zero.logprobs)
    assert two.logprobs is not None and all(len(lp.top) == 2 for lp in two.logprobs)
    alone = demo_llm.generate(["class A:"], params[0], use_tqdm=False)[0]
    assert alone.logprobs is not None
    assert [lp.logprob for lp in alone.logprobs] == pytest.approx([lp.logprob for lp in zero.logprobs], abs=1e-4)

"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token's logprob given its prefix and the top-k,
equal to the HF model's, across chunked prefill, with the prefix cache warm, and among batch mates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import hf_model, write_family

from fnvllm.engine.output import RequestOutput
from fnvllm.llm import LLM
from fnvllm.state import InvalidRequestError, SamplingParams

PROMPT = [5, 9, 13, 200, 7, 42, 42, 17, 99, 3, 250, 8, 61, 61, 2, 77, 31, 120, 4]  # 19 tokens: several chunks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("plp"), "qwen3")


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> torch.Tensor:
    """(T, V) HF log-softmax at every position of PROMPT (row p predicts token p + 1)."""
    with torch.no_grad():
        return hf_model(ckpt)(torch.tensor([PROMPT])).logits[0].double().log_softmax(-1)


def _check(out: RequestOutput, reference: torch.Tensor, k: int) -> None:
    """``out.prompt_logprobs`` matches the reference at every position (None first)."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT)
    assert entries[0] is None
    for p in range(1, len(PROMPT)):
        entry = entries[p]
        assert entry is not None, p
        row = reference[p - 1]
        assert entry.token_id == PROMPT[p]
        assert entry.logprob == pytest.approx(row[PROMPT[p]].item(), abs=1e-4)
        top = row.topk(k)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [4, 7, 64])
def test_prompt_logprobs_match_hf_across_chunks(ckpt: Path, reference: torch.Tensor, budget: int) -> None:
    """With prefill chunks of 4, 7 or the whole prompt, every prompt position matches HF's log-softmax."""
    llm = LLM(ckpt, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=budget, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    _check(llm.generate([PROMPT], params, use_tqdm=False)[0], reference, 3)


def test_prompt_logprobs_ignore_a_warm_prefix_cache(ckpt: Path, reference: torch.Tensor) -> None:
    """A request asking for prompt logprobs after the same prompt was cached still scores every position (it is
    admitted without cache hits), while a plain request does hit the cache."""
    llm = LLM(ckpt, dtype="float32", block_size=4, num_blocks=64, enable_prefix_caching=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    _check(out, reference, 0)
    assert out.metrics is not None and out.metrics.num_cached_tokens == 0
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.metrics is not None and plain.metrics.num_cached_tokens > 0


def test_prompt_logprobs_among_batch_mates(ckpt: Path, reference: torch.Tensor) -> None:
    """In a batch with requests that did not ask, only the asking one gets prompt logprobs, and they are exact;
    its generated tokens equal those of a plain request."""
    llm = LLM(ckpt, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=16)
    asked = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate([[1, 2, 3, 4, 5, 6], PROMPT, [7, 8]], [plain, asked, plain], use_tqdm=False)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    _check(outs[1], reference, 2)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0]
    assert outs[1].token_ids == alone.token_ids


def test_prompt_logprobs_range_is_checked() -> None:
    """prompt_logprobs outside [0, 20] is an InvalidRequestError naming the field."""
    with pytest.raises(InvalidRequestError, match=r"prompt_logprobs.*\[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_a_chunk_planned_again_after_a_discard_scores_the_same() -> None:
    """PromptScorer: a continuing chunk scored twice (its first run discarded) scores its first token from the
    previous chunk both times; an admitted row never uses what its slot kept."""
    from fnvllm.executor.prompt_logprobs import PromptScorer
    from fnvllm.state import StepPlan

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32)
    hidden = torch.randn(8, 8)  # positions 0..7 of one prompt
    tokens = tuple(range(3, 11))
    scorer = PromptScorer()

    def plan(step: int, start: int, sample: bool, admitted: bool) -> StepPlan:
        return StepPlan(
            step, 4, ("a",), (tokens[start : start + 4],), (start,), ((0, 1),), (sample,),
            (SamplingParams(prompt_logprobs=1),), (0,), (None,), (), int(admitted), (0,),
        )  # fmt: skip

    def logits_of(rows: torch.Tensor) -> torch.Tensor:
        return head(rows)

    scorer.score(plan(0, 0, False, True), [0], hidden[:4], logits_of)
    first = scorer.score(plan(1, 4, True, False), [0], hidden[4:], logits_of)[0]
    again = scorer.score(plan(1, 4, True, False), [0], hidden[4:], logits_of)[0]
    assert not first.leading_none and not again.leading_none
    assert torch.equal(first.chosen, again.chosen)
    expected = torch.log_softmax(head(hidden[3]), -1)[tokens[4]]
    assert first.chosen[0].item() == pytest.approx(expected.item(), abs=1e-6)
    fresh = scorer.score(plan(2, 4, True, True), [0], hidden[4:], logits_of)[0]
    assert fresh.leading_none and fresh.tokens == tokens[5:8]

"""Prompt logprobs under tensor parallelism at world size 2 on the CPU (gloo): every rank scores the same prompt
rows (scoring gathers the LM head's logits from every rank, a collective), so a step that scores them finishes
rather than hanging on mismatched collectives, and its prompt logprobs equal one process's.

Tolerance: the checkpoint is float32, and tensor parallelism only reassociates sums (each row-parallel matmul
adds two half-width partial sums in an all-reduce), a few float32 ulps of logits of size ~1-10: measured
differences are about 1.5e-6. ``ABS`` is 1e-4, well above that and far below what a wrong position or a
mis-scored token would change (logprobs over a 256-token vocabulary differ by ~0.1 or more from one token to the
next). Token ids (the top-k's and the sampled ones) must be equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_tp import BOUND_S, within
from tiny_models import write_family

from fnvllm.executor.prompt_logprobs import prompt_rows
from fnvllm.executor.tp_ranks import worker_plan
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams, StepPlan

ABS = 1e-4
PROMPT = [5, 9, 13, 200, 7, 42, 42, 17, 99, 3, 250, 8, 61, 61, 2, 77, 31, 120, 4]  # 19 tokens: several chunks
SHARED = PROMPT[:12]  # three full blocks of 4: a plain request with this prefix leaves them in the prefix cache
# A short gloo timeout: a rank out of step fails the step within seconds (TensorParallelError), not 300 s.
BASE: dict[str, Any] = dict(device="cpu", load_tokenizer=False, block_size=4, max_num_seqs=6, attention_backend="torch")
CONFIGS: dict[str, dict[str, Any]] = {
    "whole_prompts": dict(num_blocks=64, max_num_batched_tokens=128, enable_prefix_caching=False),
    # chunks of up to 8 tokens (PROMPT takes 3), the prefix cache on, and 10 blocks for up to 6 rows: preemptions
    "chunked_cached_preempted": dict(num_blocks=10, max_num_batched_tokens=8, enable_prefix_caching=True),
}


def batches() -> list[tuple[list[list[int]], SamplingParams | list[SamplingParams]]]:
    """Calls to ``generate``: prompt_logprobs 0 and 3; with logprobs; n=3 seeded samples; several prompts, plain
    ones among them, that share a prefix (the plain ones, admitted first, hit the cache)."""
    mixed = [[*SHARED, *[44] * 9], PROMPT, [*SHARED, 1, 2, 3], [7, 8], [*SHARED, 60, 70]]
    return [
        ([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)),
        ([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)),
        ([PROMPT, [*SHARED, 1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)),
        ([PROMPT], SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=4, prompt_logprobs=1)),
        (mixed, [SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=k) for k in (None, 1, 0, 4, None)]),
    ]


def run(llm: LLM) -> list[Any]:
    """Every batch's outputs: per prompt, its prompt logprobs and each completion's (token ids, logprobs)."""
    results = []
    for prompts, params in batches():
        for out in llm.generate(prompts, params, use_tqdm=False):
            results.append((out.prompt_logprobs, [(c.token_ids, c.logprobs) for c in out.outputs]))
    return results


def assert_close_entries(got: Any, expected: Any) -> None:
    """Two lists of TokenLogprobs (or None) agree: same positions scored, same ids, logprobs within ABS."""
    assert (got is None) == (expected is None)
    if got is None:
        return
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert (g is None) == (e is None)
        if g is None:
            continue
        assert g.token_id == e.token_id
        assert g.logprob == pytest.approx(e.logprob, abs=ABS)
        assert [i for i, _ in g.top] == [i for i, _ in e.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=ABS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tp2_prompt_logprobs_equal_tp1(tmp_path: Path, config: str) -> None:
    """At tensor_parallel_size=2, prompt logprobs (k = 0 and 3, with logprobs, n > 1, several prompts, chunked
    prefill, a warm prefix cache, preemptions) finish within a bound and equal one process's, as do the sampled
    tokens and their logprobs; every asked position is scored."""
    path = write_family(tmp_path, "qwen3")
    options = {**BASE, **CONFIGS[config]}
    expected = run(LLM(path, **options))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout_s=10, **options)
    got: list[Any] = []
    try:
        error = within(BOUND_S, lambda: got.extend(run(llm)))
        assert error is None, error
        if options["enable_prefix_caching"]:
            assert llm.stats.num_cached_tokens > 0 and llm.stats.num_preemptions > 0
    finally:
        llm.close()
    assert len(got) == len(expected) == 10
    for (prompt_got, completions_got), (prompt_expected, completions_expected) in zip(got, expected, strict=True):
        assert_close_entries(prompt_got, prompt_expected)
        if prompt_expected is not None:
            assert prompt_expected[0] is None and all(e is not None for e in prompt_expected[1:])
        assert [ids for ids, _ in completions_got] == [ids for ids, _ in completions_expected]
        for (_, lp_got), (_, lp_expected) in zip(completions_got, completions_expected, strict=True):
            assert_close_entries(lp_got, lp_expected)


def test_worker_plan_keeps_the_prompt_rows() -> None:
    """A worker's plan finds the same prompt rows as rank 0's: those of a step scoring prompt logprobs, and none
    in a step without (whose sampling fields are dropped)."""

    def plan(asked: int | None, generated: int) -> StepPlan:
        params = (SamplingParams(), SamplingParams(prompt_logprobs=asked))
        return StepPlan(
            0, 4, ("a", "b"), ((1,), (2, 3, 4)), (5, 0), ((0, 1), (2,)), (True, True),
            params, (3, generated), (None, None), (), 1, (0, 1),
        )  # fmt: skip

    assert prompt_rows(worker_plan(plan(2, 0))) == prompt_rows(plan(2, 0)) == (1,)
    for plain in (plan(None, 0), plan(2, 1)):
        assert prompt_rows(worker_plan(plain)) == prompt_rows(plain) == ()
        assert worker_plan(plain).params == ()

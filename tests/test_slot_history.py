"""Penalties read from the executor's per-slot token buffer (fnvllm.executor.history): the plan carries a row's
history once, at admission, and the sampler still sees every prompt and output token, in every regime.

Checked two ways: the dense penalties equal the sparse reference built from full histories
(``penalties.prepare_penalties``), step by step with slots reused; and greedy decoding with a repetition penalty
through ``LLM`` equals transformers' ``generate(repetition_penalty=...)`` token for token, with overlapped steps,
preemption, prefix-cache hits and chunked prefill.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_model, write_family

from fnvllm.engine.loop import EngineLoop
from fnvllm.executor.history import SlotHistory
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.executor.penalties import apply_penalties, prepare_penalties
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams, StepPlan, TokenHistory

VOCAB = 40


def _plan(step: int, rows: list[tuple[int, tuple[int, ...], int, bool]], params: list[SamplingParams]) -> StepPlan:
    """A plan of decode rows (slot, tokens so far, num_generated, admitted); admitted rows go last."""
    rows = sorted(rows, key=lambda r: r[3])
    admitted = sum(r[3] for r in rows)
    return StepPlan(
        step=step,
        block_size=4,
        seq_ids=tuple(f"s{slot}" for slot, *_ in rows),
        input_tokens=tuple(tokens[-1:] for _, tokens, _, _ in rows),
        start_positions=tuple(len(tokens) - 1 for _, tokens, _, _ in rows),
        block_tables=tuple((0,) * 8 for _ in rows),
        sample=(True,) * len(rows),
        params=tuple(params[slot] for slot, *_ in rows),
        num_generated=tuple(n for _, _, n, _ in rows),
        histories=tuple(
            TokenHistory(tokens[: len(tokens) - n], tokens[len(tokens) - n :])
            if is_new and params[slot].needs_history
            else None
            for slot, tokens, n, is_new in rows
        ),
        num_admitted=admitted,
        slots=tuple(slot for slot, *_ in rows),
    )


def test_dense_penalties_equal_the_reference_across_steps() -> None:
    """Six slots, requests admitted (some after earlier requests left the slot), decoding over 12 steps: at
    every step the penalised logits equal the sparse reference computed from the full histories."""
    rng = random.Random(0)
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.5),
        SamplingParams(presence_penalty=-1.0),
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=1.0),
    ]
    history = SlotHistory(num_slots=6, max_len=64, vocab_size=VOCAB, device=torch.device("cpu"))
    live: dict[int, tuple[list[int], int]] = {}  # slot -> (tokens, prompt length)
    for step in range(12):
        rows = []
        for slot in range(6):
            if slot not in live or rng.random() < 0.15:  # (re)admit: a new request in this slot
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
                output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]  # a preempted one has outputs
                live[slot] = (prompt + output, len(prompt))
                rows.append((slot, tuple(prompt + output), len(output), True))
            else:
                tokens, prompt_len = live[slot]
                rows.append((slot, tuple(tokens), len(tokens) - prompt_len, False))
        plan = _plan(step, rows, params)
        history.admit(plan)
        sampled_rows = list(range(plan.num_seqs))
        logits = torch.randn(plan.num_seqs, VOCAB)
        dense = history.penalties(plan, sampled_rows)
        full = [TokenHistory(t[: len(t) - n], t[len(t) - n :]) for _, t, n, _ in sorted(rows, key=lambda r: r[3])]
        reference = prepare_penalties(plan.params, full, VOCAB, torch.device("cpu"))
        assert dense is not None and reference is not None
        penalised = [i for i in sampled_rows if plan.params[i].needs_history]  # the sampler's penalised rows
        expected = apply_penalties(logits, reference)[penalised]
        torch.testing.assert_close(dense.apply_(logits[penalised].clone()), expected)
        sampled = torch.randint(0, VOCAB, (plan.num_seqs,))
        history.record(plan, sampled_rows, sampled)
        for k, slot in enumerate(plan.slots):
            live[slot][0].append(int(sampled[k]))


def test_no_penalty_no_buffer() -> None:
    """Steps without a penalised row allocate nothing and return no penalties."""
    history = SlotHistory(num_slots=4, max_len=16, vocab_size=VOCAB, device=torch.device("cpu"))
    plan = _plan(0, [(0, (1, 2, 3), 0, True), (1, (4, 5), 0, True)], [SamplingParams()] * 2)
    history.admit(plan)
    assert history.penalties(plan, [0, 1]) is None
    history.record(plan, [0, 1], torch.tensor([7, 8]))
    assert history.tokens is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family(tmp_path_factory.mktemp("history"), "qwen3")


def _hf_penalised(model: Any, prompt: list[int], max_new: int, penalty: float) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            repetition_penalty=penalty,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()


REGIMES: dict[str, dict[str, Any]] = {
    "plain": dict(block_size=8, num_blocks=256),
    "overlapped": dict(block_size=8, num_blocks=256),
    "preemption": dict(block_size=4, num_blocks=24, max_num_batched_tokens=48),
    "chunked_prefill": dict(block_size=8, num_blocks=256, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_repetition_penalty_equals_transformers(checkpoint: Path, regime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decoding with repetition_penalty=1.8 on prompts that share a prefix (prefix-cache hits, whose
    tokens are never fed) equals transformers' generate, token for token, in this scheduling regime."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 250) for _ in range(16)]
    prompts = [shared + [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    prompts += [[rng.randrange(3, 250) for _ in range(n)] for n in (1, 5)]
    model = hf_model(checkpoint)
    expected = [_hf_penalised(model, p, 12, 1.8) for p in prompts]
    llm = LLM(checkpoint, dtype="float32", **REGIMES[regime])
    if regime == "overlapped":
        monkeypatch.setattr(ModelExecutor, "supports_overlap", property(lambda self: True))
        llm.loop = EngineLoop(llm.engine, overlap=True)
        assert llm.loop.overlap
    params = SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == expected
    if regime == "overlapped":
        assert llm.loop.overlap_stats.kept > 0, "penalised rows are speculated on (overlap stays on)"
    if regime == "preemption":
        assert llm.stats.num_preemptions > 0
    assert llm.stats.num_cached_tokens > 0 or regime == "preemption"

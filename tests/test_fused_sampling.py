"""Which batches take the fused sampling path, and how a non-finite row is reported (the kernel itself is tested
in test_kernels_triton.py; the executor uses this path on CUDA only)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import write_family

from fnvllm.executor.fused_sampling import (
    FUSED_MIN_TEMPERATURE,
    NonFiniteLogitsError,
    check_finite,
    fused_temperatures,
)
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams


def test_temperature_only_and_greedy_rows_qualify() -> None:
    """Plain temperature rows keep their temperature; greedy rows (T 0 or top_k 1) get 0."""
    rows = [SamplingParams(temperature=0.6), SamplingParams(temperature=0), SamplingParams(top_k=1)]
    assert fused_temperatures(rows) == [0.6, 0.0, 0.0]
    assert fused_temperatures([]) == []


@pytest.mark.parametrize(
    "other",
    [
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=5),
        SamplingParams(min_p=0.1),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(seed=3),
        SamplingParams(logprobs=1),
        SamplingParams(temperature=FUSED_MIN_TEMPERATURE / 2),
    ],
)
def test_any_other_option_sends_the_whole_batch_to_the_general_sampler(other: SamplingParams) -> None:
    """One row with a filter, a penalty, a seed, logprobs or a tiny temperature disqualifies the batch."""
    assert fused_temperatures([SamplingParams(temperature=0.6), other]) is None


def test_non_finite_rows_are_named() -> None:
    """Flags set -> NonFiniteLogitsError naming the sequences; no flags -> nothing."""
    check_finite([0, 0], ["a", "b"])
    with pytest.raises(NonFiniteLogitsError, match=r"1 sampled sequence\(s\), e.g. \['b'\]"):
        check_finite([0, 1], ["a", "b"])


def test_a_checkpoint_producing_nan_logits_is_reported_by_the_executor(tmp_path: Path) -> None:
    """NaN weights -> NonFiniteLogitsError naming the request (not a token 0 or an invalid id), on the general
    sampler path the CPU takes; the loop stays usable."""
    llm = LLM(write_family(tmp_path, "qwen3"), device="cpu", dtype="float32", attention_backend="torch")
    with torch.no_grad():
        llm.executor.model.model.norm.weight.fill_(math.nan)
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or infinite logits for 1 sampled sequence"):
        llm.generate([[5, 9, 13]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert not llm.state.running

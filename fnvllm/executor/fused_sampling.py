"""The sampler's fast path on CUDA: batches that only use temperature sample in one pass over the logits.

``fused_temperatures(params)`` says whether a batch qualifies -- every row greedy or plain temperature sampling
(no top-k / top-p / min-p, no penalties, no per-request seed, no logprobs) -- and returns the per-row temperatures
(0 for greedy rows). ``FusedSampler`` then runs ``fnvllm.kernels.sampling.fused_sample``; everything else goes
through the general ``Sampler``. The two draw from the same distributions but not the same random streams.

Worked example: rows with (temperature 0.6), (temperature 0) and (temperature 0.6, top_p 0.9) do not qualify (the
third uses top-p); without the third, the temperatures are [0.6, 0.0].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fnvllm.executor.base import NonFiniteLogitsError
from fnvllm.kernels.attention import upload
from fnvllm.state import SamplingParams

__all__ = ["FUSED_MIN_TEMPERATURE", "FusedSampler", "NonFiniteLogitsError", "check_finite", "fused_temperatures"]

# Below this temperature logits / T can overflow float32 (|logit| ~ 1e3 / 1e-3 ~ 1e6 is still exact enough for an
# argmax, 1e-40 is not): such rows take the general sampler, whose numerics handle them.
FUSED_MIN_TEMPERATURE = 1e-3


def fused_temperatures(params: Sequence[SamplingParams]) -> list[float] | None:
    """Per-row temperatures (0.0 = greedy) when every row can be sampled by the fused kernel, else None."""
    temperatures = []
    for p in params:
        if p.top_p != 1.0 or p.min_p != 0.0 or p.needs_history or p.seed is not None or p.logprobs is not None:
            return None
        if p.is_greedy:
            temperatures.append(0.0)
        elif p.top_k is not None or p.temperature < FUSED_MIN_TEMPERATURE:
            return None
        else:
            temperatures.append(float(p.temperature))
    return temperatures


class FusedSampler:
    """Draws with ``fused_sample``; a call counter keys its Philox uniforms so runs with one seed repeat exactly."""

    def __init__(self, seed: int) -> None:
        from fnvllm.kernels.sampling import fused_sample  # Triton: imported only where the fast path exists

        self.seed = seed
        self._calls = 0
        self._fused_sample = fused_sample

    def sample(self, logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
        """(2, B) int64 on the logits' device: token ids, then a 0/1 non-finite flag per row."""
        key = (self.seed * 1_000_003 + self._calls) % 2**31
        self._calls += 1
        temperature = upload(np.asarray(temperatures, dtype=np.float32), logits.device)
        return self._fused_sample(logits, temperature, key)


def check_finite(flags: Sequence[int], seq_ids: Sequence[str]) -> None:
    """Raise NonFiniteLogitsError naming the rows whose flag is set (flags and seq_ids in sampled-row order)."""
    bad = [rid for rid, flag in zip(seq_ids, flags, strict=True) if flag]
    if bad:
        raise NonFiniteLogitsError(
            f"the model produced NaN or infinite logits for {len(bad)} sampled sequence(s), e.g. {bad[:4]}; "
            "check the checkpoint's weights and dtype"
        )

"""SamplingParams: per-request generation settings, frozen and validated at construction.

The pure core reads only the stop-related fields (``max_tokens``, ``ignore_eos``, ``stop_token_ids``); the
executor's sampler reads the rest; the LLM facade applies ``stop`` strings through its detokenizer.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from fnvllm.state.errors import InvalidRequestError


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"SamplingParams.{field} must be {allowed}, got {value!r}")


def _as_int_tuple(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _as_str_tuple(values: Any) -> tuple[str, ...]:
    if isinstance(values, str):
        return (values,)
    return tuple(str(v) for v in values)


@attrs.frozen
class SamplingParams:
    """How to sample one request's tokens.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it. Range [0, 100].
    top_p: nucleus mass kept, (0, 1]. 1 disables.
    top_k: keep the k most likely tokens; None disables. >= 1.
    min_p: drop tokens whose probability is below min_p * max probability, [0, 1]. 0 disables.
    max_tokens: most tokens to generate, >= 1.
    ignore_eos: keep generating past the model's EOS ids (benchmarks).
    stop: strings that end generation; not included in the text unless include_stop_str_in_output.
    stop_token_ids: token ids that end generation (in addition to EOS).
    seed: per-request seed; a seeded request's tokens do not depend on its batch mates.
    logprobs: return the top-n log-probabilities of each sampled position (and the sampled token's), n >= 0.
    repetition_penalty: HF-style multiplicative penalty on tokens seen in prompt or output, > 0; 1 disables.
    presence_penalty / frequency_penalty: OpenAI-style additive penalties on output tokens, [-2, 2].
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_str_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_int_tuple)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # needs_history (derived): the sampler needs the request's prompt and output tokens (penalties).
    # Derived once here, read per row per step by the scheduler (a property would cost a call each time).
    needs_history: bool = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        t = self.temperature
        _check(
            isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t <= 100,
            "temperature",
            "in [0, 100]",
            t,
        )
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
            "top_k",
            "None or >= 1",
            self.top_k,
        )
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "an int >= 1",
            self.max_tokens,
        )
        _check(all(s != "" for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(all(i >= 0 for i in self.stop_token_ids), "stop_token_ids", "ids >= 0", self.stop_token_ids)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "None or an int", self.seed)
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            "None or an int in [0, 20]",
            self.logprobs,
        )
        _check(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        uses_history = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        object.__setattr__(self, "needs_history", uses_history)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

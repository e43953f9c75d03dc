"""Batched token sampler: penalties, temperature, top-k / top-p / min-p filtering, then one draw per row.

The host builds a `SamplingBatch` once per step (`prepare_sampling`, a handful of host->device copies); the
device work in `Sampler.sample` is vectorised over the batch and never reads a tensor back to the host, so it
runs the same on CPU and CUDA tensors. Flags on the batch skip whole stages when no row needs them: an
all-greedy batch is one argmax.

Order of operations on each row's logits:
    1. repetition penalty (HF style, on prompt + output tokens), then presence / frequency (OpenAI style,
       on output tokens);
    2. greedy rows (temperature 0 or top_k 1) take the argmax here;
    3. divide by temperature; mask to -inf outside top-k, then outside top-p (on the top-k-renormalised
       distribution), then below min_p * max probability;
    4. draw: argmax(probs / E) with E ~ Exp(1) iid per vocabulary entry. This is the Gumbel-max trick
       (-log E is Gumbel), so it samples exactly from probs with one noise tensor and no cumsum/search.

Randomness. A seeded row's noise for its n-th generated token is a pure function of (seed, n, vocab index),
a counter-based hash (`seeded_noise.py`), so a seeded request's tokens do not depend on its batch mates, its
row, the device kind, or earlier steps. Unseeded rows draw from one torch.Generator per device owned by the
`Sampler`. Penalties are sparse (row, token) edits (`penalties.py`).

Logprobs are the log_softmax of the *raw* model logits (before penalties, temperature and filtering), as
in vLLM's default "raw_logprobs" mode: what the model believed, not what the sampler was allowed to pick.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import DTypeLike

from fnvllm.executor.penalties import Penalties, prepare_penalties
from fnvllm.executor.seeded_noise import seed_keys, seeded_exponential
from fnvllm.kernels.attention import upload
from fnvllm.state.params import GREEDY_TEMPERATURE, SamplingParams
from fnvllm.state.plan import TokenHistory


@attrs.frozen(eq=False)
class SeededRows:
    """The sampled rows that carry a seed (S of them).

    rows: (S,) int64 row indices into the batch.
    keys: (S, 2) int64, two 32-bit hash keys per row derived from (seed, num_generated) by `seed_keys`.
    """

    rows: torch.Tensor
    keys: torch.Tensor


@attrs.frozen(eq=False)
class SamplingBatch:
    """Per-row sampling settings of one step as device tensors, plus flags that skip unused stages.

    Greedy rows carry neutral values (temperature 1, filters off) so the sampling path never divides by 0.
    temperature / top_p / min_p: (B,) float32. top_k: (B,) int64, 0 = off. is_greedy: (B,) bool.
    seeded: the rows with a seed and their noise keys, or None when no sampled row has a seed.
    any_top_k / all_top_k: some / every sampled row has a top-k (all_top_k lets top-p sort only max_top_k).
    max_top_k: largest top_k among sampled rows, 0 when none.
    max_logprobs: most logprobs any row asked for, None when no row asked.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    is_greedy: torch.Tensor
    seeded: SeededRows | None
    penalties: Penalties | None
    vocab_size: int
    num_rows: int
    all_greedy: bool
    any_greedy: bool
    all_seeded: bool
    any_top_k: bool
    all_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int
    max_logprobs: int | None


@attrs.frozen(eq=False)
class Logprobs:
    """Log-probabilities (log_softmax of the raw logits) for each row.

    top_logprobs / top_ids: (B, n) float32 / int64, n = the batch's max_logprobs, best first; a row that asked
    for fewer keeps the first ones it asked for.
    sampled_logprobs: (B,) float32 log-probability of the token that was sampled.
    """

    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    sampled_logprobs: torch.Tensor


@attrs.frozen(eq=False)
class SamplerOutput:
    """token_ids: (B,) int64 on the logits' device (meaningless for rows in ``non_finite``).
    logprobs: present when any row asked for logprobs.
    non_finite: (B,) bool, rows whose (penalised, scaled) logits held a NaN or an infinity, found by the same
        max-reduction that picks the token (no extra pass, no host sync): NaN propagates through ``max``. The
        executor reports such rows (``NonFiniteLogitsError``) instead of returning their token."""

    token_ids: torch.Tensor
    logprobs: Logprobs | None
    non_finite: torch.Tensor


def _host(values: Sequence[Any], dtype: DTypeLike, device: torch.device) -> torch.Tensor:
    """One host->device copy of a flat list (numpy builds it several times faster than torch.tensor)."""
    return upload(np.asarray(values, dtype=dtype), device)


@attrs.frozen
class _Columns:
    """Per-row host values of a batch; greedy rows hold neutral values (temperature 1, filters off)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    is_greedy: list[bool]


def _columns(params: Sequence[SamplingParams], vocab_size: int) -> _Columns:
    """Gather the per-row settings in one pass (this runs every step for every row, so no per-row calls)."""
    cols = _Columns([], [], [], [], [])
    for p in params:
        greedy = p.temperature < GREEDY_TEMPERATURE or p.top_k == 1  # = p.is_greedy, inlined
        cols.is_greedy.append(greedy)
        cols.temperature.append(1.0 if greedy else p.temperature)
        cols.top_k.append(0 if greedy or p.top_k is None or p.top_k >= vocab_size else p.top_k)
        cols.top_p.append(1.0 if greedy else p.top_p)
        cols.min_p.append(0.0 if greedy else p.min_p)
    return cols


def _check_lengths(params: Sequence[object], num_generated: Sequence[int], histories: Sequence[object]) -> None:
    """Raise ValueError unless the per-row sequences have one entry per row and counts are >= 0."""
    if not len(params) == len(num_generated) == len(histories):
        raise ValueError(
            f"params, num_generated and histories must have one entry per row, got lengths "
            f"{len(params)}, {len(num_generated)}, {len(histories)}"
        )
    if any(n < 0 for n in num_generated):
        raise ValueError(f"num_generated must be >= 0 for every row, got {list(num_generated)}")


def _prepare_seeds(
    params: Sequence[SamplingParams], num_generated: Sequence[int], device: torch.device
) -> SeededRows | None:
    """Rows and noise keys of the sampled (non-greedy) rows that carry a seed, None when there are none."""
    rows = [i for i, p in enumerate(params) if p.seed is not None and not p.is_greedy]
    if not rows:
        return None
    keys = seed_keys([params[i].seed or 0 for i in rows], [num_generated[i] for i in rows])  # (S, 2)
    packed = upload(np.concatenate([np.asarray(rows, dtype=np.int64)[:, None], keys], axis=1), device)
    return SeededRows(rows=packed[:, 0], keys=packed[:, 1:])  # one copy for both


def prepare_sampling(
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    histories: Sequence[TokenHistory | None],
    vocab_size: int,
    device: torch.device | str,
    penalties: Penalties | None = None,
) -> SamplingBatch:
    """Build one step's SamplingBatch on `device` for the rows that sample, in batch order.

    num_generated[i]: tokens row i generated before this draw (the counter of its seeded noise).
    histories[i]: prompt and output tokens, required for rows with a penalty (unless ``penalties`` is given),
    ignored otherwise. penalties: the rows' penalties built elsewhere (the executor's per-slot token buffer,
    ``fnvllm.executor.history``); then ``histories`` is not read.
    Raises ValueError on mismatched lengths or a missing history, InvalidRequestError on out-of-vocab ids.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    _check_lengths(params, num_generated, histories if penalties is None else [None] * len(params))
    device = torch.device(device)
    cols = _columns(params, vocab_size)
    floats = _host([cols.temperature, cols.top_p, cols.min_p], np.float32, device).reshape(3, len(params))
    ints = _host([cols.top_k, cols.is_greedy], np.int64, device).reshape(2, len(params))
    seeded = _prepare_seeds(params, num_generated, device)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    num_greedy = sum(cols.is_greedy)
    return SamplingBatch(
        temperature=floats[0],
        top_p=floats[1],
        min_p=floats[2],
        top_k=ints[0],
        is_greedy=ints[1].bool(),
        seeded=seeded,
        penalties=prepare_penalties(params, histories, vocab_size, device) if penalties is None else penalties,
        vocab_size=vocab_size,
        num_rows=len(params),
        all_greedy=num_greedy == len(params),
        any_greedy=num_greedy > 0,
        all_seeded=seeded is not None and len(seeded.rows) == len(params),
        any_top_k=any(cols.top_k),
        all_top_k=all(k > 0 for k, greedy in zip(cols.top_k, cols.is_greedy, strict=True) if not greedy),
        any_top_p=min(cols.top_p, default=1.0) < 1.0,
        any_min_p=max(cols.min_p, default=0.0) > 0.0,
        max_top_k=max(cols.top_k, default=0),
        max_logprobs=max(asked) if asked else None,
    )


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Mask (in place) logits below each row's k-th largest; rows with top_k 0 are untouched."""
    values = logits.topk(max_top_k, dim=-1).values  # (B, max_top_k), descending
    kth = values.gather(1, (top_k.clamp(min=1) - 1)[:, None])  # (B, 1)
    kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, -math.inf))
    return logits.masked_fill_(logits < kth, -math.inf)


def _top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask outside top-k, then outside the nucleus top-p of what is left; returns `logits`, edited in place.

    Candidates are sorted best first: only the max_top_k best (one topk) when every sampled row has a top-k,
    else the whole vocabulary (one sort). A token is dropped when the tokens before it already hold >= top_p.
    """
    if batch.all_top_k:
        values, order = logits.topk(batch.max_top_k, dim=-1)  # (B, K) descending, K = max_top_k
    else:
        values, order = logits.sort(dim=-1, descending=True)  # (B, V)
    num_candidates = values.shape[-1]
    if batch.any_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, num_candidates)  # (B,)
        rank = torch.arange(num_candidates, device=logits.device)
        values.masked_fill_(rank >= k[:, None], -math.inf)
    probs = values.softmax(dim=-1)  # (B, K) renormalised over the top-k survivors
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # mass of the strictly better candidates; 0 for the best
    # The best candidate always stays: a top_p below float32's range is 0 here, and 0 >= 0 would drop it too.
    values[:, 1:].masked_fill_(mass_before[:, 1:] >= batch.top_p[:, None], -math.inf)
    return logits.fill_(-math.inf).scatter_(1, order, values)


def _min_p_(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero (in place) probabilities below min_p * the row's largest probability."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # (B, 1)
    return probs.masked_fill_(probs < threshold, 0.0)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """(B, V) probabilities after temperature, top-k, top-p and min-p (min-p rows are not renormalised)."""
    scaled = logits / batch.temperature[:, None]  # (B, V), a new tensor the filters may edit in place
    if batch.any_top_p:
        scaled = _top_k_top_p(scaled, batch)
    elif batch.any_top_k:
        scaled = _top_k_only(scaled, batch.top_k, batch.max_top_k)
    probs = scaled.softmax(dim=-1)
    return _min_p_(probs, batch.min_p) if batch.any_min_p else probs


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Top-`num_top` and sampled-token log-probabilities from the raw logits (B, V)."""
    logprobs = logits.log_softmax(dim=-1)  # (B, V)
    top = logprobs.topk(num_top, dim=-1)
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # (B,)
    return Logprobs(top_logprobs=top.values, top_ids=top.indices, sampled_logprobs=sampled)


class Sampler:
    """Samples one token per row; owns the RNG of unseeded rows (one torch.Generator per device)."""

    def __init__(self, seed: int = 0) -> None:
        """`seed` seeds the shared generator of unseeded rows (seeded rows never touch it)."""
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The shared generator for `device`, created on first use."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """(B, V) Exp(1) noise: hashed for seeded rows, from the shared generator for the others."""
        seeded = batch.seeded
        if seeded is not None and batch.all_seeded:  # rows are 0..B-1 in order
            return seeded_exponential(seeded.keys, batch.vocab_size)
        noise = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a 0 would turn a masked token's 0/0 into NaN
        if seeded is not None:
            noise.index_copy_(0, seeded.rows, seeded_exponential(seeded.keys, batch.vocab_size))
        return noise

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of `logits` (B, V) (cast to float32); the input tensor is not modified."""
        expected = (batch.num_rows, batch.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"logits must have shape (num_rows, vocab_size) = {expected}, got {tuple(logits.shape)}")
        raw = logits.float()
        penalised = batch.penalties.apply(raw) if batch.penalties is not None else raw
        if batch.all_greedy:
            best, token_ids = penalised.max(dim=-1)
        else:
            probs = filtered_probs(penalised, batch)
            best, token_ids = probs.div_(self._noise(probs, batch)).max(dim=-1)  # Gumbel-max: one draw per row
            if batch.any_greedy:
                greedy_best, greedy_ids = penalised.max(dim=-1)
                token_ids = torch.where(batch.is_greedy, greedy_ids, token_ids)
                best = torch.where(batch.is_greedy, greedy_best, best)
        non_finite = ~best.isfinite()  # a NaN anywhere in the row, an infinity, or nothing finite left to draw
        logprobs = None
        if batch.max_logprobs is not None:
            logprobs = compute_logprobs(raw, token_ids, batch.max_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, non_finite=non_finite)

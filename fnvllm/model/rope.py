"""Rope scaling: how a checkpoint's ``rope_type`` turns the base inverse frequencies into the table's.

Plain rope rotates the pair i of a head (of width D) by position * theta^(-2i/D). A scaling kind changes those
D/2 inverse frequencies once, at load, and may scale the cos/sin table by a constant (YaRN's attention factor);
the model, the fused kernels and the KV cache only ever see the table (``layers.RotaryEmbedding``), so a new kind
is one value class here plus its parser in ``config.py``. Each class has

    scale_inv_freq(inv_freq, theta) -> inv_freq'   (D/2,) float32 -> (D/2,) float32
    attention_factor                               the constant that multiplies cos and sin (1.0 but for YaRN)

The rules follow transformers' rope-init functions (``modeling_rope_utils``):

- ``llama3``: wavelengths longer than original / low_freq_factor are stretched by ``factor``, shorter than
  original / high_freq_factor kept, blended in between.
- ``linear``: every frequency divided by ``factor`` (the positions divided by it).
- ``yarn``: pairs that turn more than ``beta_fast`` times over the original context are kept (extrapolated), pairs
  that turn fewer than ``beta_slow`` times are divided by ``factor`` (interpolated), a linear ramp over the pair
  index in between; cos and sin times ``attention_factor`` (default 0.1 ln(factor) + 1).
- ``longrope`` (Phi-3): each pair's frequency divided by its own short factor, cos and sin times an attention
  factor; served only up to original_max_position_embeddings, where transformers uses the short factors
  (``LongRopeScaling`` says why).
- ``dynamic`` (NTK): transformers rescales theta only once a sequence is longer than max_position_embeddings,
  from that sequence's length, and keeps plain rope up to it. fnvllm serves at most max_position_embeddings
  tokens (``EngineConfig.max_model_len`` is capped there), where dynamic *is* plain rope, exactly; beyond it a
  paged engine could not follow (the frequencies would change per step and per batch while the cache keeps keys
  rotated by older ones), which is why the cap must stay for this kind.
"""

from __future__ import annotations

import math

import attrs
import torch


def _check_positive_number(name: str, value: float) -> None:
    """Raise ValueError naming ``name`` unless value is a finite number > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_positive_int(name: str, value: int) -> None:
    """Raise ValueError naming ``name`` unless value is an int > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@attrs.frozen
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent rope scaling (rope_type "llama3").

    factor: how much long wavelengths are stretched.
    low_freq_factor / high_freq_factor: wavelengths above original_max_position_embeddings / low_freq_factor
        are divided by factor, those below original_max_position_embeddings / high_freq_factor are kept, and
        those in between are interpolated smoothly.
    original_max_position_embeddings: the context length the model was pretrained at.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __attrs_post_init__(self) -> None:
        """Reject values the frequencies cannot be computed from, naming the field."""
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_positive_number(name, getattr(self, name))
        _check_positive_int("original_max_position_embeddings", self.original_max_position_embeddings)

    @property
    def attention_factor(self) -> float:
        """cos/sin are not scaled."""
        return 1.0

    def scale_inv_freq(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """Stretch long wavelengths by `factor`, keep short ones, blend those in between (theta unused)."""
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor  # longer than this: divide by factor
        high_freq_wavelen = old_len / self.high_freq_factor  # shorter than this: keep
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@attrs.frozen
class _FactorOnlyScaling:
    """A scaling kind whose one field is a positive ``factor`` and whose cos/sin are not scaled."""

    factor: float

    def __attrs_post_init__(self) -> None:
        """Reject a factor that is not a positive number."""
        _check_positive_number("factor", self.factor)

    @property
    def attention_factor(self) -> float:
        """cos/sin are not scaled."""
        return 1.0


@attrs.frozen
class LinearRopeScaling(_FactorOnlyScaling):
    """Linear rope scaling, or position interpolation (rope_type "linear"): position p is rotated as p / factor.

    factor: how much every wavelength is stretched (2.0 rotates position 2k as plain rope rotates k).
    """

    def scale_inv_freq(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """Every frequency divided by `factor` (theta unused)."""
        return inv_freq / self.factor


@attrs.frozen
class YarnRopeScaling:
    """YaRN rope scaling (rope_type "yarn"; Qwen2.5 / Qwen3 long context: factor 4 over 32768 tokens).

    factor: how much the slow (long-wavelength) pairs are stretched.
    original_max_position_embeddings: the context length the model was pretrained at; a pair's number of turns
        over it decides whether it is kept, stretched or blended.
    attention_factor: what cos and sin are multiplied by (``yarn_attention_factor`` when the checkpoint gives none).
    beta_fast / beta_slow: pairs turning at least beta_fast times over the original context are kept, at most
        beta_slow times are divided by factor, linearly blended over the pair index in between (32 and 1).
    truncate: round the blend's bounds outwards to whole pair indices (transformers' default; gpt-oss turns it off).
    """

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __attrs_post_init__(self) -> None:
        """Reject values the frequencies cannot be computed from, naming the field."""
        for name in ("factor", "attention_factor", "beta_fast", "beta_slow"):
            _check_positive_number(name, getattr(self, name))
        _check_positive_int("original_max_position_embeddings", self.original_max_position_embeddings)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be true or false, got {self.truncate!r}")

    def scale_inv_freq(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """Blend each pair's frequency between kept (extrapolated) and divided by factor (interpolated)."""
        dim = 2 * inv_freq.shape[0]
        low, high = self._ramp_bounds(dim, theta)
        index = torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device)
        ramp = ((index - low) / (high - low if high != low else 0.001)).clamp(0, 1)  # 0: fast pairs, 1: slow
        kept = 1 - ramp  # the weight of the unscaled frequency
        return inv_freq / self.factor * (1 - kept) + inv_freq * kept

    def _ramp_bounds(self, dim: int, theta: float) -> tuple[float, float]:
        """(low, high) pair indices of the blend: below low the pairs are kept, above high interpolated."""
        low = self._pair_index(self.beta_fast, dim, theta)
        high = self._pair_index(self.beta_slow, dim, theta)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def _pair_index(self, num_turns: float, dim: int, theta: float) -> float:
        """The (fractional) pair index i whose wavelength 2 pi theta^(2i/dim) fits num_turns times into the
        original context: solve original / wavelength = num_turns for i."""
        wavelength = self.original_max_position_embeddings / num_turns
        return dim * math.log(wavelength / (2 * math.pi)) / (2 * math.log(theta))


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin factor when a checkpoint gives no ``attention_factor``: 0.1 ln(factor) + 1 (1 for factor
    <= 1); with both ``mscale`` and ``mscale_all_dim`` set (DeepSeek's fields; 0 counts as unset), the ratio
    m(factor, mscale) / m(factor, mscale_all_dim) of m(s, k) = 0.1 k ln(s) + 1. (DeepSeek's MLA also folds
    mscale_all_dim into its softmax scale; the Llama-family attention here has no such term.)"""
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor: float, weight: float) -> float:
    """0.1 * weight * ln(factor) + 1, or 1 when factor <= 1 (no stretch, no correction)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


@attrs.frozen
class DynamicNtkRopeScaling(_FactorOnlyScaling):
    """Dynamic NTK rope scaling (rope_type "dynamic"): plain rope for every sequence the engine serves.

    transformers keeps theta until a sequence grows past max_position_embeddings and only then raises it (from the
    sequence's length, with ``factor``); fnvllm's max model length is at most max_position_embeddings, so the
    scaled branch is never reached and the table is plain rope's (see the module docstring for why the cap
    must hold for this kind).

    factor: the checkpoint's factor, kept for the record (it acts only past max_position_embeddings).
    """

    def scale_inv_freq(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """The frequencies unchanged: within max_position_embeddings dynamic NTK is plain rope."""
        return inv_freq


@attrs.frozen
class LongRopeScaling:
    """LongRoPE (rope_type "longrope"; Phi-3-mini-128k, Phi-3.5-mini, Phi-3-medium-128k): pair i's frequency
    divided by short_factor[i], cos and sin times attention_factor.

    transformers keeps two sets of factors and picks one per sequence: short_factor while the sequence (its last
    position + 1) is at most original_max_position_embeddings, long_factor once it is longer, recomputing the
    frequencies of every position of that sequence. A paged engine cannot follow the switch (keys already in the
    cache were rotated with the short set), so fnvllm serves a longrope checkpoint only up to
    original_max_position_embeddings (``served_positions``; a longer max_model_len is refused by name), where the
    short set is exactly what transformers uses. The attention factor multiplies cos and sin at every length, as
    transformers does.

    short_factor / long_factor: one positive divisor per pair (head_dim / 2 entries); long_factor is kept for the
        record (it acts only past original_max_position_embeddings).
    original_max_position_embeddings: the context the model was pretrained at (Phi-3's 4096); the longest
        sequence fnvllm serves with this scaling.
    attention_factor: the checkpoint's, else ``longrope_attention_factor`` of max_position_embeddings / original.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    def __attrs_post_init__(self) -> None:
        """Reject factor lists and lengths the frequencies cannot be computed from, naming the field."""
        for name in ("short_factor", "long_factor"):
            factors = getattr(self, name)
            if not isinstance(factors, tuple) or not factors:
                raise ValueError(f"{name} must be a non-empty list of positive numbers, got {factors!r}")
            for value in factors:
                _check_positive_number(f"each entry of {name}", value)
        _check_positive_int("original_max_position_embeddings", self.original_max_position_embeddings)
        _check_positive_number("attention_factor", self.attention_factor)

    def scale_inv_freq(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """1 / (short_factor[i] * theta^(2i/D)), computed as transformers computes it (the same float32 ops, so
        the table is bit-identical); inv_freq gives only D."""
        num_pairs = inv_freq.shape[0]
        if len(self.short_factor) != num_pairs:
            raise ValueError(
                f"short_factor has {len(self.short_factor)} entries; longrope needs one per rotary pair, "
                f"head_dim / 2 = {num_pairs}"
            )
        dim = 2 * num_pairs
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=inv_freq.device).float() / dim
        factors = torch.tensor(self.short_factor, dtype=torch.float32, device=inv_freq.device)
        return 1.0 / (factors * theta**exponents)


def longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin factor when a checkpoint gives none: sqrt(1 + ln(factor) / ln(original)) for factor > 1
    (Phi-3-mini-128k: factor 131072 / 4096 = 32 gives 1.1902), 1 otherwise."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling | DynamicNtkRopeScaling | LongRopeScaling
"""Any rope scaling a ModelConfig can carry (None there: plain rope)."""


def served_positions(scaling: RopeScaling | None, max_position_embeddings: int) -> int:
    """The longest sequence a checkpoint is served at: how far its rope scaling reaches, and never less than
    max_position_embeddings but for longrope (below).

    A stretching scaling is there to serve longer sequences than config.json's max_position_embeddings says, and
    its tables are the same at every length (so fnvllm matches transformers at any length), as vLLM reads them:

    - yarn: original_max_position_embeddings x factor (Qwen's documented long context: config.json keeps
      max_position_embeddings 32768 and adds {"rope_type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768}, which serves 131072 tokens);
    - linear: max_position_embeddings x factor (a 2048-token model stretched by 4 serves 8192);
    - llama3: max_position_embeddings (Llama 3.1's config already states the scaled 131072);
    - dynamic: max_position_embeddings, never more (past it transformers changes the frequencies per sequence:
      see the module docstring);
    - longrope: original_max_position_embeddings, less than max_position_embeddings (Phi-3-mini-128k: 4096 of
      131072), the one exception: past it transformers switches to the long factors per sequence
      (``LongRopeScaling``).
    """
    if isinstance(scaling, LongRopeScaling):
        return scaling.original_max_position_embeddings
    if isinstance(scaling, YarnRopeScaling):
        reach = scaling.original_max_position_embeddings * scaling.factor
    elif isinstance(scaling, LinearRopeScaling):
        reach = max_position_embeddings * scaling.factor
    else:
        reach = max_position_embeddings
    return max(max_position_embeddings, int(reach))

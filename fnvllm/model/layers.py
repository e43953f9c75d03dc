"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding tables, merged linears, LM head.

Numerics follow Hugging Face's Llama/Qwen code: RMSNorm normalises in float32 and casts back before the
weight; rope angles are position * inv_freq in float32. The small ops themselves (norm, rotation, SiLU-and-mul)
live in ``ops.py``, where a model's ``ModelOps`` picks torch, torch.compile or Triton.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from fnvllm.model.config import Llama3RopeScaling
from fnvllm.model.ops import TORCH_OPS, ModelOps


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, with a learned scale (computed by ``ops``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise x (..., size); same shape and dtype."""
        return self.ops.rmsnorm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream update fused with the next norm."""
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies theta^(-2i/head_dim), llama3-scaled when asked."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq if scaling is None else llama3_scale_inv_freq(inv_freq, scaling)


def llama3_scale_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: stretch long wavelengths by `factor`, keep short ones, blend those in between."""
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor  # longer than this: divide by factor
    high_freq_wavelen = old_len / scaling.high_freq_factor  # shorter than this: keep
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cached float32 cos/sin table for positions 0..max_positions-1.

    Positions at or beyond max_positions (the config's max_position_embeddings) are out of range; the engine
    must cap max_model_len accordingly.
    """

    cos_sin_cache: torch.Tensor  # (max_positions, head_dim): [cos | sin]

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: Llama3RopeScaling | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", self._cos_sin(None), persistent=False)

    def _cos_sin(self, device: torch.device | None) -> torch.Tensor:
        """(max_positions, head_dim) float32: [cos | sin] of position * inv_freq (default device if None)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(positions.device)
        angles = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim / 2)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def init_buffers(self) -> None:
        """Recompute the table in place on its current device (after materialising a meta-device model)."""
        self.cos_sin_cache = self._cos_sin(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, head_dim / 2) float32, for positions (T,)."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return cos, sin


class MergedLinear(nn.Linear):
    """One linear whose output rows are several logical projections stacked (e.g. q, k, v).

    shards maps each projection's checkpoint module name (e.g. "q_proj") to its (start, end) output rows; the
    loader copies checkpoint tensor `<parent>.q_proj.weight` into weight[start:end] (and likewise the bias).
    """

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, tuple[int, int]],
        bias: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        out_features = max(end for _, end in shards.values())
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.shards = MappingProxyType(dict(shards))


def qkv_linear(
    hidden_size: int, q_size: int, kv_size: int, bias: bool, dtype: torch.dtype | None = None
) -> MergedLinear:
    """Fused q/k/v projection: output rows [q_proj | k_proj | v_proj] of widths q_size, kv_size, kv_size."""
    k_end = q_size + kv_size
    shards = {"q_proj": (0, q_size), "k_proj": (q_size, k_end), "v_proj": (k_end, k_end + kv_size)}
    return MergedLinear(hidden_size, shards, bias=bias, dtype=dtype)


def gate_up_linear(hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None) -> MergedLinear:
    """Fused gate/up projection of a gated MLP: output rows [gate_proj | up_proj]."""
    shards = {"gate_proj": (0, intermediate_size), "up_proj": (intermediate_size, 2 * intermediate_size)}
    return MergedLinear(hidden_size, shards, bias=False, dtype=dtype)


class LMHead(nn.Module):
    """Projection from hidden states to vocabulary logits (its weight may be the embedding's, when tied)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype).normal_(std=0.02))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (N, vocab) in float32 for hidden (N, hidden_size)."""
        return F.linear(hidden, self.weight).float()

"""Building blocks of Llama-family decoders: RMSNorm and rotary embedding tables.

The linear layers (merged q/k/v and gate/up, the embedding and the LM head) live in ``sharding.py``, where
tensor parallelism splits them.

Numerics follow Hugging Face's Llama/Qwen code: RMSNorm normalises in float32 and casts back before the
weight; rope angles are position * inv_freq in float32. The small ops themselves (norm, rotation, SiLU-and-mul)
live in ``ops.py``, where a model's ``ModelOps`` picks torch, torch.compile or Triton.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fnvllm.model.ops import TORCH_OPS, ModelOps
from fnvllm.model.rope import RopeScaling


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

    def add_and_norm(self, x: Any, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream update fused with the next norm. x (T, size), or
        split partials where the ops' add_rmsnorm takes them (``ModelOps.linear_partials``)."""
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies theta^(-2i/head_dim), scaled by ``scaling`` when given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq if scaling is None else scaling.scale_inv_freq(inv_freq, theta)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cached float32 cos/sin table for positions 0..max_positions-1.

    Positions at or beyond max_positions (the config's max_seq_len: max_position_embeddings, or as far as its rope
    scaling reaches) are out of range; the engine caps max_model_len there.
    """

    cos_sin_cache: torch.Tensor  # (max_positions, head_dim): [cos | sin]

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        table = torch.empty(max_positions, head_dim)  # on the meta device init_buffers computes it later (and
        # computing it there would import torch._dynamo, seconds per process)
        self.register_buffer("cos_sin_cache", table if table.is_meta else self._cos_sin(None), persistent=False)

    def _cos_sin(self, device: torch.device | None) -> torch.Tensor:
        """(max_positions, head_dim) float32: [cos | sin] of position * inv_freq, times the scaling's attention
        factor (YaRN's; 1 otherwise), on ``device`` (the default device if None)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(positions.device)
        angles = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim / 2)
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return table if self.scaling is None else table * self.scaling.attention_factor

    def init_buffers(self) -> None:
        """Recompute the table in place on its current device (after materialising a meta-device model)."""
        self.cos_sin_cache = self._cos_sin(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, head_dim / 2) float32, for positions (T,)."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return cos, sin

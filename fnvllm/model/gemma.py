"""Gemma 3's text decoder (``Gemma3ForCausalLM``, and the language model of ``Gemma3ForConditionalGeneration``):
the Llama family's attention with Gemma's numerics around it.

What differs from ``models.py``, as transformers' Gemma3TextModel computes it:

- every RMSNorm scales by (1 + w), in float32, and casts the product (``gemma_rmsnorm_ref``; Llama's casts the
  normalised x first, then multiplies by w);
- four norms per layer: input and post_attention around attention, pre_feedforward and post_feedforward around
  the MLP; the post norms apply to the block's output before it joins the residual stream (``GemmaDecoderLayer``);
- q and k are RMS-normed per head (the (1 + w) form) before rope, as Qwen3's;
- the MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x)) (``GemmaMLP``);
- the embedding rows are multiplied by sqrt(hidden_size) rounded to the embedding's dtype (``embed_scale``);
- the attention scale is query_pre_attn_scalar ** -0.5 (``GemmaAttention``);
- two rope tables: the local (sliding_attention) layers rotate with rope_local_theta and no scaling, the global
  ones with rope_theta and the config's scaling (linear factor 8 on the 4B+ models).

The small ops: ``gemma_ops`` keeps the given ops' projections (``linear``: the Triton skinny GEMM under "triton")
and computes the norms, q/k norm + rope and GeGLU with the torch references here; the fused kernels that assume
Llama's norm (norm_rope_store, norm_linear, norm_mlp, split partials, FP8 producers, embed_rope) are off. The
attention backends are the shared ones (window per layer as ``ModelConfig.layer_window`` gives it).

Tensor parallelism: as ``sharding.py`` splits the Llama family (q/k/v and gate/up by columns, o_proj and down_proj
by rows, each followed by its all-reduce, vocab-parallel embedding and head); the norms are replicated and act on
the full hidden state after each all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fnvllm.kernels.attention import AttentionMetadata, KVCache
from fnvllm.kernels.backends import AttentionBackend
from fnvllm.kernels.reference import rotary_ref, silu_and_mul_ref
from fnvllm.model.config import ModelConfig
from fnvllm.model.layers import RMSNorm, RotaryEmbedding
from fnvllm.model.models import Attention, DecoderForCausalLM, check_layer_caches
from fnvllm.model.ops import TORCH_OPS, ModelOps
from fnvllm.model.sharding import (
    SINGLE,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    all_reduce,
    gate_up_parallel,
)


def gemma_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim: normalise(x) * (1 + weight), all in float32, then cast to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gemma_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rmsnorm(x + residual), x + residual)."""
    residual = x + residual
    return gemma_rmsnorm_ref(residual, weight, eps), residual


def gemma_norm_rotary_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head Gemma RMSNorm of x (T, H, D) by weight (D,) (skipped when None), then the rotation."""
    return rotary_ref(x if weight is None else gemma_rmsnorm_ref(x, weight, eps), cos, sin)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] (T, 2I); returns (T, I) (transformers' gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gemma_ops(ops: ModelOps = TORCH_OPS) -> ModelOps:
    """``ops`` for a Gemma model: its projections (``linear``) kept, Gemma's norms and q/k norm + rope in torch,
    and none of the fused kernels built around Llama's norm (see the module docstring)."""
    return ModelOps(
        f"{ops.name}+gemma",
        gemma_rmsnorm_ref,
        gemma_add_rmsnorm_ref,
        rotary_ref,
        silu_and_mul_ref,  # unused: GemmaMLP computes GeGLU
        gemma_norm_rotary_ref,
        linear=ops.linear,
    )


def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """The embedding multiplier sqrt(hidden_size) as transformers applies it: a float32 scalar cast to the
    embedding's dtype (bfloat16: sqrt(3072) = 55.4256 becomes 55.5). Exact as a Python float, so multiplying by it
    rounds as multiplying by that dtype's scalar tensor does."""
    return torch.tensor(hidden_size**0.5, dtype=torch.float32, device="cpu").to(dtype).item()  # not meta


class GemmaAttention(Attention):
    """The shared grouped-query attention with Gemma's scale, query_pre_attn_scalar ** -0.5 (its q/k norms are
    RMSNorms whose ops are ``gemma_ops``')."""

    def __init__(self, config: ModelConfig, ops: ModelOps, tp: TensorParallel, layer: int) -> None:
        super().__init__(config, ops, tp, layer)
        if config.gemma is None:
            raise ValueError(f"GemmaAttention needs a Gemma 3 config, got {config.architecture}")
        self.scale = config.gemma.attention_scale


class GemmaMLP(nn.Module):
    """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x)), this rank's intermediate slice under TP (the sum of
    the ranks' partial outputs is all-reduced here)."""

    def __init__(self, config: ModelConfig, ops: ModelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = gate_up_parallel(config, tp, ops.linear)
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, False, config.torch_dtype, tp, None, ops.linear
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden_size) -> (T, hidden_size)."""
        act = gelu_tanh_and_mul_ref(self.gate_up_proj(x))  # (T, intermediate / world)
        return all_reduce(self.down_proj(act), self.tp)


class GemmaDecoderLayer(nn.Module):
    """One Gemma 3 block; the hidden state is the residual stream itself:
    h = h + post_attention_norm(attn(input_norm(h))); h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))."""

    def __init__(self, config: ModelConfig, ops: ModelOps, tp: TensorParallel, index: int) -> None:
        super().__init__()
        dtype, size, eps = config.torch_dtype, config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype, ops)
        self.self_attn = GemmaAttention(config, ops, tp, index)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype, ops)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype, ops)
        self.mlp = GemmaMLP(config, ops, tp)
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size); writes this step's K/V into kv_cache."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, meta, backend)
        if not isinstance(attn, torch.Tensor):  # gemma_ops leave no split partials
            raise TypeError("GemmaDecoderLayer needs its attention output summed (gemma_ops has no linear_partials)")
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaDecoderModel(nn.Module):
    """Scaled embedding, decoder layers and final norm (HF's ``model.`` names), with the two rope tables:
    ``rotary_emb`` (global layers: rope_theta and the config's scaling) and ``local_rotary_emb`` (local layers)."""

    def __init__(self, config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if config.gemma is None:
            raise ValueError(f"GemmaDecoderModel needs a Gemma 3 config, got {config.architecture}")
        dtype, length = config.torch_dtype, config.max_seq_len
        self.tp = tp
        self.embed_scale = embed_scale(config.hidden_size, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(config.head_dim, length, config.rope_theta, config.rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, length, config.gemma.rope_local_theta)
        self.is_local = tuple(i in config.gemma.local_layers for i in range(config.num_hidden_layers))
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ops, tp, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)

    def init_buffers(self) -> None:
        """Recompute both rope tables on their current device."""
        self.rotary_emb.init_buffers()
        self.local_rotary_emb.init_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Final-normed hidden states (T, hidden_size) for input_ids (T,) at positions (T,)."""
        check_layer_caches(kv_caches, len(self.layers))
        hidden = all_reduce(self.embed_tokens(input_ids), self.tp) * self.embed_scale  # (T, hidden_size)
        global_rope, local_rope = self.rotary_emb(positions), self.local_rotary_emb(positions)
        for layer, kv_cache, is_local in zip(self.layers, kv_caches, self.is_local, strict=True):
            hidden = layer(hidden, local_rope if is_local else global_rope, kv_cache, meta, backend)
        return self.norm(hidden)


class GemmaForCausalLM(DecoderForCausalLM):
    """A Gemma 3 causal LM: ``DecoderForCausalLM``'s head, tying, forward and logits over a ``GemmaDecoderModel``,
    computing with ``gemma_ops(ops)``."""

    model: GemmaDecoderModel

    def __init__(self, config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, gemma_ops(ops), tp)

    @staticmethod
    def build_decoder(config: ModelConfig, ops: ModelOps, tp: TensorParallel) -> nn.Module:
        """Gemma's body (``GemmaDecoderModel``)."""
        return GemmaDecoderModel(config, ops, tp)

    def init_buffers(self) -> None:
        """Recompute both rope tables (after materialising a meta-device model)."""
        self.model.init_buffers()

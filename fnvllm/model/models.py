"""Decoder-only transformers of the Llama family: Qwen3, Qwen3-MoE, Qwen2, Qwen2-MoE, Llama, Mistral, Mixtral and Phi-3
share one definition.

They differ only in flags carried by ModelConfig: Qwen3 RMS-normalises each q/k head before rope (qk_norm);
Qwen2 has q/k/v biases (attention_bias); Llama 3.1 scales rope frequencies (rope_scaling); Qwen3-MoE is Qwen3
with a mixture of experts (``moe.py``) in place of the MLP of every sparse layer (config.moe). Mistral is Llama
(its head_dim may differ from hidden / heads, as Mistral-Nemo's 128 with 5120 / 32; its sliding window applies to
every layer, Qwen2's with use_sliding_window to some: ``ModelConfig.layer_window``, which each ``Attention`` passes
to every attention call); Mixtral is Mistral with every
MLP a mixture of experts, the same ``moe.py`` block (the loader maps its checkpoint names). Qwen2-MoE is Qwen2 with
that block in its sparse layers plus a shared expert: an ``MLP`` of its own width whose ranks' sum the block takes
(``DecoderLayer.feed_forward`` builds it; HF's names ``mlp.shared_expert.*``). Phi-3 is Llama with no biases, a
sliding window on every layer (as Mistral's) and, for its 128k checkpoints, longrope (``rope.LongRopeScaling``); its
checkpoints store qkv_proj and gate_up_proj already stacked, which the loader reads as their parts. Module names
mirror Hugging Face's (model.layers.N.self_attn.o_proj, ...) except the fused qkv_proj and gate_up_proj.

The model holds no KV cache and no global context: each forward receives the per-layer caches and the step's
AttentionMetadata as arguments.

Tensor parallelism (``tp``, see ``sharding.py``): each rank builds its slice of every layer; the all-reduces
after the embedding, o_proj and down_proj and the logit gather are written out below where they happen. At
world size 1 they are no-ops and the layers are plain linears.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fnvllm.kernels.attention import AttentionMetadata, KVCache, attend_stored, attention
from fnvllm.kernels.backends import AttentionBackend, get_backend
from fnvllm.kernels.reference import split_partials_sum_ref
from fnvllm.model.config import ModelConfig
from fnvllm.model.layers import RMSNorm, RotaryEmbedding
from fnvllm.model.moe import SparseMoeBlock
from fnvllm.model.ops import TORCH_OPS, ModelOps
from fnvllm.model.sharding import (
    SINGLE,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    all_reduce,
    gate_up_parallel,
    gather_vocab,
    local_heads,
    qkv_parallel,
)

if TYPE_CHECKING:  # Triton's module: the FP8 producers exist only with the Triton ops
    from fnvllm.kernels.fused_ops import Fp8Activations, SplitPartials


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache (this rank's heads under tensor parallelism).

    window: decoder layer ``layer``'s sliding window in tokens (``ModelConfig.layer_window``; None: full attention),
    a constant every attention call of the layer passes to the backend.
    """

    def __init__(
        self, config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE, layer: int = 0
    ) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.window = config.layer_window(layer)
        dtype = config.torch_dtype
        self.num_heads, self.num_kv_heads = local_heads(config, tp)
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        d = config.head_dim
        self.split_sizes = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = qkv_parallel(config, tp, ops.linear)
        self.o_proj = RowParallelLinear(
            config.q_size, config.hidden_size, config.o_proj_bias, dtype, tp, config.quantization, ops.linear
        )
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, ops) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor | SplitPartials:
        """hidden (T, hidden_size) -> (T, hidden_size), or its split partials (``_project_out``); writes this step's
        K/V (local heads) into kv_cache."""
        qkv_proj, linear_partials = self.qkv_proj, self.ops.linear_partials
        if linear_partials is not None and self.takes_qkv_partials():
            return self.attend_projected(linear_partials(hidden, qkv_proj.weight, None), rope, kv_cache, meta, backend)
        return self.attend_projected(qkv_proj(hidden), rope, kv_cache, meta, backend)

    def attend_projected(
        self,
        qkv: torch.Tensor | SplitPartials,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor | SplitPartials:
        """``forward`` from the qkv projection's output (T, (Hq + 2 Hkv) * D) on: -> (T, hidden_size). qkv may be its
        split partials where ``takes_qkv_partials`` (the fused prologue sums them)."""
        fused = self.ops.norm_rope_store
        if fused is not None:  # q/k norms, rope and the K/V store in one kernel
            out = self._fused_prologue_attention(fused, qkv, rope, KVCache(*kv_cache), meta, backend)
            return self._project_out(out.reshape(out.shape[0], -1))
        if not isinstance(qkv, torch.Tensor):
            raise TypeError("qkv split partials need ops.norm_rope_store to sum them (see takes_qkv_partials)")
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head RMSNorm, then rope, one op each
            q = self.ops.norm_rotary(q, self.q_norm.weight, self.q_norm.eps, *rope)
            k = self.ops.norm_rotary(k, self.k_norm.weight, self.k_norm.eps, *rope)
        else:
            q, k = self.ops.rotary(q, *rope), self.ops.rotary(k, *rope)
        cache = KVCache(*kv_cache)  # FP8 caches carry their (Hkv,) k_scale, v_scale
        scales = cache.k_scale, cache.v_scale
        out = attention(q, k, v, cache.k, cache.v, meta, self.scale, backend, *scales, window=self.window)  # (T, Hq, D)
        return self._project_out(out.reshape(num_tokens, -1))

    def _project_out(self, out: torch.Tensor) -> torch.Tensor | SplitPartials:
        """o_proj of the attention output (T, Hq * D of this rank's heads), summed over the ranks: (T, hidden_size);
        or, with ``ops.linear_partials`` in one process and no bias, possibly its split partials left for the
        post-attention norm to sum (every path of ``DecoderLayer.forward`` after attention takes them)."""
        o_proj, linear_partials = self.o_proj, self.ops.linear_partials
        if linear_partials is not None and leaves_partials(o_proj, self.tp):
            return linear_partials(out, o_proj.weight, None)
        return all_reduce(o_proj(out), self.tp)  # this rank's heads only, then the sum

    def _fused_prologue_attention(
        self,
        fused: Callable[..., torch.Tensor],
        qkv: torch.Tensor | SplitPartials,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Attention output (T, Hq, D) from the projection qkv, with ``fused`` (``ops.norm_rope_store``, one
        kernel) storing this step's K/V and giving the normed, rotated q."""
        q = fused(qkv, *self._prologue_args(rope, kv_cache, meta))
        scales = kv_cache.k_scale, kv_cache.v_scale
        return attend_stored(q, kv_cache.k, kv_cache.v, meta, self.scale, backend, *scales, window=self.window)

    def _prologue_args(
        self, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple:
        """``norm_rope_store``'s arguments after qkv: heads, q/k norm weights (or None) and eps, cos, sin, the
        caches, the slots and the FP8 scales."""
        has_norm = self.q_norm is not None and self.k_norm is not None
        q_w = self.q_norm.weight if has_norm and self.q_norm is not None else None
        k_w = self.k_norm.weight if has_norm and self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        return (self.num_heads, self.num_kv_heads, q_w, k_w, eps, *rope, kv_cache.k, kv_cache.v, meta.slot_mapping,
                kv_cache.k_scale, kv_cache.v_scale)  # fmt: skip

    def takes_qkv_partials(self) -> bool:
        """Whether ``attend_projected`` may take the qkv projection's split partials: the ops leave partials
        (``linear_partials``) and fuse the attention prologue (``norm_rope_store`` sums them), and the projection
        is in the model's dtype with no bias (a column-parallel qkv needs no all-reduce, so tensor parallelism
        keeps them)."""
        ops, proj = self.ops, self.qkv_proj
        fused = ops.linear_partials is not None and ops.norm_rope_store is not None
        return fused and proj.bias is None and proj.weight_scale_inv is None

    def fuses_qkv_epilogue(self) -> bool:
        """Whether ``norm_forward`` applies: the ops have ``norm_linear_rope_store`` and the qkv weights are in
        the model's dtype (FP8 weights keep their own GEMM)."""
        return self.ops.norm_linear_rope_store is not None and self.qkv_proj.weight_scale_inv is None

    def norm_forward(
        self,
        hidden: torch.Tensor | SplitPartials,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """(forward(norm(hidden + residual)), hidden + residual) with the residual add + RMSNorm, qkv projection
        and attention prologue in ``ops.norm_linear_rope_store`` (its qkv epilogue at few rows on a GPU)."""
        fused = self.ops.norm_linear_rope_store
        if fused is None:
            raise RuntimeError("Attention.norm_forward needs ops.norm_linear_rope_store (see fuses_qkv_epilogue)")
        kv = KVCache(*kv_cache)
        proj = self.qkv_proj
        q, residual = fused(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias,
                            *self._prologue_args(rope, kv, meta))  # fmt: skip
        out = attend_stored(q, kv.k, kv.v, meta, self.scale, backend, kv.k_scale, kv.v_scale, self.window)  # (T, Hq, D)
        return self._project_out(out.reshape(q.shape[0], -1)), residual


class MLP(nn.Module):
    """Gated SiLU feed-forward: down(silu(gate(x)) * up(x)) (this rank's intermediate slice under TP).

    intermediate_size: its width (None: the config's; Qwen2-MoE's shared expert has its own). reduce_results: sum
    the ranks' partial outputs (the all-reduce); False leaves this rank's partial sum to a caller that adds it to
    another before one all-reduce (the MoE block with a shared expert), the same as True at world size 1.
    """

    def __init__(
        self,
        config: ModelConfig,
        ops: ModelOps = TORCH_OPS,
        tp: TensorParallel = SINGLE,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.reduce_results = reduce_results
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = gate_up_parallel(config, tp, ops.linear, size)
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, False, config.torch_dtype, tp, config.quantization, ops.linear
        )

    def forward(self, x: torch.Tensor | Fp8Activations, keep_partials: bool = False) -> torch.Tensor | SplitPartials:
        """x (T, hidden_size), or already quantized for an FP8 gate_up_proj -> (T, hidden_size); keep_partials: as
        ``down``'s."""
        return self.down(self.gate_up_proj(x), keep_partials)

    def fuses_norm_mlp(self) -> bool:
        """Whether ``norm_forward`` applies: the ops have ``norm_mlp`` and both projections are in the model's
        dtype (FP8 weights keep their own GEMM)."""
        in_dtype = self.gate_up_proj.weight_scale_inv is None and self.down_proj.weight_scale_inv is None
        return self.ops.norm_mlp is not None and in_dtype

    def norm_forward(
        self,
        x: torch.Tensor | SplitPartials,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        keep_partials: bool = False,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """(forward(rmsnorm(x + residual)), x + residual) by ``ops.norm_mlp`` (see ``fuses_norm_mlp``); x may be
        split partials; keep_partials: as ``down``'s."""
        gate_up, down = self.gate_up_proj, self.down_proj
        bias = down.bias if down.adds_bias else None
        norm_mlp = self.ops.norm_mlp
        if norm_mlp is None:
            raise RuntimeError("MLP.norm_forward needs ops.norm_mlp (see fuses_norm_mlp)")
        if keep_partials and self.ops.linear_partials is not None and leaves_partials(down, self.tp):
            return norm_mlp(x, residual, norm_weight, eps, gate_up.weight, gate_up.bias, down.weight, None,
                            keep_partials=True)  # fmt: skip
        y, residual = norm_mlp(x, residual, norm_weight, eps, gate_up.weight, gate_up.bias, down.weight, bias)
        return self._reduce(y), residual

    def down(self, gate_up: torch.Tensor, keep_partials: bool = False) -> torch.Tensor | SplitPartials:
        """``forward`` from the gate/up projection's output (T, 2 * intermediate on this rank) on. keep_partials:
        the caller's next op sums split partials (the next layer's input norm), so down_proj may return its K
        splits unsummed (``SplitPartials``): in one process without a bias, a K-split skinny product where the ops
        have ``linear_partials``, or an FP8 down_proj whose input the producers quantize where
        ``fp8_producers.sum_down_splits``."""
        glu = self.ops.silu_mul_linear
        if glu is not None and self.down_proj.weight_scale_inv is None:  # activation fused into down_proj's load
            if keep_partials and self.ops.linear_partials is not None and leaves_partials(self.down_proj, self.tp):
                return glu(gate_up, self.down_proj.weight, None, keep_partials=True)
            bias = self.down_proj.bias if self.down_proj.adds_bias else None
            partial = glu(gate_up, self.down_proj.weight, bias)  # (T, hidden_size)
        else:  # an FP8 down_proj at few tokens may take its input quantized by the SiLU-and-mul (fp8_producers)
            producers = self.ops.fp8_producers
            quantized = producers is not None and producers.applies(gate_up, self.down_proj)
            act = producers.silu_and_mul(gate_up) if quantized else self.ops.silu_and_mul(gate_up)  # (T, inter)
            down = self.down_proj
            single = not self.tp.is_parallel and down.bias is None  # no all-reduce, no bias after the sum
            if quantized and keep_partials and single and producers.sum_down_splits:
                return producers.gemm_partials(act, down.weight, down.weight_scale_inv)  # (S, T, hidden_size)
            linear_partials = self.ops.linear_partials
            if keep_partials and linear_partials is not None and not quantized and leaves_partials(down, self.tp):
                return linear_partials(act, down.weight, None)
            partial = down(act)  # (T, hidden_size)
        return self._reduce(partial)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' sum of this rank's partial output (T, hidden_size), or the partial itself where the caller sums
        it (``reduce_results=False``)."""
        return all_reduce(partial, self.tp) if self.reduce_results else partial


def leaves_partials(linear: RowParallelLinear, tp: TensorParallel) -> bool:
    """Whether a row-parallel projection may leave its K splits' float32 partials for the norm after it to sum
    (``ModelOps.linear_partials``): one process (no all-reduce), weights in the model's dtype, no bias."""
    return not tp.is_parallel and linear.weight_scale_inv is None and linear.bias is None


class DecoderLayer(nn.Module):
    """Pre-norm transformer block; the residual stream is threaded through explicitly. Layer ``index`` of a MoE
    model has a SparseMoeBlock as its ``mlp`` when the config makes it sparse."""

    def __init__(
        self, config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(config, ops, tp, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.mlp = self.feed_forward(config, ops, tp, index)
        self.is_last = index == config.num_hidden_layers - 1  # else the next layer's input norm reads our output

    @staticmethod
    def feed_forward(config: ModelConfig, ops: ModelOps, tp: TensorParallel, index: int) -> MLP | SparseMoeBlock:
        """Layer ``index``'s ``mlp``: a dense MLP, or the sparse MoE block with (Qwen2-MoE) its shared expert, an MLP
        of shared_expert_intermediate_size whose partial sum the block adds to the experts' before its all-reduce."""
        moe = config.moe
        if moe is None or not config.is_sparse_layer(index):
            return MLP(config, ops, tp)
        width = moe.shared_expert_intermediate_size
        shared = None if width is None else MLP(config, ops, tp, intermediate_size=width, reduce_results=False)
        return SparseMoeBlock(config, ops, tp, shared_expert=shared)

    def forward(
        self,
        hidden: torch.Tensor | SplitPartials,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
        """(block output, residual stream), both (T, hidden_size); residual is None for the first layer.

        With ``ops.norm_linear`` each residual add + RMSNorm runs inside the projection after it (qkv, gate/up),
        where that projection's weights are in the model's dtype (FP8 weights and MoE blocks keep the norm op);
        with ``ops.norm_linear_rope_store`` the attention prologue runs in the qkv projection too. With
        ``ops.fp8_producers`` the norms and SiLU before FP8 projections write their inputs quantized at few tokens.
        Split partials (``SplitPartials``): with ``ops.linear_partials`` the qkv projection's may go to the attention
        prologue (``Attention.takes_qkv_partials``), the attention output may be o_proj's, which the post-attention
        norm sums, and the block output of a layer but the last may be down_proj's (so may an FP8 down_proj's with
        ``sum_down_splits``), which the next layer's input norm sums (``norm_for``, ``norm_linear``, ``norm_mlp``)."""
        norm_linear, attn, mlp = self.input_layernorm.ops.norm_linear, self.self_attn, self.mlp
        in_norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        if attn.fuses_qkv_epilogue():  # norm, qkv, q/k norms, rotary, K/V store: ``ops.norm_linear_rope_store``
            hidden, residual = attn.norm_forward(hidden, residual, in_norm, rope, kv_cache, meta, backend)
        elif norm_linear is not None and attn.qkv_proj.weight_scale_inv is None:
            qkv_proj, keep = attn.qkv_proj, attn.takes_qkv_partials()
            qkv, residual = norm_linear(hidden, residual, in_norm.weight, in_norm.eps, qkv_proj.weight, qkv_proj.bias,
                                        **({"keep_partials": True} if keep else {}))  # fmt: skip
            hidden = attn.attend_projected(qkv, rope, kv_cache, meta, backend)
        else:
            normed, residual = norm_for(in_norm, hidden, residual, attn.qkv_proj)
            hidden = attn(normed, rope, kv_cache, meta, backend)
        if isinstance(mlp, MLP) and mlp.fuses_norm_mlp():  # norm, gate/up, activation, down: ``ops.norm_mlp``
            return mlp.norm_forward(hidden, residual, post_norm.weight, post_norm.eps, not self.is_last)
        if norm_linear is not None and isinstance(mlp, MLP) and mlp.gate_up_proj.weight_scale_inv is None:
            proj = mlp.gate_up_proj
            gate_up, residual = norm_linear(hidden, residual, post_norm.weight, post_norm.eps, proj.weight, proj.bias)
            return mlp.down(gate_up, keep_partials=not self.is_last), residual
        if not isinstance(mlp, MLP):
            normed, residual = norm_for(post_norm, hidden, residual, None)
            return mlp(normed), residual
        normed, residual = norm_for(post_norm, hidden, residual, mlp.gate_up_proj)
        return mlp(normed, keep_partials=not self.is_last), residual


def norm_for(
    norm: RMSNorm, x: torch.Tensor | SplitPartials, residual: torch.Tensor | None, linear: nn.Module | None
) -> tuple[torch.Tensor | Fp8Activations, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) when residual is None (the first layer): the normed
    value quantized for ``linear`` (``Fp8Activations``, in the norm's launch) when the ops have FP8 producers that
    apply to it (an FP8 projection at few tokens on a GPU), else the norm's 16-bit output. x may be the previous
    layer's down projection or this layer's o_proj left as split partials: summed by the norm's kernel (the
    quantizing one, or with ``ops.linear_partials`` the add + RMSNorm), else first here."""
    producers = norm.ops.fp8_producers
    applies = producers is not None and linear is not None and producers.applies(x, linear)
    norm_sums = residual is not None and (applies or norm.ops.linear_partials is not None)
    if not isinstance(x, torch.Tensor) and not norm_sums:  # SplitPartials the norm below cannot take
        x = producers.sum_partials(x) if producers is not None else split_partials_sum_ref(x.parts, x.dtype)
    if applies:
        if residual is None:
            return producers.rmsnorm(x, norm.weight, norm.eps), x
        return producers.add_rmsnorm(x, residual, norm.weight, norm.eps)
    return (norm(x), x) if residual is None else norm.add_and_norm(x, residual)


def check_layer_caches(kv_caches: Sequence[KVCache], num_layers: int) -> None:
    """ValueError unless there is one KV cache per decoder layer."""
    if len(kv_caches) != num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} entries; the model has {num_layers} layers")


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.tp = tp
        self.ops = ops
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, ops, tp, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)

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
        hidden, rope = self._embed(input_ids, positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta, backend)
        return self.norm(hidden) if residual is None else self.norm.add_and_norm(hidden, residual)[0]

    def _embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The tokens' embeddings (T, hidden_size) and rotary (cos, sin), each (T, D/2): one launch when the ops
        have ``embed_rope`` and the embedding is whole on this rank, else two gathers (and the ranks' sum)."""
        if self.ops.embed_rope is not None and not self.embed_tokens.is_parallel:
            hidden, cos, sin = self.ops.embed_rope(
                self.embed_tokens.weight, input_ids, self.rotary_emb.cos_sin_cache, positions
            )
            return hidden, (cos, sin)
        rope = self.rotary_emb(positions)
        return all_reduce(self.embed_tokens(input_ids), self.tp), rope


class DecoderForCausalLM(nn.Module):
    """A Qwen3 / Qwen3-MoE / Qwen2 / Qwen2-MoE / Llama / Mistral / Mixtral causal LM: `forward` gives hidden states,
    `compute_logits` the logits.

    ops: the implementation of the small fused ops (norms, rotary, SiLU-and-mul); see ``fnvllm.model.ops``.
    tp: this rank's place in a tensor-parallel group (``sharding.py``); the default is one process, unsplit.
    """

    def __init__(self, config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.tp = tp
        self.model = self.build_decoder(config, ops, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.torch_dtype, tp)
        self.tie_weights()

    @staticmethod
    def build_decoder(config: ModelConfig, ops: ModelOps, tp: TensorParallel) -> Any:
        """The body under ``model.`` (embedding, decoder layers, final norm): the Llama family's ``DecoderModel``;
        Gemma 3's subclass builds its own (``fnvllm.model.gemma``), with the same embed_tokens and forward."""
        return DecoderModel(config, ops, tp)

    def tie_weights(self) -> None:
        """Make lm_head share the embedding matrix when the config ties them (re-run after materialising)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (the rope table) on their current device."""
        self.model.rotary_emb.init_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        meta: AttentionMetadata,
        backend: str | AttentionBackend = "torch",
    ) -> torch.Tensor:
        """Hidden states (T, hidden_size) for the step's tokens; writes their K/V into kv_caches."""
        return self.model(
            input_ids, positions, kv_caches, meta, get_backend(backend) if isinstance(backend, str) else backend
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits (N, vocab_size) in the model's dtype for hidden states (N, hidden_size); under tensor
        parallelism only the first rank gets them (the others send it their vocab columns and get None).

        Not upcast here: the samplers read them once and upcast as they go (a float32 copy of a 256 x 151,936
        batch is 155 MB of writes per step)."""
        return gather_vocab(self.lm_head(hidden), self.config.vocab_size, self.tp)  # (N, V) on rank 0


def build_model(config: ModelConfig, ops: ModelOps = TORCH_OPS, tp: TensorParallel = SINGLE) -> DecoderForCausalLM:
    """A randomly initialised model (this rank's slice of it, under ``tp``) for `config` with parameters in
    config.dtype, computing with `ops`.

    Build it under `torch.device("meta")` to skip the init (as loader.load_model does). Gemma 3 configs
    (``config.gemma``) build ``gemma.GemmaForCausalLM``.
    """
    if config.gemma is not None:
        from fnvllm.model.gemma import GemmaForCausalLM  # it imports this module's Attention

        return GemmaForCausalLM(config, ops, tp)
    return DecoderForCausalLM(config, ops, tp)

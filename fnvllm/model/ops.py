"""The model's small fused operations, chosen once per model: plain torch, torch.compile, or Triton.

Mixture-of-experts layers add two ops: ``route`` (softmax, top-k, renormalise: 5 torch kernels, 1 Triton) and
``fused_moe`` (the routed experts): the per-expert loop below in torch (and under "compile": its data-dependent
shapes do not compile), the fused kernels of ``fnvllm.kernels.fused_moe`` under "triton".

Every decoder layer runs a residual add + RMSNorm twice, a rotary embedding on q and k, a SiLU-and-mul, and
(Qwen3) an RMSNorm per q/k head. In plain torch each is 3-10 tiny kernels; at a decode batch of 256 that is
~30 launches per layer whose cost adds up even inside a CUDA graph. ``ModelOps`` is the value that says which
implementation a model uses; it is fixed when the model is built (no global switch), and every implementation
computes the same function as its torch reference (tests compare them).

The torch references (and their numerics) are in ``fnvllm.kernels.reference``, beside the kernels tested
against them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from fnvllm.env import env_switch
from fnvllm.kernels.reference import (
    add_rmsnorm_ref,
    fused_moe_ref,
    norm_rotary_ref,
    rmsnorm_ref,
    rotary_ref,
    route_ref,
    silu_and_mul_ref,
)


@attrs.frozen
class ModelOps:
    """One implementation of each small op (signatures as the ``*_ref`` functions of this module).

    route / fused_moe: a MoE layer's router choice (``route_ref``) and routed experts (``fused_moe_ref``); the
    references unless an implementation has kernels.
    linear: the decoder layers' projections, ``F.linear(x, weight, bias)``; "triton" sends few-row products (decode
    steps of small batches) to ``fnvllm.kernels.skinny_gemm``.
    norm_rope_store: the attention prologue in one kernel (``store_kv.norm_rope_store``: q/k norms, rotary, the
    K/V store), or None: then the layer runs ``norm_rotary`` on q and k and the backend's ``store_kv``.
    silu_mul_linear: an MLP's SiLU-and-mul and down projection, ``(gate_up, weight, bias) -> y``
    (``skinny_gemm.silu_mul_linear``: one launch at few rows), or None: ``silu_and_mul`` then ``linear``. Used
    only for a down projection in the model's dtype (FP8 weights keep their own GEMM).
    norm_linear: a layer's residual add + RMSNorm and the projection after it, ``(x, residual, norm_weight,
    eps, weight, bias) -> (y, new_residual)`` (``skinny_gemm.norm_linear``: one launch at few rows), or None:
    ``add_rmsnorm`` then ``linear``.
    norm_mlp: a layer's residual add + RMSNorm and its whole gated MLP, ``(x, residual, norm_weight, eps,
    gate_up_weight, gate_up_bias, down_weight, down_bias) -> (y, new_residual)`` (``skinny_gemm.norm_mlp``: the
    SiLU-and-mul in the gate/up projection's epilogue where measured faster, else ``norm_linear`` and
    ``silu_mul_linear``), or None: those two ops. Used only when both projections are in the model's dtype.
    norm_linear_rope_store: a layer's residual add + RMSNorm, qkv projection and attention prologue,
    ``(x, residual, norm_weight, eps, qkv_weight, qkv_bias, *norm_rope_store's arguments after qkv) -> (q,
    new_residual)`` (``skinny_gemm.norm_linear_rope_store``: the prologue in the projection's epilogue at few rows),
    or None: ``norm_linear`` then ``norm_rope_store``. Used only for a qkv projection in the model's dtype.
    fp8_producers: the norms and SiLU-and-mul that write an FP8 projection's input quantized, for few-token steps
    (``fp8_gemm.Fp8Producers``; FNVLLM_FP8_FUSED_QUANT, on by default), or None: the projection quantizes its input.
    embed_rope: the step's embedding rows and rotary-table rows in one launch, ``(weight, ids, cos_sin, positions)
    -> (hidden, cos, sin)`` (``fnvllm.kernels.embed.embed_rope``), or None: two torch gathers. Used only when the
    embedding is not split over ranks.
    linear_partials: o_proj's and down_proj's product when a residual add + RMSNorm follows it, ``(x, weight, None)
    -> y or SplitPartials`` (``skinny_gemm.linear_partials``: a K-split skinny product's float32 partials left for
    that norm to sum), or None: ``linear``; also qkv's when the attention prologue is ``norm_rope_store``, which
    sums them. Its ops' add_rmsnorm, norm_linear, norm_mlp, norm_rope_store and norm_linear_rope_store take split
    partials as x, and its norm_linear / norm_mlp / silu_mul_linear a ``keep_partials`` flag. Used without a bias,
    for projections in the model's dtype, and for o_proj / down_proj in one process only (no all-reduce).
    """

    name: str
    rmsnorm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rmsnorm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    norm_rotary: Callable[[torch.Tensor, torch.Tensor | None, float, torch.Tensor, torch.Tensor], torch.Tensor]
    fused_moe: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
        fused_moe_ref
    )
    route: Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]] = route_ref
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear
    norm_rope_store: Callable[..., torch.Tensor] | None = None
    silu_mul_linear: Callable[..., Any] | None = None  # -> torch.Tensor, or SplitPartials with keep_partials
    norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    norm_mlp: Callable[..., tuple[Any, torch.Tensor]] | None = None  # (y or its SplitPartials, new residual)
    norm_linear_rope_store: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    fp8_producers: Any = None  # fp8_gemm.Fp8Producers (imports Triton) or None
    embed_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    linear_partials: Callable[..., Any] | None = None


TORCH_OPS = ModelOps("torch", rmsnorm_ref, add_rmsnorm_ref, rotary_ref, silu_and_mul_ref, norm_rotary_ref)


def compiled_ops() -> ModelOps:
    """The reference ops through ``torch.compile`` (each becomes one or two generated kernels)."""

    def compile_(fn: Callable[..., object]) -> Callable[..., object]:
        return torch.compile(fn, dynamic=True, fullgraph=True)

    return ModelOps(
        "compile",
        compile_(rmsnorm_ref),  # type: ignore[arg-type]
        compile_(add_rmsnorm_ref),  # type: ignore[arg-type]
        compile_(rotary_ref),  # type: ignore[arg-type]
        compile_(silu_and_mul_ref),  # type: ignore[arg-type]
        compile_(norm_rotary_ref),  # type: ignore[arg-type]
    )


# Projections with their prologue fused (``norm_linear``, ``silu_mul_linear``): on by default, each shape fused
# only where ``skinny_gemm.FUSED_TIMES`` measured it faster (one row on the H200; the whole Qwen3-0.6B decode step
# at one request 870 -> 832 us, benchmarks/sweep_small.py part 4); FNVLLM_FUSED_PROLOGUES=0 turns them off.
FUSED_PROLOGUES_ENV = "FNVLLM_FUSED_PROLOGUES"
# The attention prologue (q/k norms, rotary, K/V store) in the qkv projection's epilogue at <= 16 rows
# (``skinny_gemm.norm_linear_rope_store``): off by default, the whole Qwen3-0.6B decode step measured slower with it
# on the H200 (B = 1: 820 against 769 us; see skinny_gemm.QKV_EPILOGUE_ENV); FNVLLM_QKV_EPILOGUE=1 turns it on.
QKV_EPILOGUE_ENV = "FNVLLM_QKV_EPILOGUE"
# o_proj and down_proj at few rows leave their K splits' float32 partials for the residual add + RMSNorm after them
# to sum (``skinny_gemm.linear_partials``): on by default (BENCHMARKS.md, eleventh session); FNVLLM_SPLIT_PARTIALS=0
# sums them in the projection's kernel.
SPLIT_PARTIALS_ENV = "FNVLLM_SPLIT_PARTIALS"
# The embedding and rotary-table gathers in one Triton launch (``fnvllm.kernels.embed``): on by default;
# FNVLLM_FUSED_EMBED=0 turns it off (two torch indexing kernels).
FUSED_EMBED_ENV = "FNVLLM_FUSED_EMBED"


def triton_ops(
    fused_prologues: bool | None = None,
    qkv_epilogue: bool | None = None,
    fp8_fused_quant: bool | None = None,
    split_partials: bool | None = None,
) -> ModelOps:
    """Our Triton kernels (``fnvllm.kernels.fused_ops``); ImportError when Triton is missing.

    fused_prologues: run each residual add + RMSNorm inside the qkv / gate-up projection and SiLU-and-mul inside
    down_proj, or in gate-up's epilogue, at few rows (``norm_linear``, ``silu_mul_linear``, ``norm_mlp``, where
    measured faster); None reads FNVLLM_FUSED_PROLOGUES (default on).
    qkv_epilogue: run the attention prologue in the qkv projection's epilogue at few rows
    (``norm_linear_rope_store``; only with fused_prologues); None reads FNVLLM_QKV_EPILOGUE (default off).
    fp8_fused_quant: FP8 projections' inputs quantized by the kernels that write them at few tokens
    (``fp8_producers``); None reads FNVLLM_FP8_FUSED_QUANT (default on).
    split_partials: o_proj / down_proj leave K-split partials for the norm after them (``linear_partials``); None
    reads FNVLLM_SPLIT_PARTIALS (default on).
    """
    from fnvllm.kernels import embed, fp8_gemm, fused_moe, fused_ops, moe_route, skinny_gemm, store_kv

    if fused_prologues is None:
        fused_prologues = env_switch(FUSED_PROLOGUES_ENV, True)
    if qkv_epilogue is None:
        qkv_epilogue = env_switch(QKV_EPILOGUE_ENV, False)
    if fp8_fused_quant is None:
        fp8_fused_quant = fp8_gemm.fused_quant_from_env()
    if split_partials is None:
        split_partials = env_switch(SPLIT_PARTIALS_ENV, True)
    return ModelOps(
        "triton",
        fused_ops.rmsnorm,
        fused_ops.fused_add_rmsnorm,
        fused_ops.rotary,
        fused_ops.silu_and_mul,
        fused_ops.norm_rotary,
        fused_moe.fused_moe,
        moe_route.route,
        skinny_gemm.linear,
        store_kv.norm_rope_store,
        skinny_gemm.silu_mul_linear if fused_prologues else None,
        skinny_gemm.norm_linear if fused_prologues else None,
        skinny_gemm.norm_mlp if fused_prologues else None,
        skinny_gemm.norm_linear_rope_store if fused_prologues and qkv_epilogue else None,
        fp8_producers=fp8_gemm.fp8_producers() if fp8_fused_quant else None,
        embed_rope=embed.embed_rope if env_switch(FUSED_EMBED_ENV, True) else None,
        linear_partials=skinny_gemm.linear_partials if split_partials else None,
    )


def ops_for(name: str) -> ModelOps:
    """The ops called ``name``: "torch", "compile" or "triton"."""
    makers = {"torch": lambda: TORCH_OPS, "compile": compiled_ops, "triton": triton_ops}
    if name not in makers:
        raise ValueError(f"model ops {name!r} are unknown; choose one of {tuple(makers)}")
    return makers[name]()

"""A MoE router's softmax, top-k and renormalisation in one Triton kernel, beside ``route_ref`` (model/ops.py).

In torch the router's choice is five kernels (softmax, topk, sum, divide, cast) per layer and step; at 48 layers
in a decode CUDA graph that is ~240 launches a step. Here one program per token loads its E logits, takes the
float32 softmax, picks the top k by k rounds of argmax (best first, ties to the lower expert id), renormalises
when asked and stores the weights in the logits' dtype. Worked example, logits [0, ln 3, ln 2, 0], k=2:
probs [1/7, 3/7, 2/7, 1/7] -> ids [1, 2], weights [3/7, 2/7] -> normalised [0.6, 0.4].

Triton's exp is an approximation within a few float32 ulps of torch's, so weights agree to ~1e-6 and ids agree
unless two probabilities are that close.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.reference import route_ref

__all__ = ["route", "route_ref"]


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    """Top-k softmax weights and expert ids of token program_id(0)."""
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_POW2)
    x = tl.load(logits_ptr + t * stride_logits + experts, mask=experts < num_experts, other=-float("inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(experts < num_experts, p, -1.0)  # probabilities not yet picked; -1 = never pickable
    slots = tl.arange(0, K_POW2)
    weights = tl.zeros((K_POW2,), dtype=tl.float32)
    ids = tl.zeros((K_POW2,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0)
        weights = tl.where(slots == k, tl.max(left, axis=0), weights)
        ids = tl.where(slots == k, best, ids)
        left = tl.where(experts == best, -1.0, left)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, weights.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_ref`` in one kernel: (weights in the logits' dtype, int64 expert ids), both (T, top_k)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (T, E) and contiguous in E; got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
            K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(num_experts), NORMALIZE=normalize,
        )  # fmt: skip
    return weights, ids

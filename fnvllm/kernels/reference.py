"""The torch references of the model's small fused ops (RMSNorm, add + RMSNorm, rotary, q/k norm + rotary,
SiLU-and-mul, MoE routing and the routed experts): the definition each Triton kernel in this package is tested
against, and the CPU implementation ``fnvllm.model.ops`` uses. They live with the kernels so that a kernel
module and its reference sit in one package and the model imports the kernels, never the other way round.

Numerics follow Hugging Face's Llama/Qwen code: RMSNorm normalises in float32 and casts back before the weight;
the residual add happens in the activation dtype; the rotation is done in float32 (neox style: the two halves of
each head pair up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) over the last dim (float32 statistics); same shape and dtype as x."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual-stream update fused with the next norm."""
    residual = x + residual
    return rmsnorm_ref(residual, weight, eps), residual


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) by per-token angles (cos/sin (T, D/2) float32), neox style, in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (T, H, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def norm_rotary_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head RMSNorm of x (T, H, D) by weight (D,) (skipped when None), then the rotation: Qwen3's q/k path."""
    return rotary_ref(x if weight is None else rmsnorm_ref(x, weight, eps), cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] (T, 2I); returns (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def route_ref(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router's choice for logits (T, E): (weights, expert ids), both (T, top_k), best first. Softmax in
    float32, top-k, renormalised to sum 1 when ``normalize``, weights rounded to the logits' dtype (as HF's
    Qwen3MoeTopKRouter)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, K)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts layer, one expert at a time (as Hugging Face's loop).

    x (T, H); w_gate_up (E, 2I, H) = [gate rows | up rows] of every expert; w_down (E, H, I); topk_weights and
    topk_ids (T, K): token t goes to experts topk_ids[t] with weights topk_weights[t]. Returns (T, H) in x's dtype:
    out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]) with e = topk_ids[t, k], summed
    in float32. Experts no token chose cost nothing (only the chosen ones are visited). Visiting only those
    needs the host, so inside a CUDA-graph capture (model_ops "torch" on a GPU) every expert runs on every
    token instead (``fused_moe_all_experts_ref``: the same sums in the same expert order, plus exact zeros).

    FP8 weights: w_gate_up and w_down in e4m3 with their float32 block scales w_gate_up_scale (E, ceil(2I / 128),
    ceil(H / 128)) and w_down_scale (E, ceil(H / 128), ceil(I / 128)); each expert's weights are dequantized to x's
    dtype (``dequantize_fp8_blocks``) when it is visited, then the same math.
    """
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return fused_moe_all_experts_ref(
            x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale
        )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, H)
    for expert in torch.unique(topk_ids).tolist():
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)  # token and top-k slot of each assignment
        gate_up, down = _expert_weights(expert, w_gate_up, w_down, w_gate_up_scale, w_down_scale, x.dtype)
        act = silu_and_mul_ref(F.linear(x[rows], gate_up))  # (n, I)
        y = F.linear(act, down).float() * topk_weights[rows, slots, None].float()  # (n, H)
        out.index_add_(0, rows, y)
    return out.to(x.dtype)


def fused_moe_all_experts_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe_ref`` without host syncs: every expert on every token, weighted by 0 where it was not chosen
    (E times the work; capturable in a CUDA graph)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, H)
    for expert in range(w_gate_up.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=-1)  # (T,), 0 when not chosen
        gate_up, down = _expert_weights(expert, w_gate_up, w_down, w_gate_up_scale, w_down_scale, x.dtype)
        y = F.linear(silu_and_mul_ref(F.linear(x, gate_up)), down)  # (T, H)
        out += y.float() * weight[:, None]
    return out.to(x.dtype)


def _expert_weights(
    expert: int,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s (gate_up (2I, H), down (H, I)): as stored, or dequantized to ``dtype`` when the weights
    are FP8 (both scales given; one alone is a ValueError)."""
    if w_gate_up_scale is None and w_down_scale is None:
        return w_gate_up[expert], w_down[expert]
    if w_gate_up_scale is None or w_down_scale is None:
        raise ValueError("FP8 experts need both w_gate_up_scale and w_down_scale (or neither, for 16/32-bit weights)")
    return (
        dequantize_fp8_blocks(w_gate_up[expert], w_gate_up_scale[expert], dtype),
        dequantize_fp8_blocks(w_down[expert], w_down_scale[expert], dtype),
    )


# ---- FP8 weights (fnvllm.kernels.fp8_gemm's kernels; fnvllm.model.quant's format) -------------------------------

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_BLOCK = 128  # rows and columns per weight scale (and columns per activation scale)
MIN_SCALE = 1e-12  # the scale of an all-zero block (any positive value gives zeros)


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) float32: each block scale repeated over the 128 x 128 block it covers (edge blocks cut)."""
    full = scale.repeat_interleave(SCALE_BLOCK, dim=0).repeat_interleave(SCALE_BLOCK, dim=1)
    return full[:rows, :cols]


def dequantize_fp8_blocks(w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The real weight (N, K) in ``dtype``: w (N, K) fp8 times its block scales, in float32, then cast."""
    n, k = w.shape
    return (w.float() * expand_block_scales(w_scale.float(), n, k)).to(dtype)


def fp8_linear_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ dequantized(w).T (+ bias): the weight dequantized to x's dtype, then F.linear (CPU path)."""
    return F.linear(x, dequantize_fp8_blocks(w, w_scale, x.dtype), bias)


def split_partials_sum_ref(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (T, N) output of a projection's float32 split partials parts (S, T, N): summed in split order from the
    first, rounded once to dtype (as the skinny GEMM sums them when it keeps no partials, and as
    ``fused_ops.fused_add_rmsnorm`` sums them into the residual add)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.to(dtype)

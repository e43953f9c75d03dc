"""The sparse mixture-of-experts block of Qwen3-MoE, Mixtral and Qwen2-MoE: a router, the routed experts and
(Qwen2-MoE) a shared expert.

    logits = x @ gate.T                       (T, E)  replicated on every rank
    probs  = softmax(logits) in float32       top-k of them per token, renormalised to sum 1 if norm_topk_prob
                                              (``ops.route``)
    out    = sum_k w_k * expert_{e_k}(x)      by ``ops.fused_moe`` over the stacked expert weights
    out   += sigmoid(x @ shared_expert_gate.T) * shared_expert(x)     Qwen2-MoE only: (T, 1) * (T, H)

As Hugging Face's Qwen3MoeTopKRouter, the top-k weights are rounded to the activation dtype before use. Mixtral is
the same block with ``norm_topk_prob`` always on (``MoeConfig.from_mixtral``): HF's MixtralTopKRouter takes the same
float32 softmax, top-k and renormalisation, but keeps the weights in float32 and multiplies each expert's output by
them before rounding: equal in float32; in bf16 the weights' rounding (<= 2^-9 relative) is of the size of the
ulp-level differences the fused kernel's float32 sum already has from HF's per-expert rounding (docs/moe.md). Under
tensor parallelism every rank holds every expert's slice of the intermediate dim (``sharding.ParallelExperts``),
so the routed sum is a partial one and the block all-reduces it, as the dense MLP does.

FP8 weights (an FP8 checkpoint, or ``quantization="fp8"``): the experts are stored in e4m3 with 128 x 128 block
scales (``sharding.ParallelExperts``) and the fused-MoE op takes the scales (``w_gate_up_scale``, ``w_down_scale``):
the Triton kernels dequantize weight tiles in registers and keep the activations in the model dtype (weight-only
FP8, half the expert bytes a decode step reads), the torch reference dequantizes each visited expert. The router
and Qwen2-MoE's shared_expert_gate stay in the model dtype (official FP8 checkpoints leave ``mlp.gate`` unquantized);
the shared expert is a dense MLP and takes the dense FP8 linears.

Qwen2-MoE's shared expert is a dense SwiGLU ``models.MLP`` of ``shared_expert_intermediate_size`` that every token
goes through, built by the caller (``models.DecoderLayer.feed_forward``: models.py imports this module) with
``reduce_results=False``: it splits over the ranks like any MLP and hands back this rank's partial sum. Its gate
(hidden -> 1, no bias) is replicated: it reads the full hidden state every rank holds, so each rank scales its partial
by the same sigmoid, and sum_r s * p_r = s * sum_r p_r: the scaled partial joins the experts' before the block's one
all-reduce. The order of HF's Qwen2MoeSparseMoeBlock (experts + sigmoid(gate) * shared, each product in the
activation dtype) is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fnvllm.model.config import ModelConfig
from fnvllm.model.ops import TORCH_OPS, ModelOps
from fnvllm.model.sharding import SINGLE, ParallelExperts, TensorParallel, all_reduce

if TYPE_CHECKING:  # models.py imports this module
    from fnvllm.model.models import MLP


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and experts (``experts``) of one Qwen3-MoE, Mixtral or Qwen2-MoE layer (HF's ``mlp.``
    names; the loader maps Mixtral's ``block_sparse_moe.`` ones), and Qwen2-MoE's ``shared_expert`` with its
    ``shared_expert_gate`` (both None without one).

    shared_expert: an MLP built with ``reduce_results=False`` (this rank's partial sum; see the module docstring),
    or None.
    """

    shared_expert_gate: nn.Linear | None

    def __init__(
        self,
        config: ModelConfig,
        ops: ModelOps = TORCH_OPS,
        tp: TensorParallel = SINGLE,
        shared_expert: MLP | None = None,
    ) -> None:
        super().__init__()
        if config.moe is None:
            raise ValueError(f"SparseMoeBlock needs a config with moe (architecture {config.architecture})")
        self.ops = ops
        self.tp = tp
        self.top_k = config.moe.num_experts_per_tok
        self.normalize = config.moe.norm_topk_prob
        dtype = config.torch_dtype
        self.gate = nn.Linear(config.hidden_size, config.moe.num_experts, bias=False, dtype=dtype)
        self.experts = ParallelExperts(
            config.moe.num_experts, config.hidden_size, config.moe.moe_intermediate_size, dtype, tp, config.quantization
        )
        if shared_expert is not None and shared_expert.reduce_results:
            raise ValueError("the shared expert must leave its partial sum to the block (reduce_results=False)")
        self.shared_expert = shared_expert
        has_gate = shared_expert is not None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False, dtype=dtype) if has_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden_size) -> (T, hidden_size)."""
        weights, ids = self.ops.route(F.linear(x, self.gate.weight), self.top_k, self.normalize)  # (T, K) each
        experts = self.experts
        partial = self.ops.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, **experts.fp8_scales())
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))  # (T, 1), equal on every rank
            partial = partial + scale * self.shared_expert(x)  # this rank's partial of the shared expert, scaled
        return all_reduce(partial, self.tp)


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Experts a layer is expected to read for ``num_tokens`` tokens routed uniformly at random, top_k each:
    E * (1 - (1 - k/E)^n). Qwen3-30B-A3B (E 128, k 8): 1 token 8, 16 tokens 82, 64 tokens 126, 256 all 128."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)

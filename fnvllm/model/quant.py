"""FP8 weights: the block format, quantizing to it, and turning a linear layer into an FP8 one.

Format (the official one of DeepSeek-V3 and Qwen3-*-FP8 checkpoints): a linear's weight (N, K) is stored in
float8_e4m3fn with a float32 ``weight_scale_inv`` of shape (ceil(N / 128), ceil(K / 128)); the real weight is
``weight * weight_scale_inv`` broadcast over each 128 x 128 block (the name is historical: it multiplies).
``quantize_fp8_blocks`` makes that layout from a 16/32-bit weight: each block's scale is its amax / 448, the
largest e4m3 value, so no value saturates. The same layout serves both ways in (an FP8 checkpoint, or
``quantization="fp8"`` on a bf16 one), so one set of GEMM kernels (``fnvllm.kernels.fp8_gemm``) serves both.

Row groups (``quantization="fp8"`` on a 16/32-bit checkpoint, ``quantize_fp8_row_groups``): every 128-row block
takes one scale, the amax of its whole row block (all K columns) / 448, stored in the same block layout (so the
(ceil(N / 128), ceil(K / 128)) scales have equal columns and every block kernel reads them unchanged). Such a
weight's real value is also ``weight * row_scale`` with one scale per output row, so the linear carries that
(1, N) float32 ``weight_row_scale`` (``row_scales``) too, and large products run torch's row-wise FP8 GEMM
(per-token activation scales times per-column weight scales, ``fp8_gemm.fp8_rowwise_mm``), which on the H200 runs
near the per-tensor FP8 speed where the 128 x 128 block-scaled one does not. Official checkpoints keep their
stored block scales and no row scale. Worked example, N = 300: row blocks 0:128, 128:256 and 256:300 have scales
s0, s1, s2; ``weight_scale_inv`` is [[s0, s0, ...], [s1, s1, ...], [s2, s2, ...]] and the row scale is s0 repeated
128 times, s1 128 times, then s2 44 times. Under tensor parallelism a column-parallel rank holds whole rows (its
parts start on 128-row blocks), so its row groups are one process's; a row-parallel rank holds a column slice of
every row, and the loader joins the ranks' row-block amaxes by a max (``sharding.max_over_ranks``) so each rank's
scales are still those of the whole rows: the same weights as at tensor_parallel_size=1.

Which layers: every linear of the decoder layers (q/k/v, o, gate/up, down); embeddings, norms and the LM head keep
the model dtype. A fused layer (qkv, gate_up) holds its parts' rows one after another, so a part's first row must
start a scale block (``check_block_aligned``); under tensor parallelism a rank's slice of a checkpoint's FP8
tensor must start on a block too, so that its scales are whole rows (or columns) of the stored scales. Real models
(head_dim 128, widths multiples of 128) always are.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fnvllm.kernels.reference import FP8_DTYPE, FP8_MAX, MIN_SCALE, SCALE_BLOCK, dequantize_fp8_blocks, fp8_linear_ref

if TYPE_CHECKING:  # Triton's module: imported only where the kernels run
    from fnvllm.kernels.fused_ops import Fp8Activations

__all__ = [
    "FP8_DTYPE",
    "SCALE_BLOCK",
    "check_block_aligned",
    "dequantize_fp8_blocks",
    "linear_forward",
    "make_fp8",
    "quantize_fp8_blocks",
    "quantize_fp8_row_groups",
    "row_group_amax",
    "row_scales",
    "scale_blocks",
    "set_row_scales",
]


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (N, K) in e4m3, scale (ceil(N / 128), ceil(K / 128)) float32) with weight ~= q * scale per block."""
    n, k = weight.shape
    nb, kb = math.ceil(n / SCALE_BLOCK), math.ceil(k / SCALE_BLOCK)
    padded = F.pad(weight.float(), (0, kb * SCALE_BLOCK - k, 0, nb * SCALE_BLOCK - n))
    blocks = padded.view(nb, SCALE_BLOCK, kb, SCALE_BLOCK)  # (row block, row, column block, column)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)  # (nb, kb)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * SCALE_BLOCK, kb * SCALE_BLOCK)[:n, :k].contiguous(), scale


def row_group_amax(weight: torch.Tensor) -> torch.Tensor:
    """(ceil(N / 128),) float32: the largest |value| of each 128-row block of weight (N, K), over all K."""
    n, k = weight.shape
    nb = math.ceil(n / SCALE_BLOCK)
    rows = F.pad(weight.float(), (0, 0, 0, nb * SCALE_BLOCK - n)).view(nb, SCALE_BLOCK * k)  # (row block, values)
    return rows.abs().amax(dim=1)


def quantize_fp8_row_groups(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (N, K) in e4m3, scale (ceil(N / 128), ceil(K / 128)) float32) in the block layout, every 128-row
    block's scales equal: the block's amax / 448 (see the module docstring). amax: the row blocks' amaxes to use
    (``row_group_amax`` of the whole rows when weight is a column slice of them; None: weight's own)."""
    n, k = weight.shape
    nb, kb = math.ceil(n / SCALE_BLOCK), math.ceil(k / SCALE_BLOCK)
    amax = row_group_amax(weight) if amax is None else amax
    if tuple(amax.shape) != (nb,):
        raise ValueError(f"amax must have one value per 128-row block ({nb},), got {tuple(amax.shape)}")
    group = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)  # (nb,)
    rows = F.pad(weight.float(), (0, 0, 0, nb * SCALE_BLOCK - n)).view(nb, SCALE_BLOCK, k)  # (row block, row, col)
    q = (rows / group[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * SCALE_BLOCK, k)[:n].contiguous(), group[:, None].expand(nb, kb).contiguous()


def row_scales(weight_scale: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The (1, num_rows) float32 per-row scale of row-group scales (ceil(N / 128), K blocks): each block row's first
    scale repeated over its 128 rows (the last block cut to num_rows)."""
    return weight_scale[:, 0].float().repeat_interleave(SCALE_BLOCK)[None, :num_rows].contiguous()


def set_row_scales(model: nn.Module) -> None:
    """Fill every FP8 linear's ``weight_row_scale`` buffer (where it has one: weights quantized at load) from its
    ``weight_scale_inv``, after the loader has written those."""
    for module in model.modules():
        row_scale = getattr(module, "weight_row_scale", None)
        if row_scale is not None:
            row_scale.copy_(row_scales(module.weight_scale_inv, row_scale.shape[1]))


def scale_blocks(start: int, end: int) -> tuple[int, int]:
    """The scale blocks (first, end) that cover elements start:end (start on a block boundary)."""
    return start // SCALE_BLOCK, math.ceil(end / SCALE_BLOCK)


def check_block_aligned(what: str, start: int, end: int, full: int) -> None:
    """ValueError naming ``what`` unless start:end of ``full`` begins on a 128 boundary and is whole blocks or
    runs to the end (where the last, partial block is)."""
    if start % SCALE_BLOCK or ((end - start) % SCALE_BLOCK and end != full):
        raise ValueError(
            f"FP8 weights: {what} covers {start}:{end} of {full}, which does not fall on {SCALE_BLOCK}-wide scale "
            f"blocks (start on a multiple of {SCALE_BLOCK}, whole blocks unless it ends at {full}); choose a "
            "tensor_parallel_size that keeps shards on 128 multiples, or leave quantization off"
        )


def make_fp8(linear: nn.Linear, row_groups: bool) -> None:
    """Turn ``linear`` (built with a 16/32-bit weight) into an FP8 one in place: an e4m3 ``weight`` of the same
    shape and a float32 ``weight_scale_inv`` of its blocks (uninitialised: the loader fills both); with
    ``row_groups`` (quantized at load) also a (1, N) float32 ``weight_row_scale`` buffer (not saved in a state
    dict; ``set_row_scales`` fills it), else that buffer is None."""
    n, k = linear.weight.shape
    device = linear.weight.device
    linear.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
    blocks = (math.ceil(n / SCALE_BLOCK), math.ceil(k / SCALE_BLOCK))
    linear.weight_scale_inv = nn.Parameter(torch.empty(blocks, dtype=torch.float32, device=device), requires_grad=False)
    row_scale = torch.empty(1, n, dtype=torch.float32, device=device) if row_groups else None
    linear.register_buffer("weight_row_scale", row_scale, persistent=False)


def linear_forward(
    x: torch.Tensor | Fp8Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias): through the FP8 GEMMs when the weight has block scales (e4m3), else F.linear;
    ``row_scale`` (row-group weights) lets large products take the row-wise GEMM. On a CPU the FP8 reference
    (dequantize, then F.linear); the Triton/cuBLAS paths are imported on first GPU use, so the runtime dependencies
    (no Triton on a CPU-only install) suffice to load an FP8 model. x may be activations already quantized by
    the kernel that made them (``fused_ops.Fp8Activations``, only for an FP8 weight): they go straight to the
    GEMM (``fp8_gemm.fp8_linear``)."""
    if not isinstance(x, torch.Tensor):  # Fp8Activations: made by the Triton producers, so Triton is here
        from fnvllm.kernels.fp8_gemm import fp8_linear

        if weight_scale is None:
            raise ValueError("quantized activations (Fp8Activations) need an FP8 weight with its weight_scale_inv")
        return fp8_linear(x, weight, weight_scale, bias, row_scale=row_scale)
    if weight_scale is None:
        return F.linear(x, weight, bias)
    if not x.is_cuda:
        return fp8_linear_ref(x, weight, weight_scale, bias)
    from fnvllm.kernels.fp8_gemm import fp8_linear

    return fp8_linear(x, weight, weight_scale, bias, row_scale=row_scale)

"""The step's two row gathers in one launch: token embeddings and the rotary table's rows, beside the reference.

A forward pass starts with two gathers: the embedding rows of its token ids, ``weight[ids]`` (T, H), and the rotary
table's rows of its positions, ``cos_sin[positions]`` (T, D) float32 (then split into cos and sin). In torch that is
two indexing kernels; on the H200 at one decode row each took 3.7 us (torch's elementwise index kernel: 7.4 us of
a ~800 us step, BENCHMARKS.md), against ~2 us for a launch that copies a few kilobytes. ``embed_rope`` does both in
one Triton launch: program t reads ids[t] and positions[t], then copies the two rows.

Worked example: ids (5, 2), positions (7, 8), an embedding (V, 4) and a table (P, 2): hidden = (weight[5],
weight[2]) (2, 4); the table rows (cs[7], cs[8]) (2, 2) split into cos = column 0 and sin = column 1.

Ids and positions are trusted (the engine checks prompts against the vocabulary and positions against
max_model_len); a program whose id or position lies outside its table writes zeros rather than read past it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.fused_ops import pdl_launch, use_pdl, wait_for_previous_kernel

__all__ = ["embed_rope", "embed_rope_ref"]


def embed_rope_ref(
    weight: torch.Tensor, ids: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: (weight[ids] (T, H), cos (T, D/2), sin (T, D/2)) with cos, sin the halves of
    cos_sin[positions] (float32 (T, D) -> two column views)."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    return weight[ids], cos, sin


@triton.jit
def _embed_rope_kernel(
    weight_ptr,  # (V, H) the embedding, rows contiguous
    ids_ptr,  # (T,) token ids
    table_ptr,  # (P, D) float32 rotary table [cos | sin]
    positions_ptr,  # (T,) positions
    hidden_ptr,  # (T, H) out
    rows_ptr,  # (T, D) float32 out
    stride_w,
    vocab_size,
    num_positions,
    hidden_size,
    table_width,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Copy row ids[t] of the embedding and row positions[t] of the table for token t = program_id(0)."""
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(USE_PDL)  # the ids may be the previous step's samples, copied just before
    tok = tl.load(ids_ptr + t).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    readable = tl.where((tok >= 0) & (tok < vocab_size), hidden_size, 0)  # columns to read: none for a stray id
    row = tl.load(weight_ptr + tok * stride_w + h, mask=h < readable, other=0.0)
    tl.store(hidden_ptr + t * hidden_size + h, row, mask=h < hidden_size)
    d = tl.arange(0, BLOCK_D)
    placed = tl.where((pos >= 0) & (pos < num_positions), table_width, 0)
    angles = tl.load(table_ptr + pos * table_width + d, mask=d < placed, other=0.0)
    tl.store(rows_ptr + t * table_width + d, angles, mask=d < table_width)


def embed_rope(
    weight: torch.Tensor, ids: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``embed_rope_ref`` in one launch: (hidden (T, H) in weight's dtype, cos (T, D/2), sin (T, D/2) float32
    views of one (T, D) buffer). weight (V, H) with contiguous rows; ids, positions (T,) integer; cos_sin (P, D)
    contiguous float32."""
    _check_embed_rope_args(weight, ids, cos_sin, positions)
    num_tokens, hidden_size = ids.shape[0], weight.shape[1]
    width = cos_sin.shape[1]
    hidden = torch.empty(num_tokens, hidden_size, dtype=weight.dtype, device=weight.device)
    rows = torch.empty(num_tokens, width, dtype=torch.float32, device=weight.device)
    if num_tokens:
        block_h = triton.next_power_of_2(hidden_size)
        _embed_rope_kernel[(num_tokens,)](
            weight, ids, cos_sin, positions, hidden, rows, weight.stride(0), weight.shape[0], cos_sin.shape[0],
            hidden_size, width,
            BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(width), USE_PDL=use_pdl(weight.device),
            num_warps=4 if block_h <= 2048 else 8, **pdl_launch(weight.device),
        )  # fmt: skip
    cos, sin = rows.chunk(2, dim=-1)
    return hidden, cos, sin


def _check_embed_rope_args(
    weight: torch.Tensor, ids: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """ValueError naming the argument whose shape, dtype, layout or device does not fit."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a (V, H) tensor with contiguous rows, got {tuple(weight.shape)}")
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] % 2:
        raise ValueError(
            f"cos_sin must be a contiguous float32 (P, D) table with D even, got {tuple(cos_sin.shape)} {cos_sin.dtype}"
        )
    for name, t in (("ids", ids), ("positions", positions)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a (T,) int32 or int64 tensor, got {tuple(t.shape)} {t.dtype}")
    if positions.shape != ids.shape:
        raise ValueError(f"positions {tuple(positions.shape)} must match ids {tuple(ids.shape)}")
    devices = {weight.device, ids.device, cos_sin.device, positions.device}
    if len(devices) != 1:
        raise ValueError(f"weight, ids, cos_sin and positions must share one device, got {sorted(map(str, devices))}")

"""Linear layers for few tokens (decode steps of small batches): a Triton GEMM that streams the weight at bandwidth,
with the small ops around a projection folded into its load and its reduce.

At M <= 64 rows a linear layer is a read of its weight: y (M, N) = x (M, K) @ W (N, K)^T touches 2*N*K bytes of W
and next to nothing else. On the H200 every such launch, cuBLAS's or ours, costs ~5 us for 4 to 12 MB of weights
(a latency floor: launch, the first DRAM round trip, the drain), so at one request what pays is fewer launches:
the residual add + RMSNorm before qkv and gate/up, and the SiLU-and-mul before down_proj, run inside the GEMM's
load, and split-K partials are summed inside the GEMM. Under programmatic dependent launch a program may read its
weight tile before the previous kernel has finished (``preload``: weights are never written by a kernel), so
the DRAM round trip overlaps that kernel and only x is read after the wait: one-row GEMVs of one 1-2K-wide tile
per program (CUDA cores, rows unpadded) then take 2.6-5.7 us against cuBLAS's 4.9-12.6 (``TUNED_CONFIGS``).

Algorithm: one program per (block of BLOCK_N output features, split s of K). It walks its K range in BLOCK_K
steps, loading a (BLOCK_N, BLOCK_K) tile of W (contiguous rows of the nn.Linear layout) and the matching
(BLOCK_M, BLOCK_K) slice of x (BLOCK_M = M padded to 16, at least, for tl.dot; or unpadded on CUDA cores; x is
tiny and stays in L2), and accumulates x @ W_tile^T in float32. With one split the program writes y directly (plus
the bias); with several, each writes its float32 partial to a workspace and counts itself in on an arrival
counter of its column block; the last to arrive sums the SPLIT_K partials in split order (deterministic, unlike
atomic adds), adds the bias, rounds and resets the counter (``fused_reduce``; or a second kernel does the sum).
Input prologues: ``glu`` (x = [gate | up], input silu(gate) * up) and ``norm`` (input rmsnorm(x + residual), each
program computing the rows' statistics over all of K first, program (0, 0) writing the new residual stream).
Epilogue ``QkvEpilogue`` (a qkv projection, one K split): the last program to finish a head's columns (an arrival
counter per head) runs the attention prologue for that head (q/k norm, rotary, q out, K / V into the caches), so
``norm_linear_rope_store`` spares the layer its ``store_kv.norm_rope_store`` launch at <= 16 rows.

Worked example (Qwen3-0.6B, M = 16): o_proj N = 1024, K = 2048 -> BLOCK_N 32 gives 32 column blocks, SPLIT_K 4
gives 128 programs, each streaming 32 rows x 512 columns = 32 KiB of W; the fourth of a block to finish sums.

Model-facing dispatchers (their references: ``F.linear``, the same after ``silu_and_mul`` / ``fused_add_rmsnorm``):
``linear(x, weight, bias)``, ``silu_mul_linear(gate_up, weight, bias)`` and ``norm_linear(x, residual, norm_weight,
eps, weight, bias)`` send, on a GPU, the products ``prefers_skinny`` picks (measured faster than cuBLAS: the
``TUNED_CONFIGS`` entries) or, with a prologue to fuse, ``prefers_fused`` picks (``FUSED_TIMES``), to this kernel,
and everything else to cuBLAS after the unfused ops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fnvllm.env import env_choice, env_switch
from fnvllm.kernels import cuda_skinny
from fnvllm.kernels.attention import kv_layout
from fnvllm.kernels.decode_attention import dot, dot_precision, split_counters, upcast_dot
from fnvllm.kernels.fp8 import is_fp8
from fnvllm.kernels.fused_ops import (
    SplitPartials,
    _sum_splits_kernel,
    fused_add_rmsnorm,
    pdl_launch,
    prefetch_l2,
    rmsnorm,
    silu_and_mul,
    sum_split_partials,
    use_pdl,
    wait_for_previous_kernel,
)
from fnvllm.kernels.store_kv import check_prologue_args, norm_rope_store, prologue_head_rows

__all__ = [
    "FUSED_TIMES",
    "NORM_MAX_ROWS",
    "PARTIALS_CONFIGS",
    "SKINNY_MAX_ROWS",
    "TUNED_CONFIGS",
    "Fused",
    "Norm",
    "QkvEpilogue",
    "SkinnyConfig",
    "Tuned",
    "fused_config",
    "linear",
    "linear_partials",
    "linear_ref",
    "norm_linear",
    "norm_linear_rope_store",
    "norm_mlp",
    "partials_config",
    "prefers_fused",
    "prefers_skinny",
    "rows_bucket",
    "silu_mul_linear",
    "skinny_config",
    "skinny_linear",
    "skinny_partials",
    "split_counters",
    "sum_split_partials",
    "tuned_config",
]

# Rows up to which `linear` uses the skinny kernel (above it, cuBLAS's large-M tiles are the better choice).
SKINNY_MAX_ROWS = 16
# Rows up to which ``norm_linear`` computes the RMSNorm inside the projection (every program reads the rows' full
# width for their statistics, M x K x 4 bytes from L2, so the fused norm stops paying at larger M).
NORM_MAX_ROWS = 16
# Programs the grid aims for: about two per SM on an H200 (132 SMs), so every SM streams two weight tiles at once.
_TARGET_PROGRAMS = 264
_MAX_SPLIT_K = 8


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear`` (x (M, K), weight (N, K), bias (N,) or None -> (M, N))."""
    return F.linear(x, weight, bias)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    res_ptr,  # NORM: the residual stream (M, K) added to x first (when NORM_RES), rows strided like x
    res_out_ptr,  # NORM_RES: where x + residual goes (written by program (0, 0))
    norm_w_ptr,  # NORM: the RMSNorm weight (K,)
    eps,
    q_out_ptr,  # QKV_EPI: q (M, Hq, D) out; the caches, slots, FP8 scales, q/k norm weights, cos / sin (M, D / 2)
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    stride_ct,
    stride_st,
    qk_eps,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    USE_DOT: tl.constexpr,
    GLU: tl.constexpr,
    GLU_OUT: tl.constexpr,
    NORM: tl.constexpr,
    NORM_RES: tl.constexpr,
    NORM_LATE: tl.constexpr,  # NORM: the row scale applied to the accumulator at the end (SPLIT == 1)
    USE_PDL: tl.constexpr,
    PREFETCH_W: tl.constexpr,
    PRELOAD_W: tl.constexpr,
    ONE_TILE: tl.constexpr,  # k_per_split <= BLOCK_K: every program's K range is one tile
    W_LINE: tl.constexpr,  # weight elements per 128-byte cache line
    NORM_BLOCK: tl.constexpr,  # K columns per step of the NORM statistics loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QKV_EPI: tl.constexpr,  # the attention prologue in the epilogue (SPLIT == 1; BLOCK_N divides D)
    EPI_HEADS: tl.constexpr,  # QKV_EPI: Hq, Hkv, D / 2, q/k norms present, FP8 caches
    EPI_KV_HEADS: tl.constexpr,
    EPI_HALF: tl.constexpr,
    EPI_NORM: tl.constexpr,
    EPI_FP8: tl.constexpr,
    EPI_BLOCK_SIZE: tl.constexpr,  # QKV_EPI: the caches' tokens a block, and whether they are head-major ("HND")
    EPI_HEAD_MAJOR: tl.constexpr,
):
    """Columns pid_n*BLOCK_N .. +BLOCK_N of y over K range [pid_k * k_per_split, +k_per_split).

    With SPLIT > 1 the program writes its float32 partial; with FUSED_REDUCE the last of the SPLIT programs of a
    column block to finish (counted by an atomic per block) then sums all SPLIT partials in split order, adds the
    bias, writes y and resets its counter to 0 for the next launch; otherwise ``_sum_splits_kernel`` does that.
    GLU: x is [gate | up] (M, 2K) and the product's input is silu(gate) * up, computed as it is loaded (in float32,
    rounded once to x's dtype, as ``fused_ops.silu_and_mul``): SiLU-and-mul fused into the GEMM's prologue.
    NORM: the product's input is rmsnorm(x (+ residual when NORM_RES)) by norm_w, rounded where
    ``fused_ops.fused_add_rmsnorm`` rounds: every program first computes the rows' statistics over all of K (x is
    a few KiB per row, read from L2), and program (0, 0) stores x + residual, the new residual stream.
    NORM_LATE (with NORM, SPLIT == 1): no statistics pass. RMSNorm is a per-row scale, and a row scale commutes
    with the product: rmsnorm(r) @ W^T = (1 / rms(r)) * ((norm_w * r) @ W^T). So the loop feeds norm_w * r
    (rounded to x's dtype) to the product while it sums r^2 over the columns it loads (all of K, SPLIT being 1),
    and the accumulator rows are scaled by 1 / sqrt(mean(r^2) + eps) before the store; the column-block-0
    programs store x + residual as they load it. One rounding fewer than the unfused ops (which round r / rms(r)
    to x's dtype before the weight multiplies it): equal up to that rounding, not bit for bit.
    PREFETCH_W: before waiting on the previous kernel (programmatic dependent launch), ask for this program's
    whole weight slice to be brought into L2 (prefetch.global.L2, one per 128-byte line), so the weight stream
    overlaps the previous kernel and the loop after the wait reads L2. GPU only (inline PTX).
    PRELOAD_W: load the first (BLOCK_N, BLOCK_K) weight tile into registers before that wait, and each next tile
    one step ahead (a register double buffer): with one tile per program (k_per_split <= BLOCK_K) the program's
    whole weight read overlaps the previous kernel and only x is read after the wait.
    GLU_OUT: W is [gate | up] (N = 2I rows) and the output is silu(x @ gate^T) * (x @ up^T), (M, I): the SiLU-and-mul
    after a gate/up projection fused into its epilogue. Column block pid_n computes gate rows pid_n * BLOCK_N / 2 ..
    and the same up rows (``_glu_cols``), each product rounded to x's dtype before the activation, as the unfused
    projection and ``fused_ops.silu_and_mul`` round.
    QKV_EPI: y is a qkv projection (heads of D = 2 * EPI_HALF columns: Hq q, Hkv k, Hkv v); after storing its
    columns the program counts itself in on its head's arrival counter, and the last of the head's D / BLOCK_N
    programs re-reads the head's rounded outputs (L2) and does ``store_kv.norm_rope_store``'s work for it
    (``prologue_head_rows``: q/k norm, rotary, q written to q_out, K / V stored at the slots), then resets the
    counter to 0 for the next launch: the attention prologue without a launch of its own.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    if GLU_OUT:
        cols, col_ok = _glu_cols(pid_n, N, BLOCK_N)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
    row_ok = rows < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH_W:  # the weight slice streams into L2 while the previous kernel finishes (no kernel writes weights)
        _prefetch_weight_slice(w_ptr, cols, col_ok, stride_wn, k_start, k_end, BLOCK_K, W_LINE)
    w_next = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    if PRELOAD_W:  # weights: no kernel writes them, so they may be read before the wait
        w_next = _weight_tile(w_ptr, cols, col_ok, stride_wn, k_start, k_end, BLOCK_K)
    wait_for_previous_kernel(USE_PDL)
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM_LATE: the rows' sums of squares, over the loop
    if NORM and not NORM_LATE:
        write_res = (pid_n == 0) & (pid_k == 0)
        inv_rms = _rows_inv_rms(
            x_ptr, res_ptr, res_out_ptr, rows, row_ok, stride_xm, K, eps, write_res, NORM_RES, BLOCK_M, NORM_BLOCK
        )
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        if PRELOAD_W:
            w = w_next
            if not ONE_TILE:  # (with one tile per program the next would be all masked: no registers for it)
                w_next = _weight_tile(w_ptr, cols, col_ok, stride_wn, k0 + BLOCK_K, k_end, BLOCK_K)
        else:
            w = _weight_tile(w_ptr, cols, col_ok, stride_wn, k0, k_end, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if GLU:
            gate = x.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            x = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
        if NORM:
            dtype = x_ptr.dtype.element_ty
            if NORM_RES:
                res = tl.load(res_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
                x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
                if NORM_LATE:  # the new residual stream, by the first column block (a mask, not a branch)
                    first_block = (rows < tl.where(pid_n == 0, M, 0))[:, None] & k_ok[None, :]
                    tl.store(res_out_ptr + rows[:, None] * stride_xm + ks[None, :], x, mask=first_block)
            nw = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            if NORM_LATE:
                h = x.to(tl.float32)
                sum_sq += tl.sum(h * h, axis=1)
                x = (nw[None, :] * h).to(dtype)
            else:
                normed = (x.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
                x = (nw[None, :] * normed).to(dtype)
        if USE_DOT:
            acc += dot(x, tl.trans(w), DOT_PRECISION, UPCAST_DOT)
        else:  # CUDA cores: (BLOCK_M, 1, BLOCK_K) * (1, BLOCK_N, BLOCK_K) summed over K
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if NORM and NORM_LATE:
        acc = acc * (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    out_offs = rows[:, None] * stride_om + cols[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        _store_output(out_ptr, acc, rows, row_ok, out_offs, mask, pid_n, N, stride_om, GLU_OUT, BLOCK_M, BLOCK_N)
        if QKV_EPI:
            _qkv_epilogue_if_last(
                out_ptr, stride_om, counter_ptr, pid_n, rows, row_ok, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                k_scale_ptr, v_scale_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, stride_ct, stride_st, qk_eps,
                EPI_HEADS, EPI_KV_HEADS, EPI_HALF, EPI_NORM, EPI_FP8, BLOCK_N, EPI_BLOCK_SIZE, EPI_HEAD_MAJOR,
            )  # fmt: skip
    else:
        part_offs = rows[:, None] * N + cols[None, :]  # (BLOCK_M, BLOCK_N) in one split's (M, N) slab
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=mask)
        if FUSED_REDUCE:
            _sum_partials_if_last(
                part_ptr, bias_ptr, out_ptr, counter_ptr + pid_n, part_offs, out_offs, cols, col_ok, mask, M * N,
                rows, row_ok, pid_n, N, stride_om, HAS_BIAS, SPLIT, GLU_OUT, BLOCK_M, BLOCK_N,
            )  # fmt: skip


@triton.jit
def _qkv_epilogue_if_last(
    out_ptr,
    stride_om,
    counter_ptr,
    pid_n,
    rows,
    row_ok,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    stride_ct,
    stride_st,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    """Count column block pid_n in on its head's counter; the last of the head's programs runs the attention
    prologue for the head over all rows and resets the counter (the barrier orders every thread's output stores
    before the program's one release-acquire atomic, as in ``_sum_partials_if_last``)."""
    head = pid_n // ((2 * HALF) // BLOCK_N)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + head, 1, sem="acq_rel")
    if done == (2 * HALF) // BLOCK_N - 1:
        prologue_head_rows(
            out_ptr, stride_om, rows, row_ok, head, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
            v_scale_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, stride_ct, stride_st, eps, NUM_HEADS, NUM_KV_HEADS,
            HALF, HAS_NORM, KV_FP8, 0, 0, BLOCK_SIZE, HEAD_MAJOR,
        )  # fmt: skip
        tl.atomic_xchg(counter_ptr + head, 0)


@triton.jit
def _glu_cols(pid_n, N, BLOCK_N: tl.constexpr):
    """(BLOCK_N,) weight rows of GLU_OUT column block pid_n and their validity: the first half gate rows
    pid_n * BLOCK_N / 2 + j, the second half the up rows I + pid_n * BLOCK_N / 2 + j (I = N / 2)."""
    j = tl.arange(0, BLOCK_N)
    act_col = pid_n * (BLOCK_N // 2) + j % (BLOCK_N // 2)  # (BLOCK_N,) the activation column each weight row feeds
    cols = tl.where(j < BLOCK_N // 2, act_col, N // 2 + act_col)
    return cols, act_col < N // 2


@triton.jit
def _store_output(
    out_ptr,
    acc,
    rows,
    row_ok,
    out_offs,
    mask,
    pid_n,
    N,
    stride_om,
    GLU_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store the float32 tile acc (BLOCK_M, BLOCK_N) to out: as is at out_offs, or with GLU_OUT its activation
    silu(gate) * up (BLOCK_M, BLOCK_N / 2) at columns pid_n * BLOCK_N / 2 .. of out (M, N / 2)."""
    dtype = out_ptr.dtype.element_ty
    if GLU_OUT:
        pairs = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))  # (BLOCK_M, BLOCK_N / 2, 2)
        gate, up = tl.split(pairs)
        gate = gate.to(dtype).to(tl.float32)  # rounded as the unfused projection's output
        up = up.to(dtype).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        act_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        act_mask = row_ok[:, None] & (act_cols < N // 2)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + act_cols[None, :], act.to(dtype), mask=act_mask)
    else:
        tl.store(out_ptr + out_offs, acc.to(dtype), mask=mask)


@triton.jit
def _prefetch_weight_slice(w_ptr, cols, col_ok, stride_wn, k_start, k_end, BLOCK_K: tl.constexpr, W_LINE: tl.constexpr):
    """prefetch.global.L2 of every 128-byte line of W's rows `cols`, columns k_start .. k_end (no data returned;
    the loads after it find the lines in L2)."""
    lines = tl.arange(0, BLOCK_K // W_LINE) * W_LINE  # first element of each line of a BLOCK_K-wide row piece
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + lines
        mask = col_ok[:, None] & (ks < k_end)[None, :]
        ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
        prefetch_l2(tl.where(mask, ptrs, w_ptr))  # masked lines prefetch W's first line (harmless)


@triton.jit
def _weight_tile(w_ptr, cols, col_ok, stride_wn, k0, k_end, BLOCK_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) tile of W at rows cols, columns k0 .. k0 + BLOCK_K (zeros at and past k_end)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = col_ok[:, None] & (ks < k_end)[None, :]
    return tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _rows_inv_rms(
    x_ptr,
    res_ptr,
    res_out_ptr,
    rows,
    row_ok,
    stride_xm,
    K,
    eps,
    write_res,
    HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(BLOCK_M,) 1 / sqrt(mean(r^2) + eps) of rows r = x (+ residual, rounded to x's dtype) over all K; stores r
    to res_out when write_res (and HAS_RES)."""
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks < K)[None, :]
        offs = rows[:, None] * stride_xm + ks[None, :]
        r = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = (r.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(r.dtype)
            if write_res:
                tl.store(res_out_ptr + offs, r, mask=mask)
        h = r.to(tl.float32)
        sum_sq += tl.sum(h * h, axis=1)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def _sum_partials_if_last(
    part_ptr,
    bias_ptr,
    out_ptr,
    count_ptr,
    part_offs,
    out_offs,
    cols,
    col_ok,
    mask,
    slab,
    rows,
    row_ok,
    pid_n,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    GLU_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Count this program's partial in; the program that brings the count to SPLIT sums the partials.

    The barrier makes every thread's partial store precede the one release-acquire atomic of the program; the
    partials are read with ".cg" (L2, not a possibly stale L1 line). The sum runs in split order whichever
    program is last, so results are bit-identical from run to run.
    """
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if done == SPLIT - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(part_ptr + s * slab + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        _store_output(out_ptr, total, rows, row_ok, out_offs, mask, pid_n, N, stride_om, GLU_OUT, BLOCK_M, BLOCK_N)
        tl.atomic_xchg(count_ptr, 0)


class SkinnyConfig(NamedTuple):
    """One skinny launch.

    block_m: rows of x per program (M padded to a power of two; >= 16 with tl.dot). block_n: output features per
    program. block_k: K columns per loop step. split_k: programs sharing one column block's K range (1 = no
    partials). num_warps / num_stages: Triton launch options. use_dot: tensor cores (tl.dot, rows padded to 16)
    or CUDA cores (broadcast products and tl.sum; no padding, for 1-4 rows). fused_reduce: with split_k > 1, the
    last program of each column block sums the partials (no second kernel); False launches ``_sum_splits_kernel``.
    preload: read the first weight tile into registers before the programmatic-dependent-launch wait, the next
    ones a step ahead (``PRELOAD_W``); best with one tile per program (block_k >= K / split_k) and num_stages 1.
    late_norm: a fused RMSNorm prologue scales the accumulator rows at the end instead of computing the rows'
    statistics first (``NORM_LATE``; split_k 1 only).
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = True
    fused_reduce: bool = True
    preload: bool = False
    late_norm: bool = False


class Tuned(NamedTuple):
    """A measured entry of the tuned table: the best launch config found for a (N, K, rows bucket), its time and
    cuBLAS's for the same product (us per call, CUDA-graph replays, weights past L2, benchmarks/sweep_small.py)."""

    config: SkinnyConfig
    skinny_us: float
    cublas_us: float


class Fused(NamedTuple):
    """A measured fused prologue (kind "norm": residual add + RMSNorm; "silu": SiLU-and-mul) at a (N, K, rows
    bucket): the config of the one fused launch, its time and that of the two launches it replaces (the norm or
    activation kernel, then the faster plain product), us per call (benchmarks/sweep_small.py)."""

    config: SkinnyConfig
    fused_us: float
    unfused_us: float


# Launch shapes measured best on the H200, by (N, K, rows bucket): M rows fall in the bucket of the smallest
# measured row count >= M (1; 2-16; 17-64). ``prefers_skinny`` sends a plain product to the kernel where its entry
# is faster than cuBLAS; the others are still the kernel's best shape when a fusion makes it take the product.
# Products without an entry keep ``prefers_skinny``'s shape rule and ``skinny_config``'s heuristic. Measured on the
# Qwen3-0.6B shapes (benchmarks/sweep_small.py, PDL on, CUDA-graph replays, weights past L2; us per call, skinny
# against cuBLAS): one row 2026-12-01 23:50 (--budget-s 60); 16 and 64 rows 2026-12-02 02:15 (--parts
# attn,gemm,glu,step --rows 16,64 --budget-s 55: 12 configs tried per bucket; o and down at 16 rows now take 256-wide
# K steps with the weights read ahead, the whole step at B = 16 verified faster with them and the GLU epilogue below).
# o at 16 rows was re-picked in the whole step (tenth session, BENCHMARKS.md): 512-wide K steps, so each program's
# whole weight slice (32 rows x 512) is read before the launch wait, during the attention kernel before it; alone
# 3.90 us against 4.33 for the 256-wide config and 5.53 for cuBLAS (same call), the step at B = 16 1.113-1.116 ms
# against 1.125-1.127. One-tile or wider variants of qkv, gate/up and down measured slower in the step.
MEASURED_ROWS = (1, 16, 64)
TUNED_CONFIGS: dict[tuple[int, int, int], Tuned] = {
    (4096, 1024, 1): Tuned(SkinnyConfig(1, 8, 1024, 1, 4, 1, use_dot=False, preload=True), 3.76, 4.93),  # 0.6b qkv
    (4096, 1024, 16): Tuned(SkinnyConfig(16, 32, 256, 1, 4, 1, preload=True), 4.65, 5.32),
    (4096, 1024, 64): Tuned(SkinnyConfig(64, 64, 128, 1, 4, 3), 4.68, 5.44),
    (1024, 2048, 1): Tuned(SkinnyConfig(1, 8, 2048, 1, 8, 1, use_dot=False, preload=True), 2.61, 12.60),  # 0.6b o
    (1024, 2048, 16): Tuned(SkinnyConfig(16, 32, 512, 4, 4, 1, preload=True), 3.90, 5.53),
    (1024, 2048, 64): Tuned(SkinnyConfig(64, 16, 256, 1, 4, 3), 4.90, 5.83),
    (6144, 1024, 1): Tuned(SkinnyConfig(1, 4, 1024, 1, 4, 1, use_dot=False, preload=True), 5.71, 6.16),  # gate_up
    (6144, 1024, 16): Tuned(SkinnyConfig(16, 32, 256, 1, 4, 1, preload=True), 6.08, 6.08),
    (6144, 1024, 64): Tuned(SkinnyConfig(64, 32, 128, 1, 4, 4), 6.71, 6.28),
    (1024, 3072, 1): Tuned(SkinnyConfig(1, 4, 2048, 1, 4, 1, use_dot=False, preload=True), 3.84, 7.44),  # 0.6b down
    (1024, 3072, 16): Tuned(SkinnyConfig(16, 32, 256, 4, 4, 1, preload=True), 5.18, 7.74),
    (1024, 3072, 64): Tuned(SkinnyConfig(64, 32, 128, 4, 4, 4), 6.23, 7.97),
}
# Fused prologues measured against the two launches they replace, by (kind, N, K, rows bucket), in the one-row run:
# ``prefers_fused`` fuses where the entry is faster (one row: all three; 16 rows: none); shapes without one keep
# its rule. Above NORM_MAX_ROWS no prologue is fused (SiLU in down_proj at 64 rows cost ~13 us a layer more).
# "glu" (SiLU-and-mul in gate/up's epilogue, ``norm_mlp``), in the 16/64-row run: 16 rows 6.20 us against 7.83 for
# cuBLAS's gate/up and the SiLU kernel; the whole decode step at B = 16 (latency contexts) 1139.2 us against 1206.0
# with it and the 16-row configs above. At 64 rows it measured 6.91 against 8.15 alone, but the whole step at B = 64
# 1574.1 us against 1552.8 without it: no entry there.
FUSED_TIMES: dict[tuple[str, int, int, int], Fused] = {
    ("norm", 4096, 1024, 1): Fused(SkinnyConfig(1, 8, 1024, 1, 4, 1, use_dot=False, preload=True), 4.09, 5.06),
    ("norm", 4096, 1024, 16): Fused(SkinnyConfig(16, 32, 128, 1, 4, 4), 9.56, 6.18),
    ("norm", 6144, 1024, 1): Fused(SkinnyConfig(1, 8, 1024, 1, 4, 1, use_dot=False, preload=True), 6.99, 7.10),
    ("norm", 6144, 1024, 16): Fused(SkinnyConfig(16, 32, 128, 1, 4, 4), 13.79, 7.97),
    ("silu", 1024, 3072, 1): Fused(SkinnyConfig(1, 8, 2048, 1, 8, 1, use_dot=False, preload=True), 4.19, 5.42),
    ("silu", 1024, 3072, 16): Fused(SkinnyConfig(16, 32, 128, 4, 4, 4), 17.46, 6.92),
    ("glu", 6144, 1024, 16): Fused(SkinnyConfig(16, 32, 256, 1, 4, 1, preload=True), 6.20, 7.83),
}


# Launch shapes for ``linear_partials`` where leaving the K splits unsummed pays a split the plain product does not
# take, by (N, K, rows bucket), with their time and the plain entry's (us per call, same timing as TUNED_CONFIGS; H200,
# BENCHMARKS.md, eleventh session). qkv at 16 rows: two 512-wide splits read before the launch wait, the attention
# prologue summing them (``store_kv.norm_rope_store``'s head grid); at 64 rows no split measured faster (4.64-6.76
# against 4.67). o_proj at 17-64 rows: four 256-wide K splits of 32-column blocks (128 programs, where the plain
# entry's one split of 16-column blocks runs 64), summed by the add + RMSNorm after it; the times are of that pair,
# o_proj then the norm, in a CUDA-graph chain under PDL (fourteenth session: 4.88 / 4.82 us at 64 / 32 rows against
# 5.89 / 6.57 for the plain entry and the norm; the decode step at 32 / 64 requests 1.359-1.362 / 1.529-1.555 ->
# 1.318-1.321 / 1.498-1.499 device ms). Like qkv's, this split rounds o_proj differently from the plain product.
PARTIALS_CONFIGS: dict[tuple[int, int, int], Tuned] = {
    (4096, 1024, 16): Tuned(SkinnyConfig(16, 32, 512, 2, 4, 1, preload=True), 3.70, 4.59),  # 0.6b qkv
    (1024, 2048, 64): Tuned(SkinnyConfig(64, 32, 256, 4, 4, 3), 4.88, 5.89),  # 0.6b o, with the norm after it
}


def partials_config(num_rows: int, out_features: int, in_features: int) -> SkinnyConfig:
    """``linear_partials``' launch shape for (M, N, K): a faster ``PARTIALS_CONFIGS`` entry, else ``skinny_config``."""
    entry = PARTIALS_CONFIGS.get((out_features, in_features, rows_bucket(num_rows) or 0))
    if entry is not None and entry.skinny_us < entry.cublas_us:
        return _fit_rows(entry.config, num_rows)
    return skinny_config(num_rows, out_features, in_features)


# The residual add + RMSNorm before a projection as a row scale at the end of its product (``late_norm``, no
# statistics pass), at the rows LATE_NORM_ROWS covers, with the plain product's measured config: FNVLLM_LATE_NORM
# "one" (the default) at one row, "0" off, "1" from 2 to 64 rows, "all" from 1 to 64 rows. Read at import. Measured
# on the H200 (benchmarks/bench_late_norm.py, 2026-12-02; us per call, weights past L2): one row, norm + qkv 3.67
# late against 3.86 statistics-first and 4.92 unfused, norm + gate/up 6.63 against 7.02 and 6.91; at 16 and 64 rows
# it loses: 16 rows 8.57 / 11.57 against 6.07 / 7.69 unfused, 64 rows 21.9 / 39.5 against 6.6 / 8.0. Registers
# (ptxas for sm_90 with the launch's 16-byte alignment specialized, 2026-12-02): the plain 16-row qkv config holds
# 143, the late one 255 and spills 96 bytes; but spills are not the whole cost, since a late norm without the
# residual add and with 128-wide steps (221-222 registers, no spill) also made the 16-row step slower (BENCHMARKS.md,
# tenth session): its per-step row reductions and the input's layout change cost more than a launch that
# programmatic dependent launch already hides.
LATE_NORM_ENV = "FNVLLM_LATE_NORM"
_LATE_NORM_CHOICES = {"0": (0, 0), "one": (1, 1), "1": (2, 64), "all": (1, 64)}
LATE_NORM_ROWS = _LATE_NORM_CHOICES[env_choice(LATE_NORM_ENV, tuple(_LATE_NORM_CHOICES), "one")]


def late_norm_config(num_rows: int, out_features: int, in_features: int) -> SkinnyConfig | None:
    """The config of a projection at M rows with its RMSNorm as a late row scale: the measured plain config
    (``tuned_config``) with late_norm set, when M is in LATE_NORM_ROWS and that config has one K split; else None."""
    lo, hi = LATE_NORM_ROWS
    cfg = tuned_config(num_rows, out_features, in_features) if lo <= num_rows <= hi else None
    return None if cfg is None or cfg.split_k != 1 else cfg._replace(late_norm=True)


def rows_bucket(num_rows: int) -> int | None:
    """The tuned table's bucket for M rows: the smallest of MEASURED_ROWS >= M (None above the largest)."""
    return next((r for r in MEASURED_ROWS if r >= num_rows), None)


def tuned_config(num_rows: int, out_features: int, in_features: int) -> SkinnyConfig | None:
    """The measured config for (M, N, K) from ``TUNED_CONFIGS`` (block_m fitted to M), or None."""
    tuned = TUNED_CONFIGS.get((out_features, in_features, rows_bucket(num_rows) or 0))
    return None if tuned is None else _fit_rows(tuned.config, num_rows)


def fused_config(kind: str, num_rows: int, out_features: int, in_features: int) -> SkinnyConfig | None:
    """The measured config of the fused ``kind`` ("norm" or "silu") product for (M, N, K) from ``FUSED_TIMES``
    (block_m fitted to M), else the plain product's ``tuned_config``, or None."""
    fused = FUSED_TIMES.get((kind, out_features, in_features, rows_bucket(num_rows) or 0))
    return tuned_config(num_rows, out_features, in_features) if fused is None else _fit_rows(fused.config, num_rows)


def _fit_rows(cfg: SkinnyConfig, num_rows: int) -> SkinnyConfig:
    """cfg with block_m fitted to num_rows (M padded to a power of two, >= 16 with tl.dot)."""
    return cfg._replace(block_m=_block_m(num_rows, cfg.use_dot))


@functools.cache
def skinny_config(num_rows: int, out_features: int, in_features: int) -> SkinnyConfig:
    """The launch shape for (M, N, K): the measured one from ``TUNED_CONFIGS`` when listed; otherwise BLOCK_N 32
    when that alone gives the target grid, else 16, then enough K splits (a power of two, each at least
    2 * BLOCK_K wide) to reach ``_TARGET_PROGRAMS`` programs."""
    tuned = tuned_config(num_rows, out_features, in_features)
    if tuned is not None:
        return tuned
    block_k = 128 if in_features >= 128 else max(16, int(triton.next_power_of_2(in_features)))
    block_n = 32 if triton.cdiv(out_features, 32) >= _TARGET_PROGRAMS else 16
    col_blocks = triton.cdiv(out_features, block_n)
    split = 1
    while split < _MAX_SPLIT_K and col_blocks * split < _TARGET_PROGRAMS and in_features // (2 * split) >= 2 * block_k:
        split *= 2
    return SkinnyConfig(_block_m(num_rows, True), block_n, block_k, split)


def _block_m(num_rows: int, use_dot: bool) -> int:
    """Rows per program: M padded to a power of two, at least 16 for tl.dot."""
    return max(16 if use_dot else 1, int(triton.next_power_of_2(max(1, num_rows))))


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    glu: bool = False,
    norm: Norm | None = None,
    glu_out: bool = False,
    epilogue: QkvEpilogue | None = None,
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T (+ bias (N,)) -> (M, N) in x's dtype, with the skinny kernel; M <= 64.
    glu: x is [gate | up] (M, 2K) and the product is silu_and_mul(x) @ weight^T (SiLU-and-mul done on load).
    glu_out: weight is [gate | up] (2I, K) and the result is silu_and_mul(x @ weight^T + bias), (M, I) (SiLU-and-mul
    done in the epilogue; needs an even block_n, and with split_k > 1 the in-kernel sum).
    norm: the product's input is the RMSNorm of x (+ norm.residual), computed on load; x + residual is written
    to norm.residual_out (see ``Norm``).
    epilogue: the product is a qkv projection and the attention prologue runs in the kernel's epilogue (see
    ``QkvEpilogue``: q into epilogue.q_out, K / V into the caches); needs split_k 1 and block_n dividing D.

    Reads no device values (graph-capturable); the split-K workspace is allocated per call (inside a CUDA graph it
    comes from the graph's private pool). Launches that split K must not run concurrently on two streams of one
    device (they share the arrival counters)."""
    num_rows, in_features = x.shape[0], x.shape[1] // 2 if glu else x.shape[1]
    out_features = weight.shape[0]
    if weight.shape[1] != in_features or (glu and x.shape[1] != 2 * in_features):
        raise ValueError(f"weight is {tuple(weight.shape)} but x has {x.shape[1]} features (glu={glu})")
    if num_rows > 64:
        raise ValueError(f"skinny_linear takes at most 64 rows, got {num_rows}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs x and weight contiguous in their last dimension")
    cfg = config or skinny_config(num_rows, out_features, in_features)
    if glu_out:
        _check_glu_out(cfg, out_features, glu)
    out = torch.empty(num_rows, out_features // 2 if glu_out else out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if norm is not None:
        _check_norm(norm, x)
        if cfg.late_norm and cfg.split_k != 1:
            raise ValueError(f"a late norm (late_norm=True) needs split_k 1, got {cfg.split_k}")
    if epilogue is not None:
        _check_epilogue(epilogue, cfg, out, glu or glu_out)
    _launch_skinny(x, weight, bias, out, cfg, glu, norm, glu_out, epilogue)
    return out


def _check_glu_out(cfg: SkinnyConfig, out_features: int, glu: bool) -> None:
    """Raise ValueError unless a GLU epilogue can run: an even number of weight rows, an even block_n (>= 32 with
    tl.dot, whose halves are >= 16 wide), the in-kernel split sum, and no GLU prologue too."""
    if out_features % 2 or cfg.block_n % 2 or (cfg.use_dot and cfg.block_n < 32):
        raise ValueError(f"glu_out needs an even weight row count and block_n (>= 32 with use_dot), got "
                         f"{out_features} rows, block_n {cfg.block_n}")  # fmt: skip
    if cfg.split_k > 1 and not cfg.fused_reduce:
        raise ValueError("glu_out with split_k > 1 needs fused_reduce=True (the separate sum kernel has no epilogue)")
    if glu:
        raise ValueError("glu (SiLU-and-mul prologue) and glu_out (epilogue) cannot both be set")


class QkvEpilogue(NamedTuple):
    """The attention prologue fused into a qkv projection's epilogue (``store_kv.norm_rope_store``'s arguments
    after qkv): q_out (M, Hq, D) contiguous receives the normed, rotated q; K (normed, rotated) and V go to the
    caches at slot_mapping (M,), quantized by k_scale / v_scale for FP8 caches. q_weight / k_weight (D,) or both
    None (no per-head norm); cos / sin (M, D / 2) float32."""

    q_out: torch.Tensor
    num_heads: int
    num_kv_heads: int
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def epilogue_fits(cfg: SkinnyConfig, head_dim: int) -> bool:
    """Whether a launch config can run the qkv epilogue: one K split (every program owns whole output columns)
    and block_n dividing the head dim (a head's columns are whole programs')."""
    return cfg.split_k == 1 and head_dim % cfg.block_n == 0


def _check_epilogue(epi: QkvEpilogue, cfg: SkinnyConfig, out: torch.Tensor, glu: bool) -> None:
    """Raise ValueError naming the field unless the epilogue fits the config, the product and its arguments."""
    head_dim = epi.k_cache.shape[-1]
    if not epilogue_fits(cfg, head_dim) or glu:
        raise ValueError(f"the qkv epilogue needs split_k 1, block_n dividing head_dim {head_dim} and no GLU, got "
                         f"split_k {cfg.split_k}, block_n {cfg.block_n}, glu {glu}")  # fmt: skip
    check_prologue_args(out, epi.num_heads, epi.num_kv_heads, epi.q_weight, epi.k_weight, epi.cos, epi.sin,
                        epi.q_out, epi.k_cache, epi.v_cache, epi.slot_mapping, epi.k_scale, epi.v_scale)  # fmt: skip


def _epilogue_args(epi: QkvEpilogue | None, out: torch.Tensor) -> tuple[list[object], dict[str, object]]:
    """The kernel's QKV_EPI pointer / stride arguments and constexprs (placeholders pointing at out without)."""
    if epi is None:
        return [out] * 10 + [0, 0, 0.0], {"QKV_EPI": False, "EPI_HEADS": 1, "EPI_KV_HEADS": 1, "EPI_HALF": 1,
                                           "EPI_NORM": False, "EPI_FP8": False, "EPI_BLOCK_SIZE": 1,
                                           "EPI_HEAD_MAJOR": False}  # fmt: skip
    fp8 = is_fp8(epi.k_cache)
    args = [
        epi.q_out,
        epi.k_cache.view(torch.uint8) if fp8 else epi.k_cache,
        epi.v_cache.view(torch.uint8) if fp8 else epi.v_cache,
        epi.slot_mapping,
        epi.k_scale if epi.k_scale is not None else epi.cos,  # any pointer where the kernel reads no scale
        epi.v_scale if epi.v_scale is not None else epi.cos,
        epi.q_weight if epi.q_weight is not None else epi.cos,
        epi.k_weight if epi.k_weight is not None else epi.cos,
        epi.cos,
        epi.sin,
        epi.cos.stride(0),
        epi.sin.stride(0),
        epi.eps,
    ]
    constexprs = {
        "QKV_EPI": True,
        "EPI_HEADS": epi.num_heads,
        "EPI_KV_HEADS": epi.num_kv_heads,
        "EPI_HALF": epi.k_cache.shape[-1] // 2,
        "EPI_NORM": epi.q_weight is not None,
        "EPI_FP8": fp8,
        "EPI_BLOCK_SIZE": epi.k_cache.shape[1],
        "EPI_HEAD_MAJOR": kv_layout(epi.k_cache) == "HND",
    }
    return args, constexprs


class Norm(NamedTuple):
    """An RMSNorm fused into a skinny GEMM's input: weight (K,), eps, and optionally the residual stream (M, K)
    added to x first, with residual_out (M, K) receiving x + residual (both contiguous like x)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


def _check_norm(norm: Norm, x: torch.Tensor) -> None:
    """Raise ValueError unless the norm's weight is (K,) and the residual pair is absent or both like x."""
    if norm.weight.shape != (x.shape[1],) or not norm.weight.is_contiguous():
        raise ValueError(f"norm weight must be contiguous ({x.shape[1]},), got {tuple(norm.weight.shape)}")
    if (norm.residual is None) != (norm.residual_out is None):
        raise ValueError("norm residual and residual_out must both be given or both be None")
    for t in (norm.residual, norm.residual_out):
        if t is not None and (t.shape != x.shape or t.stride() != x.stride() or t.dtype != x.dtype):
            raise ValueError(f"norm residual tensors must be like x {tuple(x.shape)} {x.dtype} (same strides)")


def prefetch_weights(device: torch.device) -> bool:
    """Whether the kernel prefetches its weight slice into L2 before its wait (``PREFETCH_W``): when launched
    with programmatic dependent launch (a CUDA device), so the prefetch overlaps the previous kernel."""
    return use_pdl(device)


def _launch_skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: SkinnyConfig,
    glu: bool,
    norm: Norm | None = None,
    glu_out: bool = False,
    epilogue: QkvEpilogue | None = None,
    part: torch.Tensor | None = None,
) -> None:
    """Launch the skinny kernel (and, for an unfused split, the sum kernel) writing x @ weight^T + bias to out
    (its SiLU-and-mul with glu_out). part: a (split_k, M, N) float32 buffer for a split without the in-kernel sum,
    where the partials are left unsummed (no sum kernel: the caller's consumer sums them)."""
    num_rows, (out_features, in_features) = x.shape[0], weight.shape
    if cfg.block_m < num_rows or (cfg.use_dot and cfg.block_m < 16):
        raise ValueError(f"config block_m {cfg.block_m} must be >= the {num_rows} rows (and >= 16 with use_dot)")
    col_blocks = triton.cdiv(out_features // 2, cfg.block_n // 2) if glu_out else triton.cdiv(out_features, cfg.block_n)
    k_per_split = triton.cdiv(triton.cdiv(in_features, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cfg.split_k > 1
    keep = part is not None
    if keep and (not split or cfg.fused_reduce or bias is not None or glu_out or epilogue is not None):
        raise ValueError("partials are kept only for a plain product with split_k > 1, no bias and no in-kernel sum")
    if part is None:
        part = torch.empty(cfg.split_k, num_rows, out_features, dtype=torch.float32, device=x.device) if split else out
    counters = split_counters(x.device, col_blocks) if split and cfg.fused_reduce else out
    if epilogue is not None:  # one arrival counter per head
        counters = split_counters(x.device, epilogue.num_heads + 2 * epilogue.num_kv_heads)
    epi_args, epi_constexprs = _epilogue_args(epilogue, out)
    bias_arg = bias if bias is not None else out
    _skinny_kernel[(col_blocks, cfg.split_k)](
        x,
        weight,
        bias_arg,
        out,
        part,
        counters,
        norm.residual if norm is not None and norm.residual is not None else x,
        norm.residual_out if norm is not None and norm.residual_out is not None else x,
        norm.weight if norm is not None else x,
        norm.eps if norm is not None else 0.0,
        *epi_args,
        num_rows,
        out_features,
        in_features,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT=cfg.split_k,
        FUSED_REDUCE=cfg.fused_reduce,
        USE_DOT=cfg.use_dot,
        GLU=glu,
        GLU_OUT=glu_out,
        NORM=norm is not None,
        NORM_RES=norm is not None and norm.residual is not None,
        NORM_LATE=norm is not None and cfg.late_norm,
        USE_PDL=use_pdl(x.device),
        PREFETCH_W=prefetch_weights(x.device) and not cfg.preload and cfg.block_k * weight.element_size() >= 128,
        PRELOAD_W=cfg.preload,
        ONE_TILE=k_per_split <= cfg.block_k,
        W_LINE=max(1, 128 // weight.element_size()),
        NORM_BLOCK=_norm_block(in_features, cfg.block_m),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot(x.device),
        **epi_constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )
    if split and not cfg.fused_reduce and not keep:
        block = 256
        _sum_splits_kernel[(triton.cdiv(num_rows * out_features, block),)](
            part,
            bias_arg,
            out,
            num_rows,
            out_features,
            out.stride(0),
            HAS_BIAS=bias is not None,
            SPLIT=cfg.split_k,
            BLOCK=block,
        )


# float32 values the norm prologue's statistics loop holds per step (BLOCK_M rows x NORM_BLOCK columns): a whole
# 1024-wide row per step at one row, so the rows' statistics cost one L2 round trip, not K / BLOCK_K of them.
_NORM_ELEMENTS = 8192


def _norm_block(in_features: int, block_m: int) -> int:
    """K columns per step of the norm prologue's statistics loop: the row's width (a power of two) capped so
    that a step holds at most _NORM_ELEMENTS values, at least 16."""
    return max(16, min(int(triton.next_power_of_2(max(1, in_features))), _NORM_ELEMENTS // block_m))


def prefers_skinny(num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether ``skinny_linear`` beats cuBLAS for this plain product, by the H200 measurements: a ``TUNED_CONFIGS``
    entry at this rows bucket decides (its time against cuBLAS's); for shapes not measured there, narrow, deep
    products (N <= 2048 and K >= 2N, where cuBLAS splits K and pays a reduce) at <= SKINNY_MAX_ROWS rows
    (BENCHMARKS.md, "skinny bf16 GEMM")."""
    bucket = rows_bucket(num_rows)
    if num_rows <= 0 or bucket is None:
        return False
    tuned = TUNED_CONFIGS.get((out_features, in_features, bucket))
    if tuned is not None:
        return tuned.skinny_us < tuned.cublas_us
    return num_rows <= SKINNY_MAX_ROWS and out_features <= 2048 and in_features >= 2 * out_features


def prefers_fused(kind: str, num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether a projection with a prologue to fuse (kind "norm": residual add + RMSNorm, "silu": SiLU-and-mul)
    goes to the skinny kernel at M rows: never above NORM_MAX_ROWS rows; below, a ``FUSED_TIMES`` entry at this
    rows bucket decides (fused against the two launches); without one, when the kernel has a measured config
    there (one ~5 us launch instead of the op's ~1.6 us launch plus cuBLAS's ~5 us), or wherever the plain
    product prefers it. Kind "glu" (the SiLU-and-mul epilogue of a gate/up projection, ``glu_out``) is taken only
    where a ``FUSED_TIMES`` entry measured it faster, up to 64 rows."""
    if kind == "glu":
        fused = FUSED_TIMES.get((kind, out_features, in_features, rows_bucket(num_rows) or 0))
        return num_rows > 0 and fused is not None and fused.fused_us < fused.unfused_us
    if kind not in ("norm", "silu"):
        raise ValueError(f"prefers_fused kind must be 'norm', 'silu' or 'glu', got {kind!r}")
    if not 0 < num_rows <= NORM_MAX_ROWS:
        return False
    fused = FUSED_TIMES.get((kind, out_features, in_features, rows_bucket(num_rows) or 0))
    if fused is not None:
        return fused.fused_us < fused.unfused_us
    if tuned_config(num_rows, out_features, in_features) is not None:
        return True
    return prefers_skinny(num_rows, out_features, in_features)


def on_gpu(x: torch.Tensor) -> bool:
    """Whether the dispatchers below may send x's product to the skinny kernel (a CUDA tensor; tests run the
    kernel paths under Triton's interpreter by replacing this)."""
    return x.device.type == "cuda"


def _rows(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(rows, x as a (rows, features) matrix with a contiguous last dim) for x (..., features)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    flat = x.reshape(rows, x.shape[-1])
    return rows, flat if flat.stride(-1) == 1 else flat.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for the model, with the few-row products that ``prefers_skinny`` picks, on a GPU, sent to
    ``skinny_linear``. x may have leading dimensions (..., K); they are flattened for the kernel."""
    rows, flat = _rows(x)
    if not on_gpu(x) or not prefers_skinny(rows, weight.shape[0], weight.shape[1]):
        return F.linear(x, weight, bias)
    return skinny_linear(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def linear_partials(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | SplitPartials:
    """``linear(x, weight, bias)`` for a projection whose consumer sums split partials (the residual add + RMSNorm
    after o_proj / down_proj, the attention prologue after qkv), except that where the skinny kernel takes the
    product of x (T, K) with its K split (``partials_config``'s split_k > 1) and there is no bias, the float32 split
    partials are returned unsummed (``SplitPartials`` of (S, T, N)) for that consumer to sum in split order: the
    values the same launch writes when it sums them itself, with the split sum's arrival counter and re-read off
    the projection's critical path. (Where ``PARTIALS_CONFIGS`` picks a shape the plain product does not use, qkv
    at 16 rows and o_proj at 17-64, the K split differs from ``linear``'s, so the result is rounded differently, as
    after any re-tuned config.) Measured on
    the H200 (CUDA-graph replays past L2, PDL; BENCHMARKS.md, eleventh session), us per call with the in-kernel sum
    / partials left unsummed: Qwen3-0.6B o_proj at 16 rows 4.05 / 2.56, down_proj at 16 rows 5.31 / 3.90, at 64
    rows 6.19 / 4.02; qkv at 16 rows takes a split only here (``PARTIALS_CONFIGS``: 4.59 -> 3.70), o_proj at 17-64
    rows too (with the norm after it: 5.89 -> 4.88 at 64 rows, fourteenth session). The products
    ``cuda_skinny.CUDA_CONFIGS`` lists (Qwen3-0.6B qkv and down_proj at 2-16 rows today; ``DEVICE_CONFIGS`` may give
    a GPU model its own launch shape) take that module's CUDA kernel instead, which returns its own split partials
    (eighteenth session)."""
    rows = x.shape[0]
    if bias is None and x.dim() == 2 and on_gpu(x) and (cuda := cuda_skinny.cuda_config("partials", x, weight)):
        return SplitPartials(cuda_skinny.skinny_partials(x, weight, cuda), x.dtype)
    if bias is None and x.dim() == 2 and on_gpu(x) and prefers_skinny(rows, *weight.shape):
        cfg = partials_config(rows, *weight.shape)
        if cfg.split_k > 1 and x.stride(1) == 1 and weight.stride(1) == 1:
            return skinny_partials(x, weight, cfg)
    return linear(x, weight, bias)


def skinny_partials(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig) -> SplitPartials:
    """The split partials of x (M, K) @ weight (N, K)^T under config (split_k > 1): (split_k, M, N) float32, left
    unsummed (``SplitPartials``); their sum in split order, rounded to x's dtype, is ``skinny_linear``'s output."""
    num_rows, out_features = x.shape[0], weight.shape[0]
    if config.split_k < 2 or num_rows > 64 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"skinny_partials needs split_k > 1, <= 64 rows and matching K, got {config} for "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")  # fmt: skip
    part = torch.empty(config.split_k, num_rows, out_features, dtype=torch.float32, device=x.device)
    if num_rows:
        cfg = _fit_rows(config, num_rows)._replace(fused_reduce=False)
        _launch_skinny(x, weight, None, part[0], cfg, False, part=part)
    return SplitPartials(part, x.dtype)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_partials: bool = False
) -> torch.Tensor | SplitPartials:
    """``F.linear(silu_and_mul(gate_up), weight, bias)`` for gate_up (..., 2K) = [gate | up], weight (N, K): an
    MLP's activation and down projection. Where ``prefers_fused`` picks the product (on a GPU), one skinny launch
    computes the activation as it loads it; otherwise ``fused_ops.silu_and_mul`` then ``F.linear``, or with
    keep_partials (a 2-D gate_up whose result goes to a residual add + RMSNorm) ``linear_partials``."""
    rows, flat = _rows(gate_up)
    out_features, in_features = weight.shape
    if not on_gpu(gate_up) or not prefers_fused("silu", rows, out_features, in_features):
        act = silu_and_mul(gate_up.reshape(rows, -1))
        if keep_partials and gate_up.dim() == 2:
            return linear_partials(act, weight, bias)
        return linear(act, weight, bias).reshape(*gate_up.shape[:-1], -1)
    cfg = fused_config("silu", rows, out_features, in_features)
    return skinny_linear(flat, weight, bias, cfg, glu=True).reshape(*gate_up.shape[:-1], out_features)


def norm_linear(
    x: torch.Tensor | SplitPartials,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    keep_partials: bool = False,
) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
    """(linear(rmsnorm(x + residual), weight, bias), x + residual) for x, residual (T, K): a decoder layer's
    residual add, RMSNorm and the projection after it; residual None means rmsnorm(x) and x itself. Where
    ``prefers_fused`` picks the product (on a GPU), one skinny launch computes the norm as it loads its input;
    otherwise ``fused_ops.fused_add_rmsnorm`` (or ``rmsnorm``) then ``linear``. x may be the previous projection's
    split partials (``linear_partials``): the add + RMSNorm kernel sums them, or they are summed first where the
    norm runs inside the projection. keep_partials: the caller's consumer sums split partials (a qkv projection's
    attention prologue), so the unfused product is ``linear_partials``."""
    product = linear_partials if keep_partials else linear
    rows = x.parts.shape[1] if isinstance(x, SplitPartials) else x.shape[0]
    if isinstance(x, SplitPartials) and (residual is None or _norm_prologue(x.parts[0], weight) is not None):
        x = sum_split_partials(x)
    cfg = None if isinstance(x, SplitPartials) else _norm_prologue(x, weight)
    if cfg is not None and isinstance(x, torch.Tensor):
        norm, new_residual = _fused_norm(x, residual, norm_weight, eps)
        return skinny_linear(x, weight, bias, cfg, norm=norm), new_residual
    if residual is None:
        value = x if isinstance(x, torch.Tensor) else sum_split_partials(x)  # (partials were summed above)
        return product(rmsnorm(value, norm_weight, eps), weight, bias), value
    prefetch = weight if prefetches_for_cublas(rows, weight) else None
    normed, new_residual = fused_add_rmsnorm(x, residual, norm_weight, eps, prefetch)
    return product(normed, weight, bias), new_residual


# The add + RMSNorm before a product that cuBLAS takes at 17-32 rows (Qwen3-0.6B's gate/up) asks L2 for that
# product's weight before its own wait (``fused_add_rmsnorm``'s prefetch): cuBLAS's kernel is launched without
# programmatic dependent launch, so it starts reading its weight only when the norm has finished, and now finds it
# in L2. The skinny kernel needs no such help: it prefetches its own weight slice before its wait (``PREFETCH_W``).
# Only weights of at most NORM_PREFETCH_MAX_BYTES (a third of an H100's or H200's 50 MiB L2), so the prefetch does
# not evict what it is for. Measured on an H100 (BENCHMARKS.md, thirty-first session; random Qwen3-0.6B checkpoint,
# latency bench, device ms per decode step, off / on, two rounds each, alternated): 24 requests 1.354, 1.353 /
# 1.337, 1.343; 32 requests 1.472-1.477 / 1.431-1.436 (-2.8 %); 48 requests 1.549, 1.552 / 1.572, 1.571 (+1.4 %); 64
# requests 1.674-1.678 / 1.682-1.683: so 17-32 rows only. Not measured on an H200. FNVLLM_NORM_PREFETCH=0 turns it
# off (read at import).
NORM_PREFETCH = env_switch("FNVLLM_NORM_PREFETCH", True)
NORM_PREFETCH_ROWS = (SKINNY_MAX_ROWS + 1, 32)
NORM_PREFETCH_MAX_BYTES = 16 << 20


def prefetches_for_cublas(num_rows: int, weight: torch.Tensor) -> bool:
    """Whether ``norm_linear``'s add + RMSNorm asks L2 for ``weight`` ahead of the product at num_rows rows: on
    (NORM_PREFETCH), rows in NORM_PREFETCH_ROWS, a plain product that cuBLAS takes (``prefers_skinny`` false), a
    contiguous weight of at most NORM_PREFETCH_MAX_BYTES on a GPU."""
    lo, hi = NORM_PREFETCH_ROWS
    if not NORM_PREFETCH or not lo <= num_rows <= hi or weight.dim() != 2:
        return False
    small = weight.numel() * weight.element_size() <= NORM_PREFETCH_MAX_BYTES
    return on_gpu(weight) and weight.is_contiguous() and small and not prefers_skinny(num_rows, *weight.shape)


def _norm_prologue(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | None:
    """The config of ``norm_linear``'s product of x (T, K) by weight with the residual add + RMSNorm inside it (a
    late norm where ``late_norm_config`` gives one, else where ``prefers_fused`` picks it), or None: unfused."""
    rows, (out_features, in_features) = x.shape[0], weight.shape
    if not (on_gpu(x) and x.dim() == 2 and x.is_contiguous()):
        return None
    late = late_norm_config(rows, out_features, in_features)
    if late is not None:
        return late
    if rows <= NORM_MAX_ROWS and prefers_fused("norm", rows, out_features, in_features):
        return fused_config("norm", rows, out_features, in_features)
    return None


def norm_mlp(
    x: torch.Tensor | SplitPartials,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None = None,
    keep_partials: bool = False,
) -> tuple[torch.Tensor | SplitPartials, torch.Tensor]:
    """(down(silu_and_mul(gate_up(rmsnorm(x + residual)))), x + residual) for x, residual (T, K): a gated MLP after
    its residual add + RMSNorm (residual None: rmsnorm(x), and x itself), gate_up_weight [gate | up] (2I, K),
    down_weight (N, I). Where ``prefers_fused("glu", ...)`` picks the rows (on a GPU), the activation runs in the
    gate/up projection's epilogue (``glu_out``: no SiLU-and-mul launch); otherwise ``norm_linear`` then
    ``silu_mul_linear``, each fusing where it measured faster. x may be split partials (see ``norm_linear``);
    keep_partials: the result goes to a residual add + RMSNorm, so down_proj may leave its own
    (``linear_partials``). A gate/up projection that ``cuda_skinny.CUDA_CONFIGS`` lists as "glu" for the rows'
    tile runs there (``cuda_skinny.glu_out``, same rounding) without a bias, after an unfused add + RMSNorm, also
    at rows where ``prefers_fused`` would not fuse the activation."""
    value = x.parts[0] if isinstance(x, SplitPartials) else x  # (T, K) in shape and device
    rows, (gu_rows, in_features) = value.shape[0], gate_up_weight.shape
    down = linear_partials if keep_partials else linear
    in_dtype = x.dtype  # the activation's (a SplitPartials carries its output dtype)
    cuda_rows = gate_up_bias is None and cuda_skinny.table_config("glu", rows, gate_up_weight, in_dtype) is not None
    if on_gpu(value) and value.dim() == 2 and (cuda_rows or prefers_fused("glu", rows, gu_rows, in_features)):
        cfg = fused_config("glu", rows, gu_rows, in_features)
        late = late_norm_config(rows, gu_rows, in_features) is not None and cfg is not None and cfg.split_k == 1
        if isinstance(x, SplitPartials) and (late or residual is None):
            x = sum_split_partials(x)
        if late and cfg is not None and isinstance(x, torch.Tensor):
            norm, new_residual = _fused_norm(x.contiguous(), residual, norm_weight, eps)
            act = skinny_linear(x.contiguous(), gate_up_weight, gate_up_bias, cfg._replace(late_norm=True), norm=norm,
                                glu_out=True)  # fmt: skip
            return down(act, down_weight, down_bias), new_residual
        if residual is None:
            value = x if isinstance(x, torch.Tensor) else sum_split_partials(x)  # (partials were summed above)
            normed, new_residual = rmsnorm(value, norm_weight, eps), value
        else:
            normed, new_residual = fused_add_rmsnorm(x, residual, norm_weight, eps)
        normed = normed.contiguous()
        cuda = cuda_skinny.cuda_config("glu", normed, gate_up_weight) if cuda_rows else None  # (normed's own checks)
        if cuda is not None:
            act = cuda_skinny.glu_out(normed, gate_up_weight, cuda)  # (T, I)
        else:
            act = skinny_linear(normed, gate_up_weight, gate_up_bias, cfg, glu_out=True)  # (T, I)
        return down(act, down_weight, down_bias), new_residual
    gate_up, new_residual = norm_linear(x, residual, norm_weight, eps, gate_up_weight, gate_up_bias)
    return silu_mul_linear(gate_up, down_weight, down_bias, keep_partials), new_residual


def _fused_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[Norm, torch.Tensor]:
    """The ``Norm`` of a fused residual add + RMSNorm over x (T, K) contiguous, and the new residual stream it
    fills (x itself when there is no residual)."""
    residual = None if residual is None else residual.contiguous()
    new_residual = x if residual is None else torch.empty_like(x)
    return Norm(norm_weight, eps, residual, None if residual is None else new_residual), new_residual


# The attention prologue in the qkv projection's epilogue (``norm_linear_rope_store``): off unless
# FNVLLM_QKV_EPILOGUE=1 (``model.ops``). H200, Qwen3-0.6B (benchmarks/bench_qkv_epilogue.py, 2026-12-02 05:35),
# bit-exact at 1/4/16 rows, bf16 and FP8 caches, over graph replays; the layer's norm + qkv + prologue alone
# 6.18 us against 6.17 (one row) and 7.94 against 8.12 (16 rows), but the whole decode step slower: 820.2 us
# against 768.6 (B = 1) and 1185.7 against 1144.5 (B = 16), the per-token grid of ``norm_rope_store`` both times.
QKV_EPILOGUE_ENV = "FNVLLM_QKV_EPILOGUE"
# Rows up to which the epilogue runs (above, the projection and ``norm_rope_store`` launch separately). One row:
# on the H200 (2026-12-02, tests/test_qkv_epilogue.py's GPU test, twice) q or the residual differed from the unfused
# path's bits at 4 rows (bf16 and FP8 caches), while 1 and 16 rows were bit-equal; not yet explained, so the opt-in
# path stays where it is verified. The kernel itself is tested at 1-17 rows under the interpreter.
EPILOGUE_MAX_ROWS = 1
# Launch configs of the epilogue product by rows bucket, where measured better than the plain product's config
# (none yet: the plain one is used when it fits, ``epilogue_fits``).
EPILOGUE_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {}


def epilogue_config(
    num_rows: int, out_features: int, in_features: int, head_dim: int, norm: bool
) -> SkinnyConfig | None:
    """The launch config of a qkv projection with the attention prologue in its epilogue at M rows (norm: with
    the RMSNorm prologue too): an ``EPILOGUE_CONFIGS`` entry, else the product's own as ``norm_linear`` picks it
    (``late_norm_config``, ``fused_config("norm")`` or ``skinny_config``), when it fits (``epilogue_fits``); None
    when it does not or M is out of range."""
    if not 0 < num_rows <= EPILOGUE_MAX_ROWS:
        return None
    entry = EPILOGUE_CONFIGS.get((out_features, in_features, rows_bucket(num_rows) or 0))
    if entry is not None:
        cfg = _fit_rows(entry, num_rows)
    elif norm:
        cfg = (
            late_norm_config(num_rows, out_features, in_features)
            or fused_config("norm", num_rows, out_features, in_features)
            or skinny_config(num_rows, out_features, in_features)
        )
    else:
        cfg = skinny_config(num_rows, out_features, in_features)
    return cfg if epilogue_fits(cfg, head_dim) else None


def norm_linear_rope_store(
    x: torch.Tensor | SplitPartials,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    qk_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (T, Hq, D), x + residual): a decoder layer's residual add + RMSNorm, qkv projection and attention
    prologue (``store_kv.norm_rope_store``: q/k norms, rotary, K / V stored into the caches in place). On a GPU at
    <= EPILOGUE_MAX_ROWS rows where the unfused path's product runs on the skinny kernel too (``prefers_fused``
    or ``prefers_skinny``) and its config fits, the prologue runs in the projection's epilogue (and the RMSNorm
    in its load where ``prefers_fused`` says): one launch fewer; otherwise ``norm_linear`` then
    ``norm_rope_store``. With the product's own config (no ``EPILOGUE_CONFIGS`` entry) both give the same bits. x
    may be split partials (``linear_partials``): summed first."""
    if isinstance(x, SplitPartials):
        x = sum_split_partials(x)
    rows, (out_features, in_features) = x.shape[0], weight.shape
    head_dim = k_cache.shape[-1]
    fused_norm = _norm_prologue(x, weight) is not None  # the RMSNorm inside the product where norm_linear puts it
    skinny = fused_norm or prefers_skinny(rows, out_features, in_features)  # the unfused path's product kernel too
    cfg = epilogue_config(rows, out_features, in_features, head_dim, fused_norm)
    if not (on_gpu(x) and skinny) or cfg is None or x.dim() != 2 or not x.is_contiguous():
        qkv, new_residual = norm_linear(x, residual, norm_weight, eps, weight, bias)
        q = norm_rope_store(qkv, num_heads, num_kv_heads, q_weight, k_weight, qk_eps, cos, sin, k_cache, v_cache,
                            slot_mapping, k_scale, v_scale)  # fmt: skip
        return q, new_residual
    if fused_norm:
        inp, (norm, new_residual) = x, _fused_norm(x, residual, norm_weight, eps)
    else:
        inp, new_residual = (
            (rmsnorm(x, norm_weight, eps), x) if residual is None else fused_add_rmsnorm(x, residual, norm_weight, eps)
        )
        norm = None
    q = torch.empty(rows, num_heads, head_dim, dtype=x.dtype, device=x.device)  # (T, Hq, D)
    epi = QkvEpilogue(q, num_heads, num_kv_heads, q_weight, k_weight, qk_eps, cos, sin, k_cache, v_cache,
                      slot_mapping, k_scale, v_scale)  # fmt: skip
    skinny_linear(inp.contiguous(), weight, bias, cfg, norm=norm, epilogue=epi)
    return q, new_residual

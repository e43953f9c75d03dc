"""Varlen paged attention for mixed batches (prefill chunks over cached prefixes and decode rows): Triton.

Algorithm (flash-attention 2 over a paged cache, GQA packed). Sequence b feeds q_len = cu[b+1] - cu[b] query
tokens at positions L - q_len .. L - 1 (L = seq_lens[b]); this step's K/V are already in the cache, so every
key is read through the block table. The grid is (query tiles, B, Hkv). A program owns BLOCK_M rows = TOKENS
query tokens x the G = Hq / Hkv query heads of KV head h (row r is token r // G, head h * G + r % G), so each
K/V tile is read once for the whole group, and a decode row (q_len 1) fills G rows instead of one.
Program (i, b, h) takes query tile ceil(q_len / TOKENS) - 1 - i (the longest, last tiles start first) and exits
when that is negative; it then walks key tiles of BLOCK_N tokens with an online softmax in float32 (base 2):
  - keys below the tile's first query position + 1 are visible to every row: no mask;
  - keys from there to its last query position are masked causally (key position <= query position).
With a sliding window of w tokens (``window``, a compile-time constant) the row at position p sees keys
p - w + 1 .. p: the key tiles wholly before the tile's first row's window (key < first position - w + 1) are never
read, the tiles from there to where the last row's window starts are masked by the window too, then come the
tiles every row sees whole (if any) and the causal ones as above.
The grid's first dimension comes from max_seqlen_q (a host int), so this launcher is for non-decode steps;
all-decode steps belong to fnvllm.kernels.decode_attention.

Inside a CUDA graph the grid cannot follow the step, so a captured mixed step passes a *work list* instead
(``prefill_work.prefill_work_list``): row w of an (W, 2) int32 array names the sequence and the tile counter
(the i above) of program w, the grid is (W, Hkv), and rows past the step's tiles ask for a tile counter no
sequence reaches (``W``), so their programs exit at once. A graph sized for its token bucket (T tokens, B
sequences) needs at most T // TOKENS + B rows: sequence b has ceil(q_len_b / TOKENS) <= q_len_b // TOKENS + 1
tiles.

Worked example (G 2, BLOCK_M 16 -> TOKENS 8, BLOCK_N 16): sequence b has a cached prefix of 20 tokens and feeds
12 (positions 20..31, L 32). Its two query tiles: tile 1 (tokens 8..11, positions 28..31) runs first, with keys
0..15 unmasked and keys 16..31 masked; tile 0 (positions 20..27) reads keys 0..15 unmasked, 16..27 masked.
A decode row with L 5 has one tile: 2 live rows (its token x 2 heads), keys 0..4 under the mask.
With a window of 10 tokens, tile 1 (positions 28..31) sees keys 19..31: it never reads keys 0..15 (BLOCK_N 16:
19 // 16 * 16 = 16), and reads keys 19..31 of tile 16..31 under the mask (no whole tile is in every row's window).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from fnvllm.kernels.attention import AttentionMetadata, check_window, paged_attention_ref
from fnvllm.kernels.decode_attention import (
    attend_tile,
    check_out,
    check_paged_qkv,
    check_scale,
    dot_precision,
    fp8_compute_fp16,
    kv_tile_offsets,
    load_kv_tile,
    upcast_dot,
)
from fnvllm.kernels.fp8 import check_kv_scales
from fnvllm.kernels.prefill_work import PREFILL_BLOCK_M

_LOG2E = math.log2(math.e)
_M0 = tl.constexpr(-1.0e30)  # the running max's start under a sliding window: finite, below any scaled score


@dataclasses.dataclass(frozen=True)
class PrefillKernelConfig:
    """Launch knobs of the prefill kernel; every launcher default comes from DEFAULT_PREFILL_CONFIG.

    block_m: query rows per program (tokens x G heads; a power of two >= 16 and >= G).
    block_n: keys per tile (a power of two >= 16).
    num_warps / num_stages: Triton launch options (stages pipeline the key-tile loop through shared memory).
    """

    block_m: int = PREFILL_BLOCK_M
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 4


# Why these defaults: measured, not guessed. benchmarks/bench_attention.py (d) sweeps the knobs on an H200
# (D 128, bf16, a mixed 8192-token batch; BENCHMARKS.md, 2026-11-30): 64 x 32 tiles with 4 warps and 4 stages
# reached 67.1 TFLOP/s, the flash-attention-2-style 128 x 64 / 8 warps / 3 stages 39.6. Smaller tiles give
# more programs on the 132 SMs for the short chunks a serving batch has (a few hundred tokens per sequence),
# and the 4-stage pipeline of 16 KiB K+V tiles hides the paged (gathered) loads.
DEFAULT_PREFILL_CONFIG = PrefillKernelConfig()


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Torch reference with the same arguments (attention.paged_attention_ref underneath); returns (T, Hq, D)."""
    meta = AttentionMetadata(
        positions=torch.empty(q.shape[0], dtype=torch.int64, device=q.device),  # unused by the reference
        slot_mapping=torch.empty(q.shape[0], dtype=torch.int64, device=q.device),  # unused by the reference
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=int(seq_lens.max()),
        block_size=k_cache.shape[1],
    )
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window)


@triton.jit
def _attend_masked_tile(
    q, q_pos, m, l, acc, t0, kv_lo, kv_end, table_row, kv_head, k_cache_ptr, v_cache_ptr, scale_log2,
    stride_cb, stride_ct, stride_ch, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """``attend_tile`` of rows q (BLOCK_M, D) at positions q_pos (BLOCK_M,) over the key tile t0 .. t0 + BLOCK_N - 1,
    masked causally (key <= q_pos) and, with a WINDOW, to q_pos - key < WINDOW; keys outside kv_lo .. kv_end - 1
    are not read. Returns the new (m, l, acc)."""
    key = t0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
    offs = kv_tile_offsets(table_row, t0, kv_end, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, BLOCK_N)
    live = key < kv_end  # (BLOCK_N,)
    if WINDOW is not None:
        live = live & (key >= kv_lo)
    k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, offs, live, HEAD_DIM)
    k, v = k.to(q.dtype), v.to(q.dtype)  # e4m3 -> q's dtype is exact; a no-op for other caches
    visible = (key[None, :] <= q_pos[:, None]) & live[None, :]  # (BLOCK_M, BLOCK_N)
    if WINDOW is not None:
        visible = visible & (key[None, :] > q_pos[:, None] - WINDOW)
    return attend_tile(q, k, v, visible, m, l, acc, scale_log2, True, True, DOT_PRECISION, UPCAST_DOT)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,  # (Hkv,) float32 dequantization scales of an FP8 cache (unread otherwise)
    v_scale_ptr,
    scale_log2,  # scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_FP16: tl.constexpr,
    work_ptr=None,  # (W, 2) int32 (sequence, tile counter) per program, when USE_WORK
    USE_WORK: tl.constexpr = False,
    WINDOW: tl.constexpr = None,  # a sliding window in tokens (int >= 1), None for full attention
):
    """Causal attention of one query tile x KV group of sequence program_id(1) over its paged keys (with
    USE_WORK: of the sequence and tile that row program_id(0) of the work list names; KV head program_id(1)).

    KV_FP8: e4m3 caches, widened to q's dtype in registers, their scales folded into the softmax scale (keys)
    and the output (values), as in the decode kernel; Q_FP16 converts q to float16 first (decode_attention's
    ``fp8_compute_fp16``).

    WINDOW: the row at position q_pos sees keys q_pos - WINDOW + 1 .. q_pos only; the key tiles before the tile's
    first row's window are skipped (never read), those where some row's window starts are masked."""
    if USE_WORK:
        seq = tl.load(work_ptr + 2 * tl.program_id(0))
        counter = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
        kv_head = tl.program_id(1)
    else:
        seq = tl.program_id(1)
        counter = tl.program_id(0)
        kv_head = tl.program_id(2)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    tile = tl.cdiv(q_len, TOKENS) - 1 - counter
    if tile >= 0:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # keys cached before this chunk
        r = tl.arange(0, BLOCK_M)
        tok = tile * TOKENS + r // GROUP  # (BLOCK_M,) token of each row within the chunk
        heads = kv_head * GROUP + r % GROUP  # (BLOCK_M,) query head of each row
        row_mask = (r < TOKENS * GROUP) & (tok < q_len)
        q_pos = context + tl.minimum(tok, q_len - 1)  # (BLOCK_M,) (rows past the chunk: its last position)
        d = tl.arange(0, HEAD_DIM)
        rows = (q_begin + tok).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask[:, None])
        if Q_FP16:
            q = q.to(tl.float16)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if WINDOW is None:  # noqa: SIM108 (a compile-time branch)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        else:  # a row may meet whole tiles before its window: a finite start keeps exp2(m - m_new) a number
            m = tl.full([BLOCK_M], _M0, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
        kv_end = tl.minimum(context + (tile + 1) * TOKENS, seq_len)  # past the tile's last query position
        full_end = (context + tile * TOKENS + 1) // BLOCK_N * BLOCK_N  # keys below it are seen by every row
        full_lo = 0  # keys from it (to full_end) are seen by every row
        kv_lo = 0  # the first key any row sees
        if WINDOW is not None:  # rows see keys q_pos - WINDOW + 1 .. q_pos: tiles before kv_lo are never read
            kv_lo = tl.maximum(context + tile * TOKENS - WINDOW + 1, 0)
            full_lo = tl.minimum(tl.cdiv(tl.maximum(kv_end - WINDOW, 0), BLOCK_N) * BLOCK_N, full_end)
            for t0 in range(kv_lo // BLOCK_N * BLOCK_N, full_lo, BLOCK_N):
                m, l, acc = _attend_masked_tile(
                    q, q_pos, m, l, acc, t0, kv_lo, kv_end, table_row, kv_head, k_cache_ptr, v_cache_ptr, scale_log2,
                    stride_cb, stride_ct, stride_ch, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, UPCAST_DOT, WINDOW,
                )  # fmt: skip
        for t0 in range(full_lo, full_end, BLOCK_N):
            offs = kv_tile_offsets(
                table_row, t0, full_end, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE, BLOCK_N
            )
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, offs, t0 + tl.arange(0, BLOCK_N) < full_end, HEAD_DIM)
            k, v = k.to(q.dtype), v.to(q.dtype)  # e4m3 -> q's dtype is exact; a no-op for other caches
            m, l, acc = attend_tile(q, k, v, 0, m, l, acc, scale_log2, False, True, DOT_PRECISION, UPCAST_DOT)
        for t0 in range(full_end, kv_end, BLOCK_N):
            m, l, acc = _attend_masked_tile(
                q, q_pos, m, l, acc, t0, kv_lo, kv_end, table_row, kv_head, k_cache_ptr, v_cache_ptr, scale_log2,
                stride_cb, stride_ct, stride_ch, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, UPCAST_DOT, WINDOW,
            )  # fmt: skip
        out = acc / l[:, None]  # (BLOCK_M, D)
        if KV_FP8:
            out = out * tl.load(v_scale_ptr + kv_head)
        out_offs = rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of q (T, Hq, D) over the paged caches; returns (T, Hq, D) in q's dtype.
    FP8 (float8_e4m3fn) caches need k_scale and v_scale, (Hkv,) float32. window: a sliding window in tokens (the
    query at position p sees keys p - window + 1 .. p; the tiles before are not read), None for full attention.

    cu_seqlens_q (B+1,) int32, seq_lens (B,) int32 (context after this step, >= each q_len), block_tables
    (B, max_blocks) int32; max_seqlen_q (a host int, >= every q_len) sizes the grid, unless ``work`` (a
    ``prefill_work.prefill_work_list`` on the device, built for the default block_m) does: then the launch
    depends on shapes only and can be captured in a CUDA graph. Knobs left None come from DEFAULT_PREFILL_CONFIG.
    """
    given = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg = dataclasses.replace(DEFAULT_PREFILL_CONFIG, **{k: v for k, v in given.items() if v is not None})
    _check_prefill_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, out, cfg)
    check_scale(scale)
    check_kv_scales(k_cache, k_scale, v_scale)
    check_window(window)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tokens = cfg.block_m // group
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if work is not None:
        _check_work(work, cfg.block_m)
        grid: tuple[int, ...] = (work.shape[0], num_kv_heads)
    else:
        grid = (triton.cdiv(max_seqlen_q, tokens), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        seq_lens if k_scale is None else k_scale,  # any pointer where the kernel reads no scale
        seq_lens if v_scale is None else v_scale,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        GROUP=group,
        TOKENS=tokens,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.device),
        KV_FP8=k_scale is not None,
        Q_FP16=fp8_compute_fp16(q, k_cache),
        work_ptr=work,
        USE_WORK=work is not None,
        WINDOW=window,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _check_work(work: torch.Tensor, block_m: int) -> None:
    """Raise ValueError unless ``work`` is a contiguous (W, 2) int32 work list for the default block_m."""
    if work.dim() != 2 or work.shape[1] != 2 or work.dtype != torch.int32 or not work.is_contiguous():
        raise ValueError(f"work must be a contiguous (W, 2) int32 tensor, got {tuple(work.shape)} {work.dtype}")
    if block_m != PREFILL_BLOCK_M:
        raise ValueError(f"a work list is built for block_m {PREFILL_BLOCK_M}, got {block_m}")


def _check_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    out: torch.Tensor | None,
    cfg: PrefillKernelConfig,
) -> None:
    """Raise ValueError naming the argument when shapes, dtypes or knobs do not fit (reads no device values)."""
    check_paged_qkv(q, k_cache, v_cache)
    group = q.shape[1] // k_cache.shape[2]
    for name, value in (("block_m", cfg.block_m), ("block_n", cfg.block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if cfg.block_m < group:
        raise ValueError(f"block_m {cfg.block_m} must be >= the GQA group size {group} (query heads per KV head)")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be contiguous (B,) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype != torch.int32 or not cu_seqlens_q.is_contiguous():
        raise ValueError(
            f"cu_seqlens_q must be contiguous ({num_seqs + 1},) int32, got {tuple(cu_seqlens_q.shape)} "
            f"{cu_seqlens_q.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be ({num_seqs}, max_blocks) int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be a host int >= 1, got {max_seqlen_q!r}")
    check_out(out, q)

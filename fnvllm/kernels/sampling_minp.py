"""Min-p-only rows at full GPU parallelism: the kept mass per chunk on a (rows, chunks) grid, then one short draw.

A row whose only filter is min-p keeps the tokens whose weight relative to its largest scaled logit reaches min_p:

    keep v  iff  e_v = exp(s_v - M) >= min_p,      s = x * (1 / T),  M = max_v s_v

and draws the first token (ids ascending) whose running kept weight exceeds u * (kept mass). ``sample_rows``
already knows M (``RowSampling.drawn[1]``), u (``drawn[0]``) and every chunk's maximum (plane 0 of its chunk
summaries). ``fnvllm.kernels.sampling_filters.filtered_pick`` gives each such row ONE program that streams the row's
live chunks twice (kept mass, then the draw): 256 programs for a 132-SM GPU, latency-bound (307 us per call at 256
flat rows x 151,936 bf16 on the H200, six times the 50 us of ``sample_rows``' own full read). Here:

    pass A, grid (F, C): program (i, c) writes chunk c's kept mass  sum_{v in c, e_v >= min_p} e_v  of filtered row
        i, exiting without reading the logits (mass 0) when the chunk's maximum m_c cannot reach the threshold
        (exp(m_c - M) < min_p);
    pass B, grid (F,): row i adds up its chunk masses (total K), takes the first chunk whose running mass exceeds
        u * K, re-reads only that chunk and draws the token inside it at the remainder.

Measured on the H200 (benchmarks/bench_sampling_minp.py, 2026-12-02 14:10), device us per sampling call with the
calls queued behind a GPU sleep (the host's launch time hidden), min_p 0.05 at T 0.6 against temperature alone:

    256 rows x 151,936 bf16, flat (std 0.64):  filtered_pick 362.7, this route 90.1, temperature only 56.3
    256 rows, std 3:                           182.0, 73.5, 56.1
    64 rows, flat / std 3:                     155.7 / 90.4, 31.0 / 28.2, 18.2 / 18.2

The draw was also tried inside pass A's grid (the last (i, c) program of each row to finish, counted on an arrival
counter, drawing the row: one launch fewer for the host to issue): slower on the device everywhere (110.1 against
93.4 us at 256 flat rows, 8 warps; 34.3 against 31.3 at 64), so pass B keeps its own launch. 4 warps per program
beat 8 by ~3 % at 256 rows (90.1 against 93.4 flat, 73.5 against 76.2 std 3).

Worked example (chunks of 4, T 1, min_p 0.25, u 0.6): s = (0 -1 -3 0 | -2 -1 -5 -5 | -4 -6 -5 -9), M = 0, so the
threshold is s >= ln 0.25 = -1.39. Chunk maxima 0, -1, -4: chunk 2 exits (e^-4 < 0.25). Masses: chunk 0 keeps
tokens 0, 1, 3: 1 + e^-1 + 1 = 2.368; chunk 1 keeps token 5: e^-1 = 0.368; total K = 2.736, u K = 1.642. The
running masses are 2.368 > 1.642 at chunk 0, remainder 1.642; inside it the running kept weights are 1, 1.368,
1.368, 2.368, first above 1.642 at token 3.

Same uniforms, same tokens as ``filtered_pick`` and the torch reference ``filtered_sample_ref`` (which this module
re-exports), up to float32 rounding of the kept mass: chunk masses are summed in registers and the chunk found by
their prefix sum, where ``filtered_pick`` sums block by block and the reference in float64. A uniform whose target
rounds past every chunk lands in the last chunk with kept mass, and past every token of a chunk on its last kept
token (never on a dropped one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.sampling import CHUNK, check_row_sources
from fnvllm.kernels.sampling_ref import filtered_sample_ref

__all__ = ["NUM_WARPS", "filtered_sample_ref", "minp_pick"]

# Warps per program of both passes (4096 bf16 per (row, chunk) program at sample_rows' chunk).
# 4 measured ~3 % faster than 8 at 256 rows on the H200 (module doc).
NUM_WARPS = 4


@triton.jit
def _kept_weights(row_ptr, cols, vocab_size, scale, top, min_p):
    """exp(s - M) of the tokens ``cols`` of a row where it reaches min_p, else 0 (also past the vocabulary)."""
    mask = cols < vocab_size
    s = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * scale + 0.0
    e = tl.exp(s - top)
    return tl.where(mask & (e >= min_p), e, 0.0)


@triton.jit
def _chunk_mass(i, c, logits_ptr, rows_ptr, src_ptr, prog_ptr, stats_ptr, scale_ptr, min_p_ptr, drawn_ptr,
                masses_ptr, stride_row, vocab_size, num_chunks, num_rows, CHUNK: tl.constexpr):  # fmt: skip
    """Store chunk c's kept mass of filtered row i (0 without reading it when its maximum is below the threshold)."""
    row = tl.load(rows_ptr + i).to(tl.int64)
    top = tl.load(drawn_ptr + num_rows + row)
    min_p = tl.load(min_p_ptr + row)
    chunk_max = tl.load(stats_ptr + tl.load(prog_ptr + i).to(tl.int64) * num_chunks + c)
    mass = tl.full([], 0.0, dtype=tl.float32)
    if tl.exp(chunk_max - top) >= min_p:
        row_ptr = logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mass = tl.sum(_kept_weights(row_ptr, cols, vocab_size, tl.load(scale_ptr + row), top, min_p), axis=0)
    tl.store(masses_ptr + i.to(tl.int64) * num_chunks + c, mass)


@triton.jit
def _draw_row(i, logits_ptr, rows_ptr, src_ptr, scale_ptr, min_p_ptr, drawn_ptr, masses_ptr, out_ptr, stride_row,
              vocab_size, num_chunks, num_rows, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):  # fmt: skip
    """Filtered row i's token from its chunk masses and one read of the chunk where u * (kept mass) falls."""
    row = tl.load(rows_ptr + i).to(tl.int64)
    ids = tl.arange(0, CHUNKS_PAD)
    at = masses_ptr + i.to(tl.int64) * num_chunks + ids
    masses = tl.load(at, mask=ids < num_chunks, other=0.0)
    target = tl.load(drawn_ptr + row) * tl.sum(masses, axis=0)
    running = tl.cumsum(masses, axis=0)
    last_live = tl.max(tl.where(masses > 0.0, ids, 0), axis=0)  # float32 sums may fall short of the target
    picked = tl.minimum(tl.min(tl.where(running > target, ids, CHUNKS_PAD), axis=0), last_live)
    remainder = target - tl.sum(tl.where(ids < picked, masses, 0.0), axis=0)
    cols = picked * CHUNK + tl.arange(0, CHUNK)
    row_ptr = logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row
    top = tl.load(drawn_ptr + num_rows + row)
    w = _kept_weights(row_ptr, cols, vocab_size, tl.load(scale_ptr + row), top, tl.load(min_p_ptr + row))
    crossing = tl.min(tl.where(tl.cumsum(w, axis=0) > remainder, cols, vocab_size), axis=0)
    last_kept = tl.max(tl.where(w > 0.0, cols, 0), axis=0)
    tl.store(out_ptr + row, tl.minimum(crossing, last_kept).to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks", "num_rows"])
def _mass_kernel(
    logits_ptr,
    rows_ptr,  # (F,) int32 or int64 batch rows
    src_ptr,  # (F,) their rows in logits
    prog_ptr,  # (F,) their rows in stats
    stats_ptr,  # (3, R, C) float32 chunk summaries of sample_rows; plane 0 holds the chunk maxima
    scale_ptr,  # (B,) float32 inverse temperatures (> 0 for these rows)
    min_p_ptr,  # (B,) float32
    drawn_ptr,  # (3, B) float32 each row's uniform and largest scaled logit (from sample_rows)
    masses_ptr,  # (F, C) float32: receives each chunk's kept mass
    stride_row,
    vocab_size,
    num_chunks,
    num_rows,
    CHUNK: tl.constexpr,
):
    """Pass A for program (i, c) (module doc)."""
    i, c = tl.program_id(0), tl.program_id(1)
    _chunk_mass(i, c, logits_ptr, rows_ptr, src_ptr, prog_ptr, stats_ptr, scale_ptr, min_p_ptr, drawn_ptr, masses_ptr,
                stride_row, vocab_size, num_chunks, num_rows, CHUNK)  # fmt: skip


@triton.jit(do_not_specialize=["num_chunks", "num_rows"])
def _draw_kernel(logits_ptr, rows_ptr, src_ptr, scale_ptr, min_p_ptr, drawn_ptr, masses_ptr, out_ptr, stride_row,
                 vocab_size, num_chunks, num_rows, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):  # fmt: skip
    """Pass B for filtered row program_id(0) (module doc)."""
    _draw_row(tl.program_id(0), logits_ptr, rows_ptr, src_ptr, scale_ptr, min_p_ptr, drawn_ptr, masses_ptr, out_ptr,
              stride_row, vocab_size, num_chunks, num_rows, CHUNK, CHUNKS_PAD)  # fmt: skip


_MASSES: dict[torch.device, torch.Tensor] = {}


def _masses(device: torch.device, numel: int) -> torch.Tensor:
    """float32 scratch of at least ``numel`` on ``device`` for the chunk masses, kept between calls (no allocator
    call per step; safe on one stream: a call's draw reads its masses before the next call's pass A writes)."""
    buf = _MASSES.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _MASSES[device] = buf
    return buf[:numel]


def _check_args(
    logits: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor, programs: torch.Tensor, stats: torch.Tensor,
    chunk: int,
) -> int:  # fmt: skip
    """The chunks of a row after checking ``minp_pick``'s arguments (ValueError naming the first one out of shape)."""
    if chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 2, got {chunk}")
    return check_row_sources(logits, rows, sources, programs, stats, chunk)


def minp_pick(
    logits: torch.Tensor,
    rows: torch.Tensor,
    sources: torch.Tensor,
    programs: torch.Tensor,
    stats: torch.Tensor,
    scale: torch.Tensor,
    min_p: torch.Tensor,
    drawn: torch.Tensor,
    out: torch.Tensor,
    chunk: int = CHUNK,
) -> None:
    """Overwrite out[0, rows] with a draw from each row's min-p filtered distribution (rows without a top-k or a
    top-p; ``filtered_pick``'s draws for the same uniforms, by a (rows, chunks) grid: module doc).

    logits (N, V): row sources[i] holds batch row rows[i], whose chunk summaries are stats[:, programs[i]] (what
    ``sample_rows`` returned for these logits, with the same ``chunk``); scale and min_p: (B,) float32 by batch row
    (scale > 0 on these rows); drawn (3, B) float32: what ``sample_rows`` recorded (uniforms, row maxima); out
    (2, B) int64. Two launches: the chunk masses on a (rows, chunks) grid, then the draw, one program per row.
    """
    num_chunks = _check_args(logits, rows, sources, programs, stats, chunk)
    num_filtered = rows.shape[0]
    if num_filtered == 0:
        return
    masses = _masses(logits.device, num_filtered * num_chunks)  # (F, C)
    chunks_pad = max(2, int(triton.next_power_of_2(num_chunks)))
    _mass_kernel[(num_filtered, num_chunks)](
        logits, rows, sources, programs, stats, scale, min_p, drawn, masses, logits.stride(0), logits.shape[1],
        num_chunks, out.shape[1], CHUNK=chunk, num_warps=NUM_WARPS,
    )  # fmt: skip
    _draw_kernel[(num_filtered,)](
        logits, rows, sources, scale, min_p, drawn, masses, out, logits.stride(0), logits.shape[1], num_chunks,
        out.shape[1], CHUNK=chunk, CHUNKS_PAD=chunks_pad, num_warps=NUM_WARPS,
    )  # fmt: skip

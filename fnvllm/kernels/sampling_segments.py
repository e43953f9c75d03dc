"""Top-k rows at full GPU parallelism: a candidate pass on a (rows, chunks) grid, then one short program per row.

``fnvllm.kernels.sampling_filters.filtered_pick`` gives each filtered row ONE program, which streams, one after
another, every chunk whose maximum reaches the row's floor (the k-th largest chunk maximum): on flat logits about
half the row (20 of 38 chunks of 4096 at top_k 20), ~80k values read by one program, 256 programs for a 132-SM
GPU: latency-bound (289 us per call at 256 rows on the H200, ~150 GB/s). Here the same candidates are found by
~10k programs at once, and the per-row work is done in registers:

    pass 0, grid (F,): row i's floor, the k-th largest of its chunk maxima (sorted in registers, once per row);
    pass 1, grid (F, C): program (i, c) exits at once unless chunk c's maximum reaches row i's floor; else it reads
        the chunk and writes its tokens at or above the floor (scaled logits s = x * (1 / T) and token ids, in id
        order) into segment (i, c) of a candidate buffer, SEGMENT slots padded with -inf, and their number
        (possibly above SEGMENT: then the segment is incomplete);
    pass 2, grid (F,): row i reads its segments (slot j of segment c is live when j < count c), sorts the live
        values for tau (the k-th largest value, then the nucleus of the top-k, as ``candidates_pick`` does), and
        draws from the kept tokens in id order at its uniform.

With SEGMENTS_LOOP, passes 0 and 1 are one launch on a (F, G) grid (``_segment_loop_kernel``): program (i, g)
sorts row i's chunk maxima for the floor itself, lists the row's live chunks (maximum at or above the floor) in
registers, and compacts those of rank g, g + G, ... one after another, SEGMENT_BLOCK tokens a step with the next
blocks already loading: no program for a dead chunk, no chain of dependent loads before each chunk, and fewer
registers a thread (more programs an SM). Same segments, same counts: the same tokens.

Every token at or above tau is at or above the floor (tau >= tau_k >= floor: the floor's count is >= k), so the
segments hold the whole kept set. No atomics: each segment belongs to one program, so a row's candidates stay in
ascending token id order. A row whose segments cannot hold its candidates -- a chunk with more than SEGMENT of
them (ties), a top-k above the chunk count (no floor from the chunk maxima) or no top-k -- is drawn by the
per-row path of ``filtered_pick`` in the same pass-2 program (``_pick_row``), so no candidate is ever lost.

Worked example (chunks of 4, top_k 2, SEGMENT 2): a row s = (0 3 1 0 | 2 2 2 0 | 1 0 0 0) has chunk maxima
(3, 2, 1), floor 2: chunk 2 exits, chunk 0 writes (3, -inf) and count 1, chunk 1 writes (2, 2) and count 3 > 2,
so that row falls back; with SEGMENT 4, chunk 1 writes (2, 2, 2, -inf), count 3, and the row sorts (3, 2, 2, 2):
tau_k = 2, and draws among tokens 1, 4, 5, 6.

Same uniforms, same tokens as ``filtered_pick`` and ``filtered_sample_ref``, up to float32 rounding of the kept
mass (pass 2 sums in registers where ``filtered_pick`` sums block by block; the reference sums in float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.sampling import _aligned
from fnvllm.kernels.sampling_filters import (
    BLOCK,
    CANDIDATES,
    CAPACITY,
    CHUNK,
    SEARCH_BLOCK,
    _key,
    _pick_row,
    check_pick_args,
)

__all__ = ["SEGMENT", "segmented_pick", "segmented_pick_graphed"]

SEGMENT = 16  # candidate slots per (row, chunk): iid flat rows at top_k 20 hold at most ~7 per chunk
# The candidate pass by ``_segment_loop_kernel`` (True) instead of ``_floor_kernel`` + ``_segment_kernel`` (one
# program per (row, chunk), 97 registers a thread at 8 warps, so 2 programs an SM, each waiting on a chain of 4
# dependent loads before its chunk's, and half the programs only to find their chunk dead). Its knobs: programs per
# row (each takes every SEGMENT_PROGRAMS-th of the row's live chunks; 0: SEGMENT_TOTAL programs in all), warps,
# tokens a step, blocks loaded ahead of the one being compacted, the floor sorted in each program from the row's
# chunk maxima (no _floor_kernel launch), and SKIP_EMPTY (``_compact_block``). Measured on the H200
# (benchmarks/bench_sampling_topk.py, final call A of 2026-12-02, CUDA graphs), device us of the top-k redraw (both
# passes) at the preset, grid kernel -> loop kernel at these defaults: 256 flat rows 184.0 -> 37.6 (the candidate
# pass 170.5 -> 21.2 us, pass 2 16.2), 256 rows std 3 183.6 -> 37.4, 64 rows 52.3 -> 18.1 (std 3: 51.1 -> 18.3),
# top_k 50 on the fine chunks 103.0 -> 68.2; filtered_pick 291 / 270 / 133 / 320; sample_rows alone 54.8 (256 rows).
# The mid call's winner without SKIP_EMPTY (T1024 W2 B512 pre1) took 108.4; SKIP_EMPTY alone brought it to 49.9.
# Same tokens as the grid kernel in every case (3 seeded sets of uniforms each).
SEGMENTS_LOOP = True
SEGMENT_PROGRAMS = 0
SEGMENT_TOTAL = 4096
SEGMENT_WARPS = 1
SEGMENT_PREFETCH = 2  # blocks loaded ahead: 0, 1 or 2
SEGMENT_BLOCK = 256  # tokens per step of a program (at most the chunk: a chunk is compacted block after block)
FOLD_FLOOR = True
SKIP_EMPTY = True  # count a block first; write its candidates one by one (``_compact_block``)
PICK_WARPS = 8  # warps of pass 2's programs (one a row: the draw from the segments, or the per-row fallback)


@triton.jit(do_not_specialize=["num_chunks", "num_filtered"])
def _floor_kernel(
    rows_ptr,  # (F,) int32 or int64 batch rows
    prog_ptr,  # (F,) their rows in stats
    stats_ptr,  # (3, R, C) float32 chunk summaries; plane 0 holds the chunk maxima of the scaled logits
    top_k_ptr,  # (B,) int32 or int64
    floors_ptr,  # (2, F) int32: receives each row's floor key, and 1 where it has one (1 <= k <= chunks)
    num_filtered,
    num_chunks,
    CHUNKS_PAD: tl.constexpr,
):
    """Row program_id(0)'s floor: the key of its k-th largest chunk maximum (the chunk maxima sorted in registers,
    once per row: a rank matrix in each of the (rows, chunks) programs cost O(chunks^2) each, 220 us per call at
    256 x 38 on the H200)."""
    i = tl.program_id(0)
    k = tl.load(top_k_ptr + tl.load(rows_ptr + i).to(tl.int64))
    ids = tl.arange(0, CHUNKS_PAD)
    at = stats_ptr + tl.load(prog_ptr + i).to(tl.int64) * num_chunks + ids
    m = tl.load(at, mask=ids < num_chunks, other=float("-inf")) + 0.0  # padding sorts last
    ranked = tl.sort(m, descending=True)  # (C,) best first, ties kept: the k-th is the k-th largest
    tl.store(floors_ptr + i, _key(tl.sum(tl.where(ids == k - 1, ranked, 0.0), axis=0) + 0.0))
    tl.store(floors_ptr + num_filtered + i, ((k >= 1) & (k <= num_chunks)).to(tl.int32))


@triton.jit(do_not_specialize=["num_chunks", "num_filtered"])
def _segment_kernel(
    logits_ptr,
    rows_ptr,  # (F,) int32 or int64 batch rows
    src_ptr,  # (F,) their rows in logits
    prog_ptr,  # (F,) their rows in stats
    stats_ptr,  # (3, R, C) float32 chunk summaries; plane 0 holds the chunk maxima of the scaled logits
    scale_ptr,  # (B,) float32 inverse temperatures
    floors_ptr,  # (2, F) int32 from _floor_kernel
    values_ptr,  # (F, C, SEGMENT) float32: receives the candidates' scaled logits, -inf past the count
    ids_ptr,  # (F, C, SEGMENT) int32: receives their token ids
    counts_ptr,  # (F, C) int32: receives each chunk's candidate count (0 for a chunk below the floor)
    stride_row,
    vocab_size,
    num_chunks,
    num_filtered,
    CHUNK: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    """Program (i, c): the tokens of chunk c of filtered row i at or above the row's floor (module doc)."""
    i, c = tl.program_id(0), tl.program_id(1)
    cell = i.to(tl.int64) * num_chunks + c
    chunk_max = tl.load(stats_ptr + tl.load(prog_ptr + i).to(tl.int64) * num_chunks + c)
    floor = tl.load(floors_ptr + i)
    if (tl.load(floors_ptr + num_filtered + i) != 0) & (_key(chunk_max + 0.0) >= floor):
        row = tl.load(rows_ptr + i).to(tl.int64)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mask = cols < vocab_size
        row_ptr = logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row
        s = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr + row) + 0.0
        at_least = mask & (_key(s) >= floor)
        pos = tl.cumsum(at_least.to(tl.int32), axis=0) - 1
        n = tl.sum(at_least.to(tl.int32), axis=0)
        slots = tl.arange(0, SEGMENT)
        tl.store(values_ptr + cell * SEGMENT + slots, float("-inf"), mask=slots >= n)
        tl.store(values_ptr + cell * SEGMENT + pos, s, mask=at_least & (pos < SEGMENT))
        tl.store(ids_ptr + cell * SEGMENT + pos, cols, mask=at_least & (pos < SEGMENT))
        tl.store(counts_ptr + cell, n)
    else:
        tl.store(counts_ptr + cell, 0)


@triton.jit
def _compact_block(x, cols, before, cell, vocab_size, scale, floor, values_ptr, ids_ptr, SEGMENT: tl.constexpr,
                   SKIP_EMPTY: tl.constexpr):  # fmt: skip
    """One block of a chunk, loaded (x, at token ids cols): write its tokens at or above key ``floor`` into
    segment ``cell`` after the ``before`` found in the chunk's earlier blocks, in id order (values and ids; no -inf
    padding: pass 2 reads only the first count slots); returns the chunk's count so far.

    SKIP_EMPTY: count first; a block with candidates (few: most blocks of a live chunk hold none) writes them one
    at a time, lowest id first, by two reductions each, with scalar stores; tokens are compared with the floor as
    floats (3 instructions a token fewer than keys; the same order here: no -0.0 after ``+ 0.0``, and a NaN logit
    flags its row non-finite). Without it, a scan over the block gives every candidate its slot and one scattered
    store writes them; but a scattered store takes a layout of one token a thread, so Triton moves the block (loaded
    8 tokens a thread) through shared memory and computes it twice (576 instructions a warp for a block of 512 at 2
    warps on sm90, against ~170 for an empty block here)."""
    s = x.to(tl.float32) * scale + 0.0
    if SKIP_EMPTY:  # noqa: SIM108 (as floats: the same as by keys but for a NaN, whose row is flagged non-finite)
        at_least = (cols < vocab_size) & (s >= _value(floor))
    else:
        at_least = (cols < vocab_size) & (_key(s) >= floor)
    flags = at_least.to(tl.int32)
    found = tl.sum(flags, axis=0)
    if SKIP_EMPTY:
        if found > 0:
            lowest = tl.min(cols, axis=0)  # candidates from this id on are not written yet
            for t in range(0, tl.minimum(found, SEGMENT - before)):
                token = tl.min(tl.where(at_least & (cols >= lowest), cols, 2147483647), axis=0)
                tl.store(values_ptr + cell * SEGMENT + before + t, tl.max(tl.where(cols == token, s, -float("inf")), 0))
                tl.store(ids_ptr + cell * SEGMENT + before + t, token)
                lowest = token + 1
    else:
        pos = before + tl.cumsum(flags, axis=0) - 1
        keep = at_least & (pos < SEGMENT)
        tl.store(values_ptr + cell * SEGMENT + pos, s, mask=keep)
        tl.store(ids_ptr + cell * SEGMENT + pos, cols, mask=keep)
    return before + found


@triton.jit
def _value(key):
    """The float32 of an int32 key of ``_key`` (its inverse)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _unit(live, rank, ids, g, step, u, offs, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Block u of program g's blocks (its chunks are the live ranks g, g + step, ...; CHUNK // BLOCK blocks each):
    its chunk id (0 past the live chunks) and its token ids."""
    blocks = CHUNK // BLOCK
    c = tl.sum(tl.where(live & (rank == g + (u // blocks) * step), ids, 0), axis=0)
    return c, c * CHUNK + (u % blocks) * BLOCK + offs


@triton.jit(do_not_specialize=["num_chunks", "num_filtered"])
def _segment_loop_kernel(
    logits_ptr,
    rows_ptr,  # (F,) int32 or int64 batch rows
    src_ptr,  # (F,) their rows in logits
    prog_ptr,  # (F,) their rows in stats
    stats_ptr,  # (3, R, C) float32 chunk summaries; plane 0 holds the chunk maxima of the scaled logits
    scale_ptr,  # (B,) float32 inverse temperatures
    top_k_ptr,  # (B,) int32 or int64 (read when FOLD_FLOOR)
    floors_ptr,  # (2, F) int32 from _floor_kernel (read unless FOLD_FLOOR)
    values_ptr,  # (F, C, SEGMENT) float32: receives the candidates' scaled logits (slots past the count: stale)
    ids_ptr,  # (F, C, SEGMENT) int32: receives their token ids
    counts_ptr,  # (F, C) int32: receives each chunk's candidate count (0 for a chunk below the floor)
    live_ptr,  # (1,) int32 when GRAPHED: rows i >= live_ptr[0] (a CUDA graph bucket's padding) compact nothing
    stride_row,
    vocab_size,
    num_chunks,
    num_filtered,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,  # tokens per step (divides CHUNK): a chunk is compacted block after block
    FOLD_FLOOR: tl.constexpr,  # the row's floor sorted here from its chunk maxima (no _floor_kernel launch)
    PREFETCH: tl.constexpr,  # blocks loaded ahead of the one being compacted: 0, 1 or 2
    SKIP_EMPTY: tl.constexpr,  # count each block first, write candidates one by one (_compact_block)
    GRAPHED: tl.constexpr = False,
):
    """Program (i, g) of a (F, G) grid: the candidates of the live chunks (maximum at or above the floor) of
    filtered row i of rank g, g + G, g + 2G, ... among them, in id order, BLOCK tokens a step (``_segment_kernel``'s
    work: no program for a dead chunk; the row's live chunks listed once in registers; module doc)."""
    i, g = tl.program_id(0), tl.program_id(1)
    step = tl.num_programs(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    row_ptr = logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row
    scale = tl.load(scale_ptr + row)
    ids = tl.arange(0, CHUNKS_PAD)
    m = tl.load(stats_ptr + tl.load(prog_ptr + i).to(tl.int64) * num_chunks + ids, mask=ids < num_chunks,
                other=float("-inf")) + 0.0  # fmt: skip
    if FOLD_FLOOR:
        k = tl.load(top_k_ptr + row)
        ranked = tl.sort(m, descending=True)  # as _floor_kernel
        floor = _key(tl.sum(tl.where(ids == k - 1, ranked, 0.0), axis=0) + 0.0)
        has = (k >= 1) & (k <= num_chunks)
    else:
        floor = tl.load(floors_ptr + i)
        has = tl.load(floors_ptr + num_filtered + i) != 0
    if GRAPHED:
        has = has & (i < tl.load(live_ptr))
    live = (_key(m) >= floor) & (ids < num_chunks) & has  # (CHUNKS_PAD,)
    flags = live.to(tl.int32)
    rank = tl.cumsum(flags, axis=0) - 1  # a live chunk's rank among the row's live chunks
    num_live = tl.sum(flags, axis=0)
    dead = (ids < num_chunks) & (flags == 0) & (ids * 0 + g == 0)  # program 0 of the row zeroes their counts
    cells = i.to(tl.int64) * num_chunks
    tl.store(counts_ptr + cells + ids, flags * 0, mask=dead)
    blocks = CHUNK // BLOCK
    mine = tl.where(g < num_live, (num_live - g + step - 1) // step, 0) * blocks  # this program's blocks
    offs = tl.arange(0, BLOCK)
    n = tl.full([], 0, dtype=tl.int32)  # the current chunk's candidates so far
    if PREFETCH == 0:
        for u in range(0, mine):
            c, cols = _unit(live, rank, ids, g, step, u, offs, CHUNK, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=0.0)
            n = _compact_block(x, cols, tl.where(u % blocks == 0, 0, n), cells + c, vocab_size, scale, floor,
                               values_ptr, ids_ptr, SEGMENT, SKIP_EMPTY)  # fmt: skip
            if u % blocks == blocks - 1:
                tl.store(counts_ptr + cells + c, n)
    elif PREFETCH == 1:
        c, cols = _unit(live, rank, ids, g, step, 0, offs, CHUNK, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < tl.where(mine > 0, vocab_size, 0), other=0.0)
        for u in range(0, mine):
            c_next, cols_next = _unit(live, rank, ids, g, step, u + 1, offs, CHUNK, BLOCK)
            end = tl.where(u + 1 < mine, vocab_size, 0)  # nothing past the program's last block
            x_next = tl.load(row_ptr + cols_next, mask=cols_next < end, other=0.0)
            cols = c * CHUNK + (u % blocks) * BLOCK + offs
            n = _compact_block(x, cols, tl.where(u % blocks == 0, 0, n), cells + c, vocab_size, scale, floor,
                               values_ptr, ids_ptr, SEGMENT, SKIP_EMPTY)  # fmt: skip
            if u % blocks == blocks - 1:
                tl.store(counts_ptr + cells + c, n)
            x, c = x_next, c_next
    else:  # two blocks ahead
        c, cols = _unit(live, rank, ids, g, step, 0, offs, CHUNK, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < tl.where(mine > 0, vocab_size, 0), other=0.0)
        c1, cols1 = _unit(live, rank, ids, g, step, 1, offs, CHUNK, BLOCK)
        x1 = tl.load(row_ptr + cols1, mask=cols1 < tl.where(mine > 1, vocab_size, 0), other=0.0)
        for u in range(0, mine):
            c2, cols2 = _unit(live, rank, ids, g, step, u + 2, offs, CHUNK, BLOCK)
            x2 = tl.load(row_ptr + cols2, mask=cols2 < tl.where(u + 2 < mine, vocab_size, 0), other=0.0)
            cols = c * CHUNK + (u % blocks) * BLOCK + offs
            n = _compact_block(x, cols, tl.where(u % blocks == 0, 0, n), cells + c, vocab_size, scale, floor,
                               values_ptr, ids_ptr, SEGMENT, SKIP_EMPTY)  # fmt: skip
            if u % blocks == blocks - 1:
                tl.store(counts_ptr + cells + c, n)
            x, c, x1, c1 = x1, c1, x2, c2


@triton.jit
def _draw_segments(i, row, values_ptr, ids_ptr, counts_ptr, top_k_ptr, top_p_ptr, min_p_ptr, drawn_ptr, out_ptr,
                   num_chunks, SEGMENT: tl.constexpr, SLOTS: tl.constexpr):  # fmt: skip
    """Threshold, then draw, for filtered row i (batch row ``row``) from its live segment slots, all in registers."""
    f = tl.arange(0, SLOTS)  # flat slot: segment f // SEGMENT, slot f % SEGMENT
    chunk = f // SEGMENT
    count = tl.load(counts_ptr + i.to(tl.int64) * num_chunks + chunk, mask=chunk < num_chunks, other=0)
    live = (chunk < num_chunks) & (f % SEGMENT < count)
    at = i.to(tl.int64) * num_chunks * SEGMENT + f
    s = tl.load(values_ptr + at, mask=live, other=float("-inf"))  # (SLOTS,) id order, -inf where not live
    top = tl.max(s, axis=0)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    v = tl.sort(s, descending=True)  # (SLOTS,) best first
    tau_k = tl.sum(tl.where(f == k - 1, v, 0.0), axis=0)
    e = tl.exp(v - top)  # 0 at the -inf padding
    target = p * tl.sum(tl.where(v >= tau_k, e, 0.0), axis=0)
    first = tl.sum((tl.cumsum(e, axis=0) < target).to(tl.int32), axis=0)  # ranks before the mass reaches it
    tau_p = tl.max(tl.where(f == first, v, float("-inf")), axis=0)  # -inf when rounding ran past the top-k
    tau = tl.where(p < 1.0, tl.maximum(tau_k, tau_p), tau_k)
    w = tl.exp(s - top)
    w = tl.where(live & (s >= tau) & (w >= tl.load(min_p_ptr + row)), w, 0.0)  # kept weights, in id order
    target = tl.load(drawn_ptr + row) * tl.sum(w, axis=0)
    crossing = tl.min(tl.where(tl.cumsum(w, axis=0) > target, f, SLOTS), axis=0)
    picked = tl.minimum(crossing, tl.max(tl.where(w > 0.0, f, 0), axis=0))  # float32 sums may fall short
    tl.store(out_ptr + row, tl.load(ids_ptr + i.to(tl.int64) * num_chunks * SEGMENT + picked).to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks", "num_rows"])
def _segments_pick_kernel(
    logits_ptr,
    rows_ptr,
    src_ptr,
    prog_ptr,
    stats_ptr,
    scale_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    drawn_ptr,  # (3, B) float32 each row's uniform, largest scaled logit and partition sum (from sample_rows)
    out_ptr,  # (2, B) int64: token ids are written to plane 0
    values_ptr,
    ids_ptr,
    counts_ptr,
    scratch_ptr,  # (F, CAP) float32: the fallback's compacted candidates
    live_ptr,  # (1,) int32 when GRAPHED: the live rows n (replaces num_rows)
    stride_row,
    vocab_size,
    num_chunks,
    num_rows,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    SEGMENT: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    G: tl.constexpr,
    CAP: tl.constexpr,
    GRAPHED: tl.constexpr = False,
):
    """Filtered row program_id(0): from its segments when they hold every candidate, else by ``_pick_row``.
    GRAPHED (a CUDA graph bucket's every row): only rows below the live count n with a top-k draw; the others keep
    the token ``sample_rows`` drew."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    k = tl.load(top_k_ptr + row)
    take = i >= 0  # every program (a tensor)
    if GRAPHED:
        num_rows = tl.load(live_ptr)
        take = (i < num_rows) & (k >= 1)
    chunk_ids = tl.arange(0, CHUNKS_PAD)
    counts = tl.load(counts_ptr + i.to(tl.int64) * num_chunks + chunk_ids, mask=chunk_ids < num_chunks, other=0)
    if take & (k >= 1) & (k <= num_chunks) & (tl.max(counts, axis=0) <= SEGMENT):
        _draw_segments(i, row, values_ptr, ids_ptr, counts_ptr, top_k_ptr, top_p_ptr, min_p_ptr, drawn_ptr, out_ptr,
                       num_chunks, SEGMENT, SLOTS)  # fmt: skip
    elif take:
        _pick_row(
            row,
            logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row,
            stats_ptr + tl.load(prog_ptr + i).to(tl.int64) * num_chunks,
            scratch_ptr + i.to(tl.int64) * CAP,
            scale_ptr, top_k_ptr, top_p_ptr, min_p_ptr, drawn_ptr, out_ptr, vocab_size, num_chunks, num_rows,
            CHUNK, CHUNKS_PAD, BLOCK, SEARCH_BLOCK, G, CAP,
        )  # fmt: skip


def segmented_pick(
    logits: torch.Tensor,
    rows: torch.Tensor,
    sources: torch.Tensor,
    programs: torch.Tensor,
    stats: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    drawn: torch.Tensor,
    out: torch.Tensor,
    chunk: int = CHUNK,
    segment: int | None = None,
    block: int = BLOCK,
    capacity: int = CAPACITY,
    *,
    live: torch.Tensor | None = None,
) -> None:
    """``fnvllm.kernels.sampling_filters.filtered_pick`` (same arguments, same draws) by two launches (SEGMENTS_LOOP
    with FOLD_FLOOR: the candidate pass on a (rows, programs per row) grid, then one program per row) or three (the
    floors, one program per row; the candidate pass on a (rows, chunks) grid; one program per row; module doc).
    segment (a power of two; None: SEGMENT): the candidate slots per (row, chunk); a row with more candidates
    in one chunk falls back to ``filtered_pick``'s per-row path (block and capacity are that path's). live: the
    live-row count on the device (``segmented_pick_graphed``), None for a host-sized call."""
    segment = SEGMENT if segment is None else segment
    num_chunks = check_pick_args(logits, rows, sources, programs, stats, top_k, chunk)
    for name, value in (("block", block), ("chunk", chunk), ("capacity", capacity), ("segment", segment)):
        if value < 2 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 2, got {value}")
    num_filtered = rows.shape[0]
    if num_filtered == 0:
        return
    capacity = min(capacity, max(2, int(triton.next_power_of_2(logits.shape[1]))))  # no more than the row holds
    cells = num_filtered * num_chunks
    values, ids, counts, scratch, floors = _views(
        (cells * segment, cells * segment, cells, num_filtered * capacity, 2 * num_filtered), logits.device
    )  # (F, C, SEGMENT) float32, (F, C, SEGMENT) int32, (F, C) int32, (F, capacity) float32, (2, F) int32
    values, scratch = values.view(torch.float32), scratch.view(torch.float32)
    chunks_pad = max(2, int(triton.next_power_of_2(num_chunks)))
    if SEGMENTS_LOOP or live is not None:  # the graphed pass gates its padding rows in the loop kernel only
        _candidates_by_loop(logits, rows, sources, programs, stats, scale, top_k, floors, values, ids, counts, chunk,
                            segment, live)  # fmt: skip
    else:
        _floor_kernel[(num_filtered,)](
            rows, programs, stats, top_k, floors, num_filtered, num_chunks, CHUNKS_PAD=chunks_pad, num_warps=4
        )
        _segment_kernel[(num_filtered, num_chunks)](
            logits, rows, sources, programs, stats, scale, floors, values, ids, counts, logits.stride(0),
            logits.shape[1], num_chunks, num_filtered, CHUNK=chunk, SEGMENT=segment,
            num_warps=8 if chunk >= 2048 else 4,
        )  # fmt: skip
    _segments_pick_kernel[(num_filtered,)](
        logits, rows, sources, programs, stats, scale, top_k, top_p, min_p, drawn, out, values, ids, counts, scratch,
        rows if live is None else live, logits.stride(0), logits.shape[1], num_chunks,
        out.shape[-1] if live is None else 0, CHUNK=chunk, CHUNKS_PAD=chunks_pad,
        SEGMENT=segment, SLOTS=max(2, int(triton.next_power_of_2(num_chunks * segment))), BLOCK=min(block, chunk),
        SEARCH_BLOCK=min(SEARCH_BLOCK, block, chunk), G=CANDIDATES, CAP=capacity, num_warps=PICK_WARPS,
        GRAPHED=live is not None,
    )  # fmt: skip


def segmented_pick_graphed(
    logits: torch.Tensor,
    rows: torch.Tensor,
    stats: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    drawn: torch.Tensor,
    out: torch.Tensor,
    live: torch.Tensor,
    chunk: int = CHUNK,
) -> None:
    """``segmented_pick`` over every row of a CUDA graph bucket's logits (N, V), after ``fnvllm.kernels.sampling.
    sample_rows_graphed`` (whose chunk summaries ``stats``, uniforms and maxima ``drawn`` and samples ``out`` it
    reads): rows below ``live[0]`` whose top-k is >= 1 are redrawn with their top-k / top-p / min-p, the others keep
    their token. rows: (N,) int32 0..N-1. A row with 1 <= top-k <= the chunks draws exactly what ``segmented_pick``
    draws from the same summaries (the same segments: the grid has N rows instead of the filtered ones). chunk:
    the summaries' (``sample_rows_graphed``'s)."""
    if tuple(live.shape) not in ((1,), (2,)) or live.dtype != torch.int32:
        raise ValueError(f"live must be a (1,) or (2,) int32 tensor, got {tuple(live.shape)} {live.dtype}")
    segmented_pick(logits, rows, rows, rows, stats, scale, top_k, top_p, min_p, drawn, out, chunk, live=live)


def _candidates_by_loop(
    logits: torch.Tensor,
    rows: torch.Tensor,
    sources: torch.Tensor,
    programs: torch.Tensor,
    stats: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    floors: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    counts: torch.Tensor,
    chunk: int,
    segment: int,
    live: torch.Tensor | None = None,
) -> None:
    """The candidate pass by ``_segment_loop_kernel`` with the module's knobs (SEGMENTS_LOOP's comment); the floors
    by ``_floor_kernel`` first unless FOLD_FLOOR. live: rows >= live[0] compact nothing (``segmented_pick_graphed``)."""
    num_filtered, num_chunks = rows.shape[0], stats.shape[2]
    chunks_pad = max(2, int(triton.next_power_of_2(num_chunks)))
    if not FOLD_FLOOR:
        _floor_kernel[(num_filtered,)](
            rows, programs, stats, top_k, floors, num_filtered, num_chunks, CHUNKS_PAD=chunks_pad, num_warps=4
        )
    if SEGMENT_BLOCK < 2 or SEGMENT_BLOCK & (SEGMENT_BLOCK - 1):
        raise ValueError(f"SEGMENT_BLOCK must be a power of two >= 2, got {SEGMENT_BLOCK}")
    per_row = SEGMENT_PROGRAMS if SEGMENT_PROGRAMS > 0 else -(-SEGMENT_TOTAL // num_filtered)
    _segment_loop_kernel[(num_filtered, max(1, min(per_row, num_chunks)))](
        logits, rows, sources, programs, stats, scale, top_k, floors, values, ids, counts,
        rows if live is None else live, logits.stride(0), logits.shape[1], num_chunks, num_filtered, CHUNK=chunk,
        CHUNKS_PAD=chunks_pad, SEGMENT=segment, BLOCK=min(SEGMENT_BLOCK, chunk), FOLD_FLOOR=FOLD_FLOOR,
        PREFETCH=int(SEGMENT_PREFETCH), SKIP_EMPTY=SKIP_EMPTY, num_warps=SEGMENT_WARPS, GRAPHED=live is not None,
    )  # fmt: skip


def _views(sizes: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
    """int32 views of these sizes into one buffer, each starting at a multiple of 16 bytes (Triton compiles a kernel
    variant per pointer alignment: an offset that depends on the row count would compile mid-run)."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + _aligned(size, 4))
    flat = torch.empty(starts[-1], dtype=torch.int32, device=device)
    return [flat[at : at + size] for at, size in zip(starts, sizes, strict=False)]

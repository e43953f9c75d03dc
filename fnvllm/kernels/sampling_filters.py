"""Top-k / top-p / min-p per row, and each row's log-partition for logprobs: Triton kernels beside torch references.

Every filter keeps an upper set of the row's scaled logits s = x * (1 / T), so together they are one threshold:

    keep v  iff  s_v >= tau  and  exp(s_v - M) >= min_p,          M = max_v s_v
    tau_k = max{t : count(s >= t) >= k}                           the k-th largest value (ties all kept)
    tau   = max{t : mass(s >= t) >= top_p * mass(s >= tau_k)}     mass = sum of exp(s - M); tau >= tau_k

(tau is the nucleus of the top-k survivors: a token stays when the mass strictly above it is below top_p of
theirs.) Then u ~ U(0, 1) picks the first v whose running kept mass exceeds u * (kept mass), as in
``fnvllm.kernels.sampling``. Worked example: s = (2, 1, 0, 1) (M 2), top_k 3, top_p 0.5: tau_k = 1 (three tokens
>= 1), masses above t = 1: 1 + 2 e^-1 = 1.74 and above t = 2: 1 >= 0.5 * 1.74, so tau = 2 and token 0 alone stays.

One program per filtered row finds tau, reading only the chunks (of ``sample_rows``' chunk summaries) whose
maximum can reach the current lower bound:

    top-k rows: a floor with count >= k (the k-th largest chunk maximum; when k exceeds the chunks, one count
        round of the search below), then the tokens at or above it are compacted (at most CAPACITY, usually a
        few dozen) and sorted in registers: tau_k, and tau_p from the running mass of the sorted candidates;
    top-p rows without a top-k (or a top-k row with too many candidates): a G-way search over the int32 keys that
        order float32 values like the values do. Each round streams the live chunks once and evaluates the mass
        (or count) at G candidate keys in the open range (lo, hi), g(lo) >= target > g(hi): the first round at
        values spread below the maximum, later ones evenly. lo becomes the last candidate that still reaches the
        target, hi one above the largest key below the first that does not, so a row whose top tokens stand apart
        settles in a few rounds (worst case about 32 / log2(G) + 1).

Then one pass sums the kept mass (min-p applied) and one more, stopping at the crossing chunk, draws the token.
Rows without a filter never enter this kernel. ``fnvllm.kernels.sampling_segments`` finds top-k rows' candidates on
a (rows, chunks) grid instead, and hands the rows its segments cannot hold to this per-row path (``_pick_row``).

The log-partition kernel gives log sum exp(x) of the raw logits for the rows that asked for logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.sampling import check_row_sources
from fnvllm.kernels.sampling_ref import filtered_sample_ref, log_partition_ref

__all__ = ["candidates_pick", "filtered_pick", "filtered_sample_ref", "log_partition", "log_partition_ref"]

CHUNK = 4096  # = fnvllm.kernels.sampling.CHUNK: the chunks whose maxima let a pass skip them
BLOCK = 2048  # tokens per streamed block of a row
SEARCH_BLOCK = 512  # tokens per block of a search round, which holds (CANDIDATES, SEARCH_BLOCK) temporaries
CANDIDATES = 16  # keys evaluated per search round
CAPACITY = 1024  # top-k candidates a row may compact and sort instead of searching


@triton.jit
def _key(s):
    """int32 keys ordered like float32 values (negative values have their magnitude bits flipped)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _live(chunk_max_ptr, c, top, lo, min_p):
    """Whether chunk c can hold a kept token: its largest scaled logit reaches key lo and min_p."""
    m = tl.load(chunk_max_ptr + c)
    return (_key(m + 0.0) >= lo) & (tl.exp(m - top) >= min_p)


@triton.jit
def _search(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, hi, target, max_rounds,
            BY_MASS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """The largest key t in [lo, hi) (int64 scalars) with g(t) >= target, where g(t) is the mass (BY_MASS) or the
    count of the row's tokens whose key is >= t; requires g(lo) >= target > g(hi). Chunks whose maximum is below
    lo are skipped: they hold nothing at or above any candidate. Candidates are kept in (lo, hi), ascending.
    After max_rounds rounds, returns the lo reached so far (a key with g >= target, at or below the answer)."""
    j = tl.arange(0, G)
    # The first round tries values spread below the row's maximum (M - 0, M - 0.3, ... M - 135 in scaled logits,
    # ascending), where thresholds lie for real rows; later rounds split the key range evenly.
    by_value = _key(top - 0.75 * (tl.exp2((G - 1 - j) * 0.5) - 1.0) + 0.0).to(tl.int64)
    first = tl.full([], 1, dtype=tl.int32)
    rounds = tl.full([], 0, dtype=tl.int32)
    while (hi - lo > 1) & (rounds < max_rounds):
        rounds += 1
        even = lo + 1 + ((hi - lo - 2) * j) // (G - 1)
        clamped = tl.minimum(tl.maximum(by_value, lo + 1), hi - 1)
        cand = tl.where(first != 0, clamped, even).to(tl.int32)  # (G,) ascending, inside (lo, hi)
        first = first * 0
        g = tl.zeros([G], dtype=tl.float32)
        below = tl.full([G], -2147483648, dtype=tl.int32)  # largest key under each candidate
        for c in range(0, num_chunks):
            if _live(chunk_max_ptr, c, top, lo, 0.0):
                for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < vocab_size
                    s = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * scale + 0.0
                    keys = tl.where(mask, _key(s), -2147483648)  # a padding lane is below every candidate
                    ge = keys[None, :] >= cand[:, None]  # (G, BLOCK)
                    if BY_MASS:
                        g += tl.sum(tl.where(ge, tl.exp(s - top)[None, :], 0.0), axis=1)
                    else:
                        g += tl.sum(ge.to(tl.float32), axis=1)
                    below = tl.maximum(below, tl.max(tl.where(ge, -2147483648, keys[None, :]), axis=1))
        num_ok = tl.sum((g >= target).to(tl.int32), axis=0)  # g falls with the key: candidates 0..num_ok-1 reach it
        lo = tl.where(num_ok > 0, tl.sum(tl.where(j == num_ok - 1, cand, 0), axis=0).to(tl.int64), lo)
        hi = tl.where(num_ok < G, tl.sum(tl.where(j == num_ok, below, 0), axis=0).to(tl.int64) + 1, lo + 1)
    return lo


@triton.jit
def _kept(row_ptr, cols, vocab_size, scale, top, lo, min_p):
    """The kept weights exp(s - M) of one block of a row (0 outside the filters and the row)."""
    s = tl.load(row_ptr + cols, mask=cols < vocab_size, other=0.0).to(tl.float32) * scale + 0.0
    e = tl.exp(s - top)
    return tl.where((cols < vocab_size) & (_key(s) >= lo) & (e >= min_p), e, 0.0)


@triton.jit
def _kept_mass(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, min_p, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    """Sum of the row's kept weights (key >= lo, weight >= min_p), skipping chunks that keep nothing."""
    total = tl.full([], 0.0, dtype=tl.float32)
    for c in range(0, num_chunks):
        if _live(chunk_max_ptr, c, top, lo, min_p):
            for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
                total += tl.sum(_kept(row_ptr, start + tl.arange(0, BLOCK), vocab_size, scale, top, lo, min_p), axis=0)
    return total


@triton.jit
def _compact(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, out_ptr, CAP: tl.constexpr,
             CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Write the scaled logits of the row's tokens whose key is >= lo to out_ptr (the first CAP of them, in
    vocabulary order); returns how many there are."""
    n = tl.full([], 0, dtype=tl.int32)
    for c in range(0, num_chunks):
        if _live(chunk_max_ptr, c, top, lo, 0.0):
            for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < vocab_size
                s = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * scale + 0.0
                at_least = mask & (_key(s) >= lo)
                pos = n + tl.cumsum(at_least.to(tl.int32), axis=0) - 1
                tl.store(out_ptr + pos, s, mask=at_least & (pos < CAP))
                n += tl.sum(at_least.to(tl.int32), axis=0)
    return n


@triton.jit
def _sorted_threshold(values_ptr, n, k, p, top, CAP: tl.constexpr):
    """The key of tau (module doc) from n <= CAP compacted scaled logits holding every token at or above tau_k:
    sorted best first, tau_k is the k-th, and tau_p the first whose running mass reaches p of the top-k mass."""
    ids = tl.arange(0, CAP)
    v = tl.sort(tl.load(values_ptr + ids, mask=ids < n, other=float("-inf")), descending=True)  # (CAP,)
    tau_k = tl.sum(tl.where(ids == k - 1, v, 0.0), axis=0)
    e = tl.where(ids < n, tl.exp(v - top), 0.0)
    target = p * tl.sum(tl.where(v >= tau_k, e, 0.0), axis=0)
    first = tl.sum((tl.cumsum(e, axis=0) < target).to(tl.int32), axis=0)  # ranks before the mass reaches it
    tau_p = tl.max(tl.where(ids == first, v, float("-inf")), axis=0)  # -inf when rounding ran past the top-k
    return _key(tl.where(p < 1.0, tl.maximum(tau_k, tau_p), tau_k) + 0.0).to(tl.int64)


@triton.jit
def _top_k_floor(chunk_max_ptr, num_chunks, k, CHUNKS_PAD: tl.constexpr):
    """A key whose count is >= k: the k-th largest chunk maximum when k <= the chunks, else the lowest key."""
    ids = tl.arange(0, CHUNKS_PAD)
    m = tl.load(chunk_max_ptr + ids, mask=ids < num_chunks, other=float("-inf")) + 0.0
    rank = tl.sum((m[None, :] >= m[:, None]).to(tl.int32), axis=1)  # (C,) chunk maxima at or above each
    kth = tl.max(tl.where((ids < num_chunks) & (rank >= k), m, float("-inf")), axis=0)
    return tl.where(kth > float("-inf"), _key(kth).to(tl.int64), -2147483648)


@triton.jit
def _pick_row(row, row_ptr, chunk_max_ptr, values_ptr, scale_ptr, top_k_ptr, top_p_ptr, min_p_ptr, drawn_ptr, out_ptr,
              vocab_size, num_chunks, num_rows, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
              SEARCH_BLOCK: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr):  # fmt: skip
    """Threshold, then draw, for batch row ``row`` (int64) whose logits start at row_ptr and chunk maxima at
    chunk_max_ptr, compacting top-k candidates into values_ptr (CAP float32): see the module doc."""
    scale = tl.load(scale_ptr + row)
    top = tl.load(drawn_ptr + num_rows + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    lo = tl.full([], -2147483648, dtype=tl.int64)  # below every value's key: count V, mass Z
    hi = _key(top + 0.0).to(tl.int64) + 1  # lo and hi are int64: hi - lo overflows int32
    p_done = tl.full([], 0, dtype=tl.int32)
    if k > 0:
        lo = _top_k_floor(chunk_max_ptr, num_chunks, k, CHUNKS_PAD)
        if lo == -2147483648:  # k above the chunk count: one count round puts a floor near the threshold
            lo = _search(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, hi, k * 1.0, 1, False,
                         CHUNK, SEARCH_BLOCK, G)  # fmt: skip
        n = _compact(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, values_ptr, CAP, CHUNK, BLOCK)
        if n <= CAP:  # the usual case: sort the few candidates, top-p included
            lo = _sorted_threshold(values_ptr, n, k, p, top, CAP)
            p_done = p_done + 1
        else:
            lo = _search(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, hi, k * 1.0, 64, False,
                         CHUNK, SEARCH_BLOCK, G)  # fmt: skip
    if (p < 1.0) & (p_done == 0):
        kept = tl.load(drawn_ptr + 2 * num_rows + row)  # the partition sum, unless a top-k cut the row
        if k > 0:
            kept = _kept_mass(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, 0.0, CHUNK, BLOCK)
        lo = _search(row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, hi, p * kept, 64, True,
                     CHUNK, SEARCH_BLOCK, G)  # fmt: skip
    target = tl.load(drawn_ptr + row) * _kept_mass(
        row_ptr, chunk_max_ptr, num_chunks, vocab_size, scale, top, lo, min_p, CHUNK, BLOCK
    )
    running = tl.full([], 0.0, dtype=tl.float32)
    token = tl.full([], 0, dtype=tl.int32) + vocab_size
    last_kept = tl.full([], 0, dtype=tl.int32)
    for c in range(0, num_chunks):  # stop reading once the running mass has crossed
        if (token == vocab_size) & _live(chunk_max_ptr, c, top, lo, min_p):
            for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                w = _kept(row_ptr, cols, vocab_size, scale, top, lo, min_p)
                inside = tl.cumsum(w, axis=0) + running
                token = tl.minimum(token, tl.min(tl.where(inside > target, cols, vocab_size), axis=0))
                last_kept = tl.maximum(last_kept, tl.max(tl.where(w > 0.0, cols, 0), axis=0))
                running += tl.sum(w, axis=0)
    tl.store(out_ptr + row, tl.minimum(token, last_kept).to(tl.int64))  # float32 sums may fall short of target


@triton.jit(do_not_specialize=["num_filtered", "num_programs", "num_rows"])
def _filtered_pick_kernel(
    logits_ptr,
    rows_ptr,  # (F,) int32 or int64 batch rows to filter
    src_ptr,  # (F,) their rows in logits
    prog_ptr,  # (F,) their rows in stats
    stats_ptr,  # (3, R, C) float32 chunk summaries of sample_rows; plane 0 holds the chunk maxima
    scale_ptr,  # (B,) float32 inverse temperatures (> 0 for these rows)
    top_k_ptr,  # (B,) int32 or int64, 0 = off
    top_p_ptr,  # (B,) float32, 1 = off
    min_p_ptr,  # (B,) float32, 0 = off
    drawn_ptr,  # (3, B) float32 each row's uniform, largest scaled logit and partition sum (from sample_rows)
    out_ptr,  # (2, B) int64: token ids are written here
    scratch_ptr,  # (F, CAP) float32: each row's compacted candidates
    stride_row,
    vocab_size,
    num_chunks,
    num_filtered,
    num_programs,
    num_rows,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    G: tl.constexpr,
    CAP: tl.constexpr,
):
    """Threshold, then draw, for filtered row program_id(0) (see the module doc)."""
    i = tl.program_id(0)
    _pick_row(
        tl.load(rows_ptr + i).to(tl.int64),
        logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row,
        stats_ptr + tl.load(prog_ptr + i).to(tl.int64) * num_chunks,
        scratch_ptr + i.to(tl.int64) * CAP,
        scale_ptr, top_k_ptr, top_p_ptr, min_p_ptr, drawn_ptr, out_ptr, vocab_size, num_chunks, num_rows,
        CHUNK, CHUNKS_PAD, BLOCK, SEARCH_BLOCK, G, CAP,
    )  # fmt: skip


def check_pick_args(
    logits: torch.Tensor,
    rows: torch.Tensor,
    sources: torch.Tensor,
    programs: torch.Tensor,
    stats: torch.Tensor,
    top_k: torch.Tensor,
    chunk: int,
) -> int:
    """The chunks of a row after checking the arguments ``filtered_pick`` and ``segmented_pick`` share (ValueError
    naming the first one out of shape or dtype)."""
    if top_k.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_k must be int32 or int64, got {top_k.dtype}")
    return check_row_sources(logits, rows, sources, programs, stats, chunk)


def filtered_pick(
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
    block: int = BLOCK,
    capacity: int = CAPACITY,
) -> None:
    """Overwrite out[0, rows] with a draw from each row's top-k / top-p / min-p filtered distribution.

    logits (N, V): row sources[i] holds batch row rows[i], whose chunk summaries are stats[:, programs[i]] (what
    ``sample_rows`` returned for these logits, with the same ``chunk``); per-row settings are (B,) tensors indexed
    by batch row (top_k an int tensor, the rest float32); drawn (3, B) float32 is what ``sample_rows`` recorded (the
    uniforms, row maxima and partition sums); out (2, B) int64. capacity (a power of two): the most top-k candidates
    a row sorts; beyond it the row searches.
    """
    num_chunks = check_pick_args(logits, rows, sources, programs, stats, top_k, chunk)
    if block & (block - 1) or chunk & (chunk - 1) or capacity & (capacity - 1) or capacity < 2:
        raise ValueError(f"block, chunk and capacity must be powers of two, got {block}, {chunk} and {capacity}")
    if rows.shape[0] == 0:
        return
    capacity = min(capacity, max(2, int(triton.next_power_of_2(logits.shape[1]))))  # no more than the row holds
    scratch = torch.empty((rows.shape[0], capacity), dtype=torch.float32, device=logits.device)
    _filtered_pick_kernel[(rows.shape[0],)](
        logits, rows, sources, programs, stats, scale, top_k, top_p, min_p, drawn, out, scratch, logits.stride(0),
        logits.shape[1], num_chunks, rows.shape[0], stats.shape[1], out.shape[1], CHUNK=chunk,
        CHUNKS_PAD=max(2, int(triton.next_power_of_2(num_chunks))), BLOCK=min(block, chunk),
        SEARCH_BLOCK=min(SEARCH_BLOCK, block, chunk), G=CANDIDATES, CAP=capacity, num_warps=8,
    )  # fmt: skip


@triton.jit
def _log_partition_kernel(logits_ptr, rows_ptr, out_ptr, stride_row, vocab_size, BLOCK: tl.constexpr):
    """log sum exp of logits row rows[program_id(0)], with a running maximum."""
    i = tl.program_id(0)
    row_ptr = logits_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_row
    top = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.full([], 0.0, dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    tl.store(out_ptr + i, top + tl.log(total))


def log_partition(logits: torch.Tensor, rows: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(R,) float32 log sum exp of logits rows ``rows`` ((R,) int32 or int64), one read of each."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (N, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    if rows.shape[0]:
        _log_partition_kernel[(rows.shape[0],)](logits, rows, out, logits.stride(0), logits.shape[1], BLOCK=block)
    return out


@triton.jit(do_not_specialize=["num_candidates", "num_rows"])
def _candidates_pick_kernel(
    values_ptr,  # (F, C) logits of each filtered row's candidates, in ascending token id order
    ids_ptr,  # (F, C) int64 their token ids
    rows_ptr,  # (F,) int32 or int64 batch rows
    scale_ptr,  # (B,) float32 inverse temperatures (> 0 for these rows)
    top_k_ptr,  # (B,) int32 or int64, >= 1 for these rows
    top_p_ptr,  # (B,) float32, 1 = off
    min_p_ptr,  # (B,) float32, 0 = off
    drawn_ptr,  # (3, B) float32: plane 0 holds each row's uniform (from sample_rows)
    out_ptr,  # (2, B) int64: token ids are written to plane 0
    num_candidates,
    num_rows,
    CAP: tl.constexpr,
):
    """Threshold, then draw, for filtered row program_id(0) from its candidates alone (all in registers)."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    cols = tl.arange(0, CAP)
    live = cols < num_candidates
    at = i.to(tl.int64) * num_candidates + cols
    s = tl.load(values_ptr + at, mask=live, other=0.0).to(tl.float32) * tl.load(scale_ptr + row) + 0.0
    s = tl.where(live, s, float("-inf"))
    top = tl.max(s, axis=0)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    v = tl.sort(s, descending=True)  # (CAP,) best first
    tau_k = tl.sum(tl.where(cols == k - 1, v, 0.0), axis=0)
    e = tl.where(cols < num_candidates, tl.exp(v - top), 0.0)
    target = p * tl.sum(tl.where(v >= tau_k, e, 0.0), axis=0)
    first = tl.sum((tl.cumsum(e, axis=0) < target).to(tl.int32), axis=0)  # ranks before the mass reaches it
    tau_p = tl.max(tl.where(cols == first, v, float("-inf")), axis=0)  # -inf when rounding ran past the top-k
    tau = tl.where(p < 1.0, tl.maximum(tau_k, tau_p), tau_k)
    w = tl.exp(s - top)
    w = tl.where(live & (s >= tau) & (w >= tl.load(min_p_ptr + row)), w, 0.0)  # kept weights, in id order
    target = tl.load(drawn_ptr + row) * tl.sum(w, axis=0)
    crossing = tl.min(tl.where(tl.cumsum(w, axis=0) > target, cols, num_candidates), axis=0)
    picked = tl.minimum(crossing, tl.max(tl.where(w > 0.0, cols, 0), axis=0))  # float32 sums may fall short
    tl.store(out_ptr + row, tl.load(ids_ptr + i.to(tl.int64) * num_candidates + picked))


def candidates_pick(
    values: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    drawn: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Overwrite out[0, rows] with a draw from each row's top-k / top-p / min-p filtered distribution, given its
    best tokens: values (F, C) their logits and ids (F, C) int64 their token ids, ascending, holding every token
    the row's top-k keeps (``fused_sampling``: its C best, C above every row's top_k). Settings are (B,) tensors
    by batch row; drawn (3, B) is what ``sample_rows`` recorded (plane 0: the uniforms); out (2, B) int64. The same
    draw as ``filtered_sample_sorted`` over the candidates (its float32 rounding, not float64 sums)."""
    if values.dim() != 2 or values.shape != ids.shape or rows.shape != (values.shape[0],):
        raise ValueError(
            f"values and ids must be (F, C) and rows (F,), got {tuple(values.shape)}, {tuple(ids.shape)}, "
            f"{tuple(rows.shape)}"
        )
    if not values.shape[0] or not values.shape[1]:
        return
    cap = max(2, int(triton.next_power_of_2(values.shape[1])))
    _candidates_pick_kernel[(values.shape[0],)](
        values.contiguous(), ids.contiguous(), rows, scale, top_k, top_p, min_p, drawn, out, values.shape[1],
        out.shape[1], CAP=cap, num_warps=4,
    )  # fmt: skip

"""Top-k / top-p / min-p per row, and each row's log-partition for logprobs: Triton kernels beside torch references.

Every filter keeps an upper set of the row's scaled logits s = x * (1 / T), so together they are one threshold:

    keep v  iff  s_v >= tau  and  exp(s_v - M) >= min_p,          M = max_v s_v
    tau_k = max{t : count(s >= t) >= k}                           the k-th largest value (ties all kept)
    tau   = max{t : mass(s >= t) >= top_p * mass(s >= tau_k)}     mass = sum of exp(s - M); tau >= tau_k

(tau is the nucleus of the top-k survivors: a token stays when the mass strictly above it is below top_p of
theirs.) Then u ~ U(0, 1) picks the first v whose running kept mass exceeds u * (kept mass), as in
``fnvllm.kernels.sampling``. Worked example: s = (2, 1, 0, 1) (M 2), top_k 3, top_p 0.5: tau_k = 1 (three tokens
>= 1), masses above t = 1: 1 + 2 e^-1 = 1.74 and above t = 2: 1 >= 0.5 * 1.74, so tau = 2 and token 0 alone stays.

The kernel finds each threshold without sorting, one program per filtered row, by a G-way search over the int32
keys that order float32 values like the values do: each round streams the row once and evaluates the count (top-k)
or the mass (top-p) at G candidate keys spread over the open range (lo, hi) (with g(lo) >= target > g(hi)),
keeping the last candidate that still reaches the target as lo and, as hi, one above the largest key below the
first one that does not. Range and key gaps shrink together, so a row whose top tokens stand apart settles in a
few rounds; worst case about 32 / log2(G) + 1 per search. Then one pass sums the kept mass and one more (stopping
at the crossing) draws the token. Rows without a filter never enter this kernel.

The log-partition kernel gives log sum exp(x) of the raw logits for the rows that asked for logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.sampling_ref import filtered_sample_ref, log_partition_ref

__all__ = ["filtered_pick", "filtered_sample_ref", "log_partition", "log_partition_ref"]

BLOCK = 2048  # tokens per streamed block of a row
SEARCH_BLOCK = 512  # tokens per block of a search round, which holds (CANDIDATES, SEARCH_BLOCK) temporaries
CANDIDATES = 16  # keys evaluated per search round


@triton.jit
def _key(s):
    """int32 keys ordered like float32 values (negative values have their magnitude bits flipped)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _search(row_ptr, vocab_size, scale, top, lo, hi, target, BY_MASS: tl.constexpr, BLOCK: tl.constexpr,
            G: tl.constexpr):  # fmt: skip
    """The largest key t in [lo, hi) (int64 scalars) with g(t) >= target, where g(t) is the mass (BY_MASS) or the
    count of the row's tokens whose key is >= t; requires g(lo) >= target > g(hi)."""
    j = tl.arange(0, G)
    while hi - lo > 1:
        cand = (lo + 1 + ((hi - lo - 2) * j) // (G - 1)).to(tl.int32)  # (G,) from lo + 1 to hi - 1
        g = tl.zeros([G], dtype=tl.float32)
        below = tl.full([G], -2147483648, dtype=tl.int32)  # largest key under each candidate
        for start in range(0, vocab_size, BLOCK):
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


@triton.jit(do_not_specialize=["num_filtered"])
def _filtered_pick_kernel(
    logits_ptr,
    rows_ptr,  # (F,) int32 or int64 batch rows to filter
    src_ptr,  # (F,) int32 or int64 their rows in logits
    scale_ptr,  # (B,) float32 inverse temperatures (> 0 for these rows)
    top_k_ptr,  # (B,) int32 or int64, 0 = off
    top_p_ptr,  # (B,) float32, 1 = off
    min_p_ptr,  # (B,) float32, 0 = off
    uniform_ptr,  # (B,) float32 each row's uniform
    row_max_ptr,  # (B,) float32 each row's largest scaled logit
    out_ptr,  # (2, B) int64: token ids are written here
    stride_row,
    vocab_size,
    num_filtered,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    G: tl.constexpr,
):
    """Threshold, then draw, for filtered row program_id(0) (see the module doc)."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    row_ptr = logits_ptr + tl.load(src_ptr + i).to(tl.int64) * stride_row
    scale = tl.load(scale_ptr + row)
    top = tl.load(row_max_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    lo = tl.full([], -2147483648, dtype=tl.int64)  # below every value's key: count V, mass Z
    hi = _key(top + 0.0).to(tl.int64) + 1  # lo and hi are int64: hi - lo overflows int32
    if k > 0:
        lo = _search(row_ptr, vocab_size, scale, top, lo, hi, k * 1.0, False, SEARCH_BLOCK, G)
    if p < 1.0:
        kept_mass = tl.full([], 0.0, dtype=tl.float32)  # of the top-k survivors (of the row without a top-k)
        for start in range(0, vocab_size, BLOCK):
            kept_mass += tl.sum(_kept(row_ptr, start + tl.arange(0, BLOCK), vocab_size, scale, top, lo, 0.0), axis=0)
        lo = _search(row_ptr, vocab_size, scale, top, lo, hi, p * kept_mass, True, SEARCH_BLOCK, G)
    total = tl.full([], 0.0, dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        total += tl.sum(_kept(row_ptr, start + tl.arange(0, BLOCK), vocab_size, scale, top, lo, min_p), axis=0)
    target = tl.load(uniform_ptr + row) * total
    running = tl.full([], 0.0, dtype=tl.float32)
    token = tl.full([], 0, dtype=tl.int32) + vocab_size
    last_kept = tl.full([], 0, dtype=tl.int32)
    start = tl.full([], 0, dtype=tl.int32)
    while (start < vocab_size) & (token == vocab_size):  # stop at the block where the running mass crosses
        cols = start + tl.arange(0, BLOCK)
        w = _kept(row_ptr, cols, vocab_size, scale, top, lo, min_p)
        inside = tl.cumsum(w, axis=0) + running
        token = tl.min(tl.where(inside > target, cols, vocab_size), axis=0)
        last_kept = tl.maximum(last_kept, tl.max(tl.where(w > 0.0, cols, 0), axis=0))
        running += tl.sum(w, axis=0)
        start += BLOCK
    tl.store(out_ptr + row, tl.minimum(token, last_kept).to(tl.int64))  # float32 sums may fall short of target


def filtered_pick(
    logits: torch.Tensor,
    rows: torch.Tensor,
    sources: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    row_max: torch.Tensor,
    out: torch.Tensor,
    block: int = BLOCK,
) -> None:
    """Overwrite out[0, rows] with a draw from each row's top-k / top-p / min-p filtered distribution.

    logits (N, V): row sources[i] holds batch row rows[i]; per-row settings are (B,) tensors indexed by batch row
    (top_k an int tensor, the rest float32); uniforms and row_max are those ``sample_rows`` recorded; out (2, B) int64.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (N, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    if rows.shape != sources.shape or rows.dim() != 1:
        raise ValueError(f"rows and sources must be equal-length 1-d, got {tuple(rows.shape)}, {tuple(sources.shape)}")
    if top_k.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_k must be int32 or int64, got {top_k.dtype}")
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if rows.shape[0] == 0:
        return
    _filtered_pick_kernel[(rows.shape[0],)](
        logits, rows, sources, scale, top_k, top_p, min_p, uniforms, row_max, out, logits.stride(0), logits.shape[1],
        rows.shape[0], BLOCK=block, SEARCH_BLOCK=min(block, SEARCH_BLOCK), G=CANDIDATES, num_warps=8,
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

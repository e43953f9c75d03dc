"""Fused temperature sampling in two light passes over the logits: Triton kernels beside a torch reference.

Why: the general sampler (``fnvllm.executor.sampler``) materialises float32 copies of the (B, V) logits several
times (upcast, divide by T, softmax, exponential noise, divide, argmax). At B 256 and V 151,936 each copy is
155 MB, so a decode step spends about 2 GB of memory traffic (~0.5 ms on an H200) just sampling. For the common
case -- temperature only, no top-k / top-p / min-p, no penalties, no per-request seed, no logprobs -- one read of
the logits and one random number per row are enough, by inverting the CDF of p = softmax(logits / T):

    token = the first v with  sum_{w <= v} exp(logits[w] / T - M)  >  u * Z,   u ~ U(0, 1),
    M = max_v logits[v] / T,   Z = sum_v exp(logits[v] / T - M).

A greedy row (T = 0) takes the argmax (the lowest index among equal maxima, like torch.argmax).

Algorithm. Pass 1, grid (B, C): program (b, c) reads chunk c (CHUNK tokens) of row b once and writes the chunk's
max m_c, its partition sum z_c = sum exp(x / T - m_c), its argmax and a non-finite flag. Pass 2, grid (B,): row b
combines the C chunk summaries (M = max m_c, w_c = z_c exp(m_c - M), Z = sum w_c), draws u with Philox keyed by
(seed, b), finds the chunk c* where the running sum of w first exceeds u Z, and re-reads only that chunk to find
the token inside it. Pass 1 reads the logits once at full parallelism; pass 2 reads 1/C of them. Random numbers:
B, not B x V (the Gumbel-max alternative needs one per logit and is bound by generating them).

Worked example (V 4 in chunks of 2, T 1, logits ln(1, 2, 3, 2)): chunk sums relative to M = ln 3 are w = (1, 5/3),
Z = 8/3. With u = 0.5, u Z = 4/3 > w_0 = 1, so c* = 1 and the remainder is 1/3; inside chunk 1 the running sums
(relative to M) are 1, 5/3, and 1 > 1/3 first at token 2.

Pass 1 also flags rows whose logits hold a NaN or an infinity (a broken checkpoint), so the executor can report
them instead of returning an arbitrary token.

Per row, not per batch (``sample_rows``): each row carries its own inverse temperature (0 = greedy) and either a
fixed uniform (a seeded request: ``fnvllm.executor.seeded_noise.seeded_uniforms``, a pure function of the seed
and the draw's index, so its token never depends on its batch mates) or a Philox draw keyed by (seed, row). A row
list lets one launch cover some rows of a batch (the rest are sampled from another source, e.g. penalised rows
from a float32 copy). Pass 2 also records each row's uniform and maximum scaled logit, which the top-k / top-p /
min-p kernel (``fnvllm.kernels.sampling_filters``) reads for the rows that filter; the others are done here.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from fnvllm.kernels.sampling_ref import sample_rows_ref  # the reference of sample_rows (+ filtered_pick)

__all__ = [
    "CHUNK",
    "RowSampling",
    "SamplingScratch",
    "check_row_sources",
    "chunk_summaries",
    "fused_sample",
    "logprob_candidates",
    "logprob_top",
    "logprob_top_ref",
    "philox_uniforms",
    "sample_ref",
    "sample_rows",
    "sample_rows_graphed",
    "sample_rows_ref",
]

CHUNK = 4096  # tokens per pass-1 program: 38 chunks for a 151,936-token vocabulary
_MAX_CHUNKS = 1024  # pass 2 holds a row's chunk summaries in registers


def sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. logits (B, V) any float dtype; temperature (B,) float32, 0 = greedy; uniforms (B,) in [0, 1).

    Returns (token_ids (B,) int64, non_finite (B,) bool: the row's logits hold a NaN or an infinity). Sampled rows
    invert the CDF of softmax(logits / T) at u (in float64, so only a u within rounding of a CDF step can differ
    from the kernel's float32 sums).
    """
    x = logits.double()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature.clamp_min(1e-30)).double()
    scaled = x * scale[:, None]
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp()
    cdf = weights.cumsum(dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(x.shape[1] - 1)
    non_finite = ~torch.isfinite(x).all(dim=-1)
    return torch.where(greedy, x.argmax(dim=-1), sampled), non_finite


# Batch size and seed change every step: left unspecialised, so a new value never triggers a compile mid-run.
@triton.jit(do_not_specialize=["num_programs"])
def _chunk_stats_kernel(
    logits_ptr,
    scale_ptr,  # (B,) float32 inverse temperature, 0 = greedy (the chunk max of the raw logits)
    rows_ptr,  # (R,) int32 or int64 batch rows of the programs (when HAS_ROWS)
    stats_ptr,  # (3, R, C) float32: chunk max, chunk partition sum, non-finite flag
    argmax_ptr,  # (R, C) int32: index of the chunk's max (vocabulary index)
    live_ptr,  # (2,) int32 when GRAPHED: the live rows n (programs >= n read nothing), then the seed
    stride_row,
    num_programs,
    vocab_size,
    num_chunks,
    CHUNK_SIZE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    DENSE_SOURCE: tl.constexpr,
    GRAPHED: tl.constexpr = False,
):
    """Summarise chunk program_id(1) of program program_id(0)'s row (source row = the program index when
    DENSE_SOURCE, else the batch row)."""
    i, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i.to(tl.int64)
    src = i.to(tl.int64) if DENSE_SOURCE else row
    scale = tl.load(scale_ptr + row)
    scale = tl.where(scale > 0.0, scale, 1.0)
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    if GRAPHED:  # a captured bucket's padding rows (and every row of a step sampled elsewhere) read no logits
        vocab_size = tl.where(i < tl.load(live_ptr), vocab_size, 0)
    mask = cols < vocab_size
    x = tl.load(logits_ptr + src * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    bad = tl.max((mask & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.float32), axis=0)
    scaled = tl.where(mask, x * scale, float("-inf"))
    top = tl.max(scaled, axis=0)
    first = tl.min(tl.where(scaled == top, cols, vocab_size), axis=0)  # lowest index among equal maxima
    total = tl.sum(tl.where(mask, tl.exp(scaled - top), 0.0), axis=0)
    at = i * num_chunks + chunk
    plane = num_programs * num_chunks
    tl.store(stats_ptr + at, top)
    tl.store(stats_ptr + plane + at, total)
    tl.store(stats_ptr + 2 * plane + at, bad)
    tl.store(argmax_ptr + at, first)


@triton.jit(do_not_specialize=["num_programs", "num_rows", "seed"])
def _pick_kernel(
    logits_ptr,
    scale_ptr,
    rows_ptr,
    fixed_ptr,  # (B,) int32: 1 = the row's uniform is given in uniform_ptr (a seeded row)
    uniform_ptr,  # (B,) float32: the given uniforms
    drawn_ptr,  # (3, B) float32: receives each row's uniform, largest scaled logit and partition sum (relative)
    stats_ptr,
    argmax_ptr,
    out_ptr,  # (2, B) int64: token ids, non-finite flags
    live_ptr,  # (2,) int32 when GRAPHED: the live rows n, then the seed (both replace the arguments)
    stride_row,
    num_programs,
    num_rows,
    vocab_size,
    num_chunks,
    seed,
    CHUNK_SIZE: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    DENSE_SOURCE: tl.constexpr,
    GRAPHED: tl.constexpr = False,
):
    """Combine program program_id(0)'s chunk summaries, take its uniform, and find the sampled token.

    GRAPHED (a CUDA graph's capture: its arguments are frozen, so what changes per step is read from live_ptr):
    num_rows and seed come from live_ptr, out and drawn are laid out for those n rows, and programs >= n (the
    bucket's padding rows) store nothing."""
    i = tl.program_id(0)
    active = i < num_programs  # every program (a tensor: the stores take it as their mask)
    if GRAPHED:
        num_rows = tl.load(live_ptr)
        seed = tl.load(live_ptr + 1)
        active = i < num_rows
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i.to(tl.int64)
    src = i.to(tl.int64) if DENSE_SOURCE else row
    scale = tl.load(scale_ptr + row)
    chunk_ids = tl.arange(0, CHUNKS_PAD)
    live = chunk_ids < num_chunks
    plane = num_programs * num_chunks
    at = i * num_chunks + chunk_ids
    maxima = tl.load(stats_ptr + at, mask=live, other=float("-inf"))
    sums = tl.load(stats_ptr + plane + at, mask=live, other=0.0)
    bad = tl.max(tl.load(stats_ptr + 2 * plane + at, mask=live, other=0.0), axis=0)
    top = tl.max(maxima, axis=0)
    best_chunk = tl.min(tl.where(maxima == top, chunk_ids, CHUNKS_PAD), axis=0)
    greedy_token = tl.load(argmax_ptr + i * num_chunks + best_chunk)
    weights = tl.where(live, sums * tl.exp(maxima - top), 0.0)  # (C,) each chunk's share of Z, relative to M
    running = tl.cumsum(weights, axis=0)
    u = tl.where(tl.load(fixed_ptr + row) != 0, tl.load(uniform_ptr + row), tl.rand(seed, row.to(tl.int32)))
    partition = tl.sum(weights, axis=0)
    target = u * partition
    picked = tl.min(tl.where(running > target, chunk_ids, num_chunks - 1), axis=0)
    remainder = target - tl.sum(tl.where(chunk_ids < picked, weights, 0.0), axis=0)
    cols = picked * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    mask = cols < tl.where(active, vocab_size, 0)  # an inactive program reads nothing
    x = tl.load(logits_ptr + src * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.where(mask, tl.exp(x * scale - top), 0.0)
    inside = tl.cumsum(e, axis=0)
    crossing = tl.min(tl.where(inside > remainder, cols, vocab_size), axis=0)
    last_positive = tl.max(tl.where(e > 0.0, cols, 0), axis=0)  # float32 sums may fall short of the remainder
    sampled = tl.minimum(crossing, last_positive)
    token = tl.where(scale > 0.0, sampled, greedy_token)
    tl.store(drawn_ptr + row, u, mask=active)
    tl.store(drawn_ptr + num_rows + row, top, mask=active)
    tl.store(drawn_ptr + 2 * num_rows + row, partition, mask=active)
    tl.store(out_ptr + row, token.to(tl.int64), mask=active)
    tl.store(out_ptr + num_rows + row, (bad > 0.0).to(tl.int64), mask=active)


@triton.jit
def _philox_uniform_kernel(out_ptr, seed):
    """The uniform pass 2 draws for row program_id(0) (for tests and the reference)."""
    row = tl.program_id(0)
    tl.store(out_ptr + row, tl.rand(seed, row.to(tl.int32)))


def philox_uniforms(num_rows: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """(num_rows,) float32: exactly the uniforms ``sample_rows`` draws for ``seed`` in rows without a fixed one."""
    out = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows:
        _philox_uniform_kernel[(num_rows,)](out, seed)
    return out


@attrs.frozen(eq=False)
class RowSampling:
    """Per-row sampling inputs of one batch of B rows, on the logits' device.

    scale: (B,) float32 inverse temperature (computed in float32 on the host), 0 = greedy.
    fixed: (B,) int32, 1 where ``uniforms`` holds the row's uniform (a seeded row), 0 where Philox draws it.
    uniforms: (B,) float32, the fixed uniforms (read only).
    drawn: (3, B) float32, receives each row's uniform (fixed or drawn), its largest scaled logit M and its
        partition sum relative to it (sum of exp(s - M)).
    out: (2, B) int64, receives token ids and 0/1 non-finite flags.
    """

    scale: torch.Tensor
    fixed: torch.Tensor
    uniforms: torch.Tensor
    drawn: torch.Tensor
    out: torch.Tensor


def _check_source(logits: torch.Tensor, chunk: int) -> int:
    """Raise ValueError unless logits is (R, V) with a contiguous last dim and chunk fits; returns the chunks."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (R, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    num_chunks = triton.cdiv(logits.shape[1], chunk)
    if num_chunks > _MAX_CHUNKS or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two with vocab_size / chunk <= {_MAX_CHUNKS}, got {chunk}")
    return num_chunks


def sample_rows(
    logits: torch.Tensor,
    batch: RowSampling,
    seed: int,
    rows: torch.Tensor | None = None,
    dense: bool = False,
    chunk: int = CHUNK,
    scratch: SamplingScratch | None = None,
) -> torch.Tensor:
    """Sample batch rows from ``logits`` into ``batch.out`` (and their uniforms and maxima into ``batch.drawn``);
    returns the chunk summaries (3, R, C) (max, partition sum, non-finite flag of program i's row chunk c), which
    ``fnvllm.kernels.sampling_filters.filtered_pick`` reads.

    rows: None = every batch row; else (R,) int32 or int64, the batch rows to sample. dense: logits row i holds
    batch row rows[i] (a (R, V) copy of those rows); otherwise logits holds every batch row at its own index.
    ``seed`` (0 <= seed < 2**31) keys the Philox uniforms of rows without a fixed one. scratch: where the chunk
    summaries go (``SamplingScratch``: the returned summaries are valid until the scratch's next use; None: fresh).
    """
    num_chunks = _check_source(logits, chunk)
    num_rows = batch.out.shape[1]
    num_programs = num_rows if rows is None else rows.shape[0]
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    if num_programs == 0:
        return torch.empty((3, 0, num_chunks), dtype=torch.float32, device=logits.device)
    expected = num_programs if dense and rows is not None else num_rows
    if logits.shape[0] != expected:
        raise ValueError(f"logits must have {expected} rows (dense={dense}), got {logits.shape[0]}")
    row_ids = rows if rows is not None else batch.scale  # unused pointer when HAS_ROWS is False
    flags = {"HAS_ROWS": rows is not None, "DENSE_SOURCE": dense and rows is not None}
    if scratch is None:
        stats = torch.empty((3, num_programs, num_chunks), dtype=torch.float32, device=logits.device)
        argmax = torch.empty((num_programs, num_chunks), dtype=torch.int32, device=logits.device)
    else:
        stats, argmax = scratch.chunk_stats(num_programs, num_chunks, logits.device)
    _launch_pair(logits, batch, row_ids, stats, argmax, batch.scale, num_programs, num_rows, num_chunks, seed, chunk,
                 flags)  # fmt: skip
    return stats


def _launch_pair(
    logits: torch.Tensor, batch: RowSampling, row_ids: torch.Tensor, stats: torch.Tensor, argmax: torch.Tensor,
    live: torch.Tensor, num_programs: int, num_rows: int, num_chunks: int, seed: int, chunk: int,
    flags: dict[str, bool],
) -> None:  # fmt: skip
    """Pass 1 over (programs, chunks), then pass 2 over programs (``sample_rows``; ``sample_rows_graphed``)."""
    _chunk_stats_kernel[(num_programs, num_chunks)](
        logits, batch.scale, row_ids, stats, argmax, live, logits.stride(0), num_programs, logits.shape[1],
        num_chunks, CHUNK_SIZE=chunk, num_warps=8, **flags,
    )  # fmt: skip
    _pick_kernel[(num_programs,)](
        logits, batch.scale, row_ids, batch.fixed, batch.uniforms, batch.drawn, stats, argmax, batch.out, live,
        logits.stride(0), num_programs, num_rows, logits.shape[1], num_chunks, seed,
        CHUNK_SIZE=chunk, CHUNKS_PAD=max(2, int(triton.next_power_of_2(num_chunks))), num_warps=8, **flags,
    )  # fmt: skip


def sample_rows_graphed(
    logits: torch.Tensor,
    scale: torch.Tensor,
    fixed: torch.Tensor,
    uniforms: torch.Tensor,
    live: torch.Tensor,
    out: torch.Tensor,
    scratch: SamplingScratch,
    chunk: int = CHUNK,
) -> None:
    """``sample_rows`` of every row of ``logits`` (N, V) in a form a CUDA graph can capture once and replay each
    step: what changes per step is read from device memory, not frozen into the launch. live: (2,) int32, the
    rows n this step samples (0 <= n <= N; rows >= n are a bucket's padding: they read no logits and store
    nothing; n = 0 samples nothing) and the Philox seed (0 <= seed < 2**31). scale / fixed / uniforms: (N,) as in
    ``RowSampling`` (rows :n read). out: (2 N,) int64; rows :n's tokens land in out[:n] and their non-finite
    flags in out[n : 2 n], so ``out[: 2 * n].view(2, n)`` is what ``sample_rows`` returns for those rows. The
    same tokens as ``sample_rows`` for the same logits, settings and seed."""
    num_chunks = _check_source(logits, chunk)
    num_programs = logits.shape[0]
    if tuple(live.shape) != (2,) or live.dtype != torch.int32:
        raise ValueError(f"live must be a (2,) int32 tensor, got {tuple(live.shape)} {live.dtype}")
    if out.shape != (2 * num_programs,) or out.dtype != torch.int64:
        raise ValueError(f"out must be a ({2 * num_programs},) int64 tensor, got {tuple(out.shape)} {out.dtype}")
    stats, argmax = scratch.chunk_stats(num_programs, num_chunks, logits.device)
    drawn = scratch.drawn(num_programs, logits.device)
    batch = RowSampling(scale=scale, fixed=fixed, uniforms=uniforms, drawn=drawn, out=out)
    flags = {"HAS_ROWS": False, "DENSE_SOURCE": False, "GRAPHED": True}
    _launch_pair(logits, batch, scale, stats, argmax, live, num_programs, num_programs, num_chunks, 0, chunk, flags)


def check_row_sources(
    logits: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor, programs: torch.Tensor, stats: torch.Tensor,
    chunk: int,
) -> int:  # fmt: skip
    """The chunks of a row after checking the arguments every redraw of filtered rows takes (``filtered_pick``,
    ``segmented_pick``, ``minp_pick``): logits (N, V) with a contiguous last dim, equal-length 1-d rows / sources /
    programs, and (3, R, C) chunk summaries for ``chunk`` (ValueError naming the first one out of shape)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (N, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    if not rows.shape == sources.shape == programs.shape or rows.dim() != 1:
        raise ValueError(
            f"rows, sources and programs must be equal-length 1-d, got {tuple(rows.shape)}, "
            f"{tuple(sources.shape)}, {tuple(programs.shape)}"
        )
    num_chunks = triton.cdiv(logits.shape[1], chunk)
    if stats.dim() != 3 or stats.shape[0] != 3 or stats.shape[2] != num_chunks:
        raise ValueError(f"stats must be (3, R, {num_chunks}) for chunk {chunk}, got {tuple(stats.shape)}")
    return num_chunks


def chunk_summaries(logits: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """(3, R, C) chunk summaries (max of the scaled logits, partition sum, non-finite flag) of batch rows ``rows``
    ((R,) int32 / int64; logits holds every batch row at its own index) in chunks of ``chunk`` tokens: pass 1 of
    ``sample_rows`` alone, at another chunk size (``fused_sampling.FILTER_CHUNK``: finer maxima let the filter
    kernel skip more of a top-k row)."""
    num_chunks = _check_source(logits, chunk)
    num_programs = rows.shape[0]
    stats = torch.empty((3, num_programs, num_chunks), dtype=torch.float32, device=logits.device)
    if num_programs:
        argmax = torch.empty((num_programs, num_chunks), dtype=torch.int32, device=logits.device)
        _chunk_stats_kernel[(num_programs, num_chunks)](
            logits, scale, rows, stats, argmax, rows, logits.stride(0), num_programs, logits.shape[1], num_chunks,
            CHUNK_SIZE=chunk, num_warps=4, HAS_ROWS=True, DENSE_SOURCE=False,
        )  # fmt: skip
    return stats


LOGPROB_CHUNK = 1024  # chunk of the logprob rows' summaries: the top-n candidates are n chunks of this many tokens


@triton.jit
def _row_log_partition(stats_ptr, i, num_programs, num_chunks, CHUNKS_PAD: tl.constexpr):
    """Row i's chunk ids (padded), chunk maxima (-inf past num_chunks) and log sum exp, from the (3, L, C) chunk
    summaries: max and partition sum per chunk."""
    ids = tl.arange(0, CHUNKS_PAD)
    live = ids < num_chunks
    at = i * num_chunks + ids
    maxima = tl.load(stats_ptr + at, mask=live, other=float("-inf"))
    sums = tl.load(stats_ptr + num_programs * num_chunks + at, mask=live, other=0.0)
    top = tl.max(maxima, axis=0)
    return ids, maxima, top + tl.log(tl.sum(tl.where(live, sums * tl.exp(maxima - top), 0.0), axis=0))


@triton.jit(do_not_specialize=["num_programs", "num_top"])
def _logprob_combine_kernel(
    stats_ptr,  # (3, L, C) float32 chunk max / partition sum of the raw logits (scale 0)
    lse_ptr,  # (L,) float32: receives log sum exp of the row
    chunks_ptr,  # (L, N) int32: receives the N chunks with the largest maxima, best first
    logits_ptr,  # (R, V) raw logits (read when HAS_TOKENS)
    rows_ptr,  # (L,) int32 / int64 batch rows (read when HAS_TOKENS)
    tokens_ptr,  # (B,) int64 sampled ids by batch row (read when HAS_TOKENS)
    sampled_ptr,  # (L,) float32: receives the sampled token's logprob (when HAS_TOKENS)
    stride_row,
    num_programs,
    num_chunks,
    num_top,
    CHUNKS_PAD: tl.constexpr,
    HAS_TOKENS: tl.constexpr,
):
    """Row program_id(0): its log-partition, the num_top chunks holding its num_top largest logits (a runtime
    count: a new logprobs count compiles nothing) and, with HAS_TOKENS, the sampled token's logprob."""
    i = tl.program_id(0)
    ids, maxima, lse = _row_log_partition(stats_ptr, i, num_programs, num_chunks, CHUNKS_PAD)
    tl.store(lse_ptr + i, lse)
    if HAS_TOKENS:
        row = tl.load(rows_ptr + i).to(tl.int64)
        token = tl.load(tokens_ptr + row).to(tl.int64)
        tl.store(sampled_ptr + i, tl.load(logits_ptr + row * stride_row + token).to(tl.float32) - lse)
    for j in range(num_top):
        best = tl.max(maxima, axis=0)
        chunk = tl.min(tl.where(maxima == best, ids, CHUNKS_PAD), axis=0)
        tl.store(chunks_ptr + i * num_top + j, chunk)
        maxima = tl.where(ids == chunk, float("-inf"), maxima)


def logprob_candidates(
    logits: torch.Tensor,
    rows: torch.Tensor,
    num_top: int,
    chunk: int = LOGPROB_CHUNK,
    tokens: torch.Tensor | None = None,
    sampled: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the raw logits rows ``rows`` ((L,) int32 or int64, distinct): (lse (L,) float32 log sum exp of each;
    values (L, num_top * chunk) float32 and ids int64: candidates that hold each row's num_top largest logits).
    One pass-1 launch over every chunk of those rows (a scale of 0 reads the raw logits), one combine launch and
    one gather; requires num_top <= the chunks. Why the candidates hold them: a chunk holding one of a row's n
    best tokens has a maximum at least that token's, and fewer than n chunks can have a larger one, so it is
    among the n chunks with the largest maxima. Positions past the vocabulary (a partial last chunk) are -inf.
    The gather is one launch (``_logprob_gather_kernel``): in torch it was ~8 elementwise passes over the (L,
    n x chunk) candidates (id arithmetic, masks, take, upcast, fill), each a launch from the host every step.
    tokens / sampled: (B,) int64 sampled ids by batch row, and an (L,) float32 tensor that receives each row's
    sampled token's logprob (the combine launch computes it; both or neither)."""
    if (tokens is None) != (sampled is None):
        raise ValueError("tokens and sampled go together: pass both or neither")
    num_chunks = _check_source(logits, chunk)
    if not 0 <= num_top <= num_chunks:
        raise ValueError(f"num_top must be in [0, {num_chunks}] (the chunks), got {num_top}")
    num_programs, device = rows.shape[0], logits.device
    stats = torch.empty((3, num_programs, num_chunks), dtype=torch.float32, device=device)
    lse = torch.empty(num_programs, dtype=torch.float32, device=device)
    chunks = torch.empty((num_programs, num_top), dtype=torch.int32, device=device)
    if num_programs:
        argmax = torch.empty((num_programs, num_chunks), dtype=torch.int32, device=device)
        raw = torch.zeros(logits.shape[0], dtype=torch.float32, device=device)  # scale 0: the raw logits
        _chunk_stats_kernel[(num_programs, num_chunks)](
            logits, raw, rows, stats, argmax, rows, logits.stride(0), num_programs, logits.shape[1], num_chunks,
            CHUNK_SIZE=chunk, num_warps=4, HAS_ROWS=True, DENSE_SOURCE=False,
        )  # fmt: skip
        _logprob_combine_kernel[(num_programs,)](
            stats, lse, chunks, logits, rows, lse if tokens is None else tokens, lse if sampled is None else sampled,
            logits.stride(0), num_programs, num_chunks, num_top,
            CHUNKS_PAD=max(2, int(triton.next_power_of_2(num_chunks))), HAS_TOKENS=tokens is not None,
        )  # fmt: skip
    values = torch.empty((num_programs, num_top * chunk), dtype=torch.float32, device=device)  # (L, n*c)
    ids = torch.empty((num_programs, num_top * chunk), dtype=torch.int64, device=device)
    if num_programs and num_top:  # one launch in place of ~8 elementwise passes over the (L, n*c) candidates
        _logprob_gather_kernel[(num_programs, num_top)](
            logits, rows, chunks, values, ids, logits.stride(0), logits.shape[1], num_top, CHUNK_SIZE=chunk,
            num_warps=4,
        )  # fmt: skip
    return lse, values, ids


@triton.jit(do_not_specialize=["num_top"])
def _logprob_gather_kernel(
    logits_ptr,  # (R, V) raw logits
    rows_ptr,  # (L,) int32 / int64 batch rows
    chunks_ptr,  # (L, N) int32 chunks chosen by _logprob_combine_kernel
    values_ptr,  # (L, N * CHUNK_SIZE) float32: receives the chunks' logits, -inf past the vocabulary
    ids_ptr,  # (L, N * CHUNK_SIZE) int64: receives their token ids (past the vocabulary too)
    stride_row,
    vocab_size,
    num_top,
    CHUNK_SIZE: tl.constexpr,
):
    """Program (i, j): copy chunk chunks[i, j] of logits row rows[i] to candidates slot j of row i."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    chunk = tl.load(chunks_ptr + i * num_top + j).to(tl.int64)
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    at = (i * num_top + j).to(tl.int64) * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    tl.store(values_ptr + at, x)
    tl.store(ids_ptr + at, cols)


# ---- logprobs in two launches: chunk summaries, then one program per row for everything else --------------------


@triton.jit(do_not_specialize=["num_programs", "num_chunks", "num_top"])
def _logprob_top_kernel(
    stats_ptr,  # (3, L, C) float32 chunk max / partition sum of the raw logits (scale 0)
    logits_ptr,  # (R, V) raw logits
    rows_ptr,  # (L,) int32 / int64 batch rows
    tokens_ptr,  # (B,) int64 sampled ids by batch row
    values_ptr,  # (L, N) float32: receives the top-N logprobs, best first
    ids_ptr,  # (L, N) int64: receives their token ids
    sampled_ptr,  # (L,) float32: receives the sampled token's logprob
    stride_row,
    vocab_size,
    num_programs,
    num_chunks,
    num_top,
    CHUNKS_PAD: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    TOP_PAD: tl.constexpr,
):
    """Row program_id(0): its log-partition from the chunk summaries, the sampled token's logprob, the num_top
    chunks with the largest maxima (they hold the row's num_top largest logits), and the num_top best of those
    chunks' logits by repeated selection in registers (equal logits: the lowest id first)."""
    i = tl.program_id(0)
    ids, maxima, lse = _row_log_partition(stats_ptr, i, num_programs, num_chunks, CHUNKS_PAD)
    row = tl.load(rows_ptr + i).to(tl.int64)
    token = tl.load(tokens_ptr + row).to(tl.int64)
    tl.store(sampled_ptr + i, tl.load(logits_ptr + row * stride_row + token).to(tl.float32) - lse)
    slots = tl.arange(0, TOP_PAD)
    chosen = num_chunks + slots  # unused slots: chunks past the vocabulary (masked; ids above every real one)
    for j in range(num_top):
        best = tl.max(maxima, axis=0)
        chunk = tl.min(tl.where(maxima == best, ids, CHUNKS_PAD), axis=0)
        chosen = tl.where(slots == j, chunk, chosen)
        maxima = tl.where(ids == chunk, float("-inf"), maxima)
    cols = chosen[:, None] * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)[None, :]  # (TOP_PAD, CHUNK_SIZE) distinct ids
    held = (slots[:, None] < num_top) & (cols < vocab_size)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=held, other=float("-inf")).to(tl.float32)
    for j in range(num_top):
        best = tl.max(tl.max(x, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(x == best, cols, 2147483647), axis=1), axis=0)
        tl.store(values_ptr + i * num_top + j, best - lse)
        tl.store(ids_ptr + i * num_top + j, pick.to(tl.int64))
        x = tl.where(cols == pick, float("-inf"), x)


def _aligned(offset: int, multiple: int) -> int:
    """offset rounded up to a multiple of ``multiple`` elements (16 bytes' worth). Triton compiles a kernel variant
    per 16-byte alignment of each pointer argument, so a view whose offset depends on the batch size (e.g. 12 bytes
    x rows x chunks) would make some batch sizes compile another variant mid-run: measured on the H200, the
    logprob and penalised-row kernels compiled three variants (~0.8 s of stalls) inside a timed bench run."""
    return -(-offset // multiple) * multiple


class SamplingScratch:
    """The sampling kernels' device scratch (chunk summaries and their argmax, the rows' drawn uniforms and maxima,
    the zero scales of the logprobs' raw summaries), kept between calls and grown on demand: fresh tensors cost
    the host an allocator call each, every step. Reuse is safe on one stream: a later call's kernels run after an
    earlier call's readers. Only scratch that no caller keeps lives here (never the samples or the logprobs)."""

    _MAX_VIEWS = 64  # prefill steps' row counts vary: the view cache is cleared past this many shapes

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}

    def _buffer(self, name: str, numel: int, device: torch.device, zero: bool = False) -> torch.Tensor:
        """Float32 buffer ``name`` of at least ``numel`` on ``device`` (doubled when it grows; its views dropped)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.device != device or buffer.numel() < numel:
            size = max(numel, 0 if buffer is None else 2 * buffer.numel())
            buffer = (torch.zeros if zero else torch.empty)(size, dtype=torch.float32, device=device)
            self._buffers[name] = buffer
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # the old buffer's views
        return buffer

    def _keep(self, key: tuple[object, ...], views: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if len(self._views) >= self._MAX_VIEWS:
            self._views.clear()
        self._views[key] = views
        return views

    def chunk_stats(self, num_programs: int, num_chunks: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(stats (3, R, C) float32, argmax (R, C) int32) for ``_chunk_stats_kernel``; the same tensors for the
        same sizes (a decode step's are last step's)."""
        key = ("stats", num_programs, num_chunks, device)
        kept = self._views.get(key)
        if kept is not None:
            return kept
        cells = num_programs * num_chunks
        at = _aligned(3 * cells, 4)  # the argmax starts 16-byte aligned for every batch size (see _aligned)
        flat = self._buffer("stats", at + cells, device)
        stats = flat[: 3 * cells].view(3, num_programs, num_chunks)
        return self._keep(key, (stats, flat[at : at + cells].view(torch.int32).view(num_programs, num_chunks)))

    def drawn(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """(3, B) float32 for ``RowSampling.drawn`` (written before it is read, within one sampling call)."""
        key = ("drawn", num_rows, device)
        kept = self._views.get(key)
        if kept is None:
            kept = self._keep(key, (self._buffer("drawn", 3 * num_rows, device)[: 3 * num_rows].view(3, num_rows),))
        return kept[0]

    def zeros(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """(B,) float32 zeros, never written: the scales of summaries of the raw logits."""
        key = ("zeros", num_rows, device)
        kept = self._views.get(key)
        if kept is None:
            kept = self._keep(key, (self._buffer("zeros", num_rows, device, zero=True)[:num_rows],))
        return kept[0]


def logprob_top(
    logits: torch.Tensor,
    rows: torch.Tensor,
    num_top: int,
    chunk: int,
    tokens: torch.Tensor,
    scratch: SamplingScratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the raw logits rows ``rows`` ((L,) int32 or int64, distinct) in two launches: (top values
    (L, num_top) float32, best first; their ids (L, num_top) int64; the sampled token's (L,) float32; packed: one
    uint8 tensor the other three are views of, so one copy brings them to the host). tokens: (B,) int64 sampled
    ids by batch row. Launch 1 summarises every chunk of those rows (``_chunk_stats_kernel``, scale 0: the raw
    logits); launch 2 (``_logprob_top_kernel``) does per row what ``logprob_candidates``, torch.topk, a gather
    and a subtraction did in five launches and ten allocations. Equal logits: the lowest id first.
    Reference: ``logprob_top_ref``. scratch: reused device scratch (None: fresh)."""
    num_chunks = _check_source(logits, chunk)
    if not 0 <= num_top <= num_chunks:
        raise ValueError(f"num_top must be in [0, {num_chunks}] (the chunks), got {num_top}")
    num_programs, device = rows.shape[0], logits.device
    top = num_programs * num_top
    at_values = _aligned(8 * top, 16)  # each part starts 16-byte aligned for every row count (see _aligned)
    at_sampled = _aligned(at_values + 4 * top, 16)
    packed = torch.empty(at_sampled + 4 * num_programs, dtype=torch.uint8, device=device)
    ids = packed[: 8 * top].view(torch.int64).view(num_programs, num_top)
    values = packed[at_values : at_values + 4 * top].view(torch.float32).view(num_programs, num_top)
    sampled = packed[at_sampled:].view(torch.float32)
    if num_programs:
        scratch = SamplingScratch() if scratch is None else scratch
        stats, argmax = scratch.chunk_stats(num_programs, num_chunks, device)
        zeros = scratch.zeros(logits.shape[0], device)
        _chunk_stats_kernel[(num_programs, num_chunks)](
            logits, zeros, rows, stats, argmax, rows, logits.stride(0), num_programs, logits.shape[1], num_chunks,
            CHUNK_SIZE=chunk, num_warps=4, HAS_ROWS=True, DENSE_SOURCE=False,
        )  # fmt: skip
        top_pad = max(2, int(triton.next_power_of_2(max(num_top, 1))))
        _logprob_top_kernel[(num_programs,)](
            stats, logits, rows, tokens, values, ids, sampled, logits.stride(0), logits.shape[1], num_programs,
            num_chunks, num_top, CHUNKS_PAD=max(2, int(triton.next_power_of_2(num_chunks))), CHUNK_SIZE=chunk,
            TOP_PAD=top_pad, num_warps=8 if top_pad * chunk > 2048 else 4,
        )  # fmt: skip
    return values, ids, sampled, packed


def logprob_top_ref(
    logits: torch.Tensor, rows: torch.Tensor, num_top: int, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ``logprob_top`` (without the packing): (top logprobs (L, n) float32 best first, their ids
    (L, n) int64 (equal logits: the lowest id first), the sampled token's logprob (L,) float32)."""
    subset = logits.index_select(0, rows.long()).float()  # (L, V)
    lse = subset.logsumexp(dim=-1)
    order = torch.sort(subset, dim=-1, descending=True, stable=True)  # stable: equal logits keep id order
    top_values, top_ids = order.values[:, :num_top], order.indices[:, :num_top]
    chosen = subset.gather(1, tokens.index_select(0, rows.long())[:, None])[:, 0]
    return top_values - lse[:, None], top_ids, chosen - lse


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int, chunk: int = CHUNK) -> torch.Tensor:
    """Sample one token per row of logits (B, V) at temperature (B,) float32 (0 = greedy), Philox uniforms.

    Returns a (2, B) int64 tensor on the logits' device: row 0 the token ids, row 1 a 0/1 flag per row whose
    logits hold a NaN or an infinity. The same (logits, temperature, seed) always gives the same tokens.
    """
    num_rows = logits.shape[0] if logits.dim() == 2 else 0
    if tuple(temperature.shape) != (num_rows,):
        raise ValueError(f"temperature must have shape ({num_rows},), got {tuple(temperature.shape)}")
    positive = temperature > 0
    scale = torch.where(positive, 1.0 / torch.where(positive, temperature, 1.0), 0.0).float()
    batch = RowSampling(
        scale=scale,
        fixed=torch.zeros(num_rows, dtype=torch.int32, device=logits.device),
        uniforms=torch.empty(num_rows, dtype=torch.float32, device=logits.device),
        drawn=torch.empty((3, num_rows), dtype=torch.float32, device=logits.device),
        out=torch.empty((2, num_rows), dtype=torch.int64, device=logits.device),
    )
    sample_rows(logits, batch, seed, chunk=chunk)
    return batch.out

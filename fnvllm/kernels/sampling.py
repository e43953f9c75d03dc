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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
@triton.jit(do_not_specialize=["num_rows"])
def _chunk_stats_kernel(
    logits_ptr,
    temperature_ptr,
    stats_ptr,  # (3, B, C) float32: chunk max, chunk partition sum, non-finite flag
    argmax_ptr,  # (B, C) int32: index of the chunk's max (vocabulary index)
    stride_row,
    num_rows,
    vocab_size,
    num_chunks,
    CHUNK_SIZE: tl.constexpr,
):
    """Summarise chunk program_id(1) of row program_id(0)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    scale = tl.where(temperature > 0.0, 1.0 / tl.maximum(temperature, 1e-30), 1.0)
    cols = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    mask = cols < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    bad = tl.max((mask & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.float32), axis=0)
    scaled = tl.where(mask, x * scale, float("-inf"))
    top = tl.max(scaled, axis=0)
    first = tl.min(tl.where(scaled == top, cols, vocab_size), axis=0)  # lowest index among equal maxima
    total = tl.sum(tl.where(mask, tl.exp(scaled - top), 0.0), axis=0)
    at = row * num_chunks + chunk
    plane = num_rows * num_chunks
    tl.store(stats_ptr + at, top)
    tl.store(stats_ptr + plane + at, total)
    tl.store(stats_ptr + 2 * plane + at, bad)
    tl.store(argmax_ptr + at, first)


@triton.jit(do_not_specialize=["num_rows", "seed"])
def _pick_kernel(
    logits_ptr,
    temperature_ptr,
    stats_ptr,
    argmax_ptr,
    out_ptr,  # (2, B) int64: token ids, non-finite flags
    stride_row,
    num_rows,
    vocab_size,
    num_chunks,
    seed,
    CHUNK_SIZE: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    """Combine row program_id(0)'s chunk summaries, draw u, and find the sampled token (see the module doc)."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    chunk_ids = tl.arange(0, CHUNKS_PAD)
    live = chunk_ids < num_chunks
    plane = num_rows * num_chunks
    at = row * num_chunks + chunk_ids
    maxima = tl.load(stats_ptr + at, mask=live, other=float("-inf"))
    sums = tl.load(stats_ptr + plane + at, mask=live, other=0.0)
    bad = tl.max(tl.load(stats_ptr + 2 * plane + at, mask=live, other=0.0), axis=0)
    top = tl.max(maxima, axis=0)
    best_chunk = tl.min(tl.where(maxima == top, chunk_ids, CHUNKS_PAD), axis=0)
    greedy_token = tl.load(argmax_ptr + row * num_chunks + best_chunk)
    weights = tl.where(live, sums * tl.exp(maxima - top), 0.0)  # (C,) each chunk's share of Z, relative to M
    running = tl.cumsum(weights, axis=0)
    target = tl.rand(seed, row) * tl.sum(weights, axis=0)
    picked = tl.min(tl.where(running > target, chunk_ids, num_chunks - 1), axis=0)
    remainder = target - tl.sum(tl.where(chunk_ids < picked, weights, 0.0), axis=0)
    scale = 1.0 / tl.maximum(temperature, 1e-30)
    cols = picked * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    mask = cols < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.where(mask, tl.exp(x * scale - top), 0.0)
    inside = tl.cumsum(e, axis=0)
    crossing = tl.min(tl.where(inside > remainder, cols, vocab_size), axis=0)
    last_positive = tl.max(tl.where(e > 0.0, cols, 0), axis=0)  # float32 sums may fall short of the remainder
    sampled = tl.minimum(crossing, last_positive)
    token = tl.where(temperature > 0.0, sampled, greedy_token)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(out_ptr + num_rows + row, (bad > 0.0).to(tl.int64))


@triton.jit
def _philox_uniform_kernel(out_ptr, seed):
    """The uniform pass 2 draws for row program_id(0) (for tests and the reference)."""
    row = tl.program_id(0)
    tl.store(out_ptr + row, tl.rand(seed, row))


def philox_uniforms(num_rows: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """(num_rows,) float32: exactly the uniforms ``fused_sample`` draws for ``seed``."""
    out = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows:
        _philox_uniform_kernel[(num_rows,)](out, seed)
    return out


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int, chunk: int = CHUNK) -> torch.Tensor:
    """Sample one token per row of logits (B, V) at temperature (B,) float32 (0 = greedy).

    Returns a (2, B) int64 tensor on the logits' device: row 0 the token ids, row 1 a 0/1 flag per row whose
    logits hold a NaN or an infinity (copy both to the host with one transfer). ``seed`` (0 <= seed < 2**31)
    keys the row uniforms: the same (logits, temperature, seed) always gives the same tokens. ``chunk`` (a power
    of two) is the pass-1 chunk; V / chunk must be at most 1024.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (B, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    if tuple(temperature.shape) != (num_rows,):
        raise ValueError(f"temperature must have shape ({num_rows},), got {tuple(temperature.shape)}")
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    num_chunks = triton.cdiv(vocab_size, chunk)
    if num_chunks > _MAX_CHUNKS or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two with vocab_size / chunk <= {_MAX_CHUNKS}, got {chunk}")
    out = torch.empty((2, num_rows), dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    stats = torch.empty((3, num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    argmax = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_stats_kernel[(num_rows, num_chunks)](
        logits,
        temperature,
        stats,
        argmax,
        logits.stride(0),
        num_rows,
        vocab_size,
        num_chunks,
        CHUNK_SIZE=chunk,
        num_warps=8,
    )
    _pick_kernel[(num_rows,)](
        logits,
        temperature,
        stats,
        argmax,
        out,
        logits.stride(0),
        num_rows,
        vocab_size,
        num_chunks,
        seed,
        CHUNK_SIZE=chunk,
        CHUNKS_PAD=max(2, int(triton.next_power_of_2(num_chunks))),
        num_warps=8,
    )
    return out

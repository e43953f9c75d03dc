"""Torch references of the sampling kernels (``fnvllm.kernels.sampling`` and ``sampling_filters``), importable
without Triton: the CPU executor samples with them, and the kernel tests compare against them.

Same uniforms, same tokens: the references round the scaled logits s = x * (1 / T) and exp(s - M) in float32 as
the kernels do and sum masses in float64, so a token can differ only where a uniform or a filter's threshold
lies within float32 rounding of a CDF step (the module doc of ``sampling_filters`` defines the filters).
"""

from __future__ import annotations

import torch


def _scaled_ref(logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 s = x * scale + 0 (the kernel's rounding; + 0 turns -0.0 into +0.0), scale 0 read as 1."""
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return logits.float() * scale[:, None] + 0.0


def _threshold(s: torch.Tensor, e: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(R, 1) the top-k / top-p threshold tau of each row of s (R, V), by sorting (see sampling_filters)."""
    sorted_s, order = s.sort(dim=-1, descending=True)
    cum = e.gather(1, order).double().cumsum(dim=-1)  # (R, V) mass of the j+1 best
    vocab = s.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    tau_k = sorted_s.gather(1, (k - 1)[:, None])  # (R, 1)
    last_k = ((sorted_s >= tau_k).sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # last top-k rank (ties kept)
    target = top_p.double()[:, None] * cum.gather(1, last_k)
    first = (cum < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)  # first rank whose mass reaches it
    return torch.maximum(sorted_s.gather(1, first), tau_k)


def filtered_sample_ref(
    logits: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of one draw per row by sorting: logits (R, V), scale (R,) float32 > 0, top_k (R,) int
    (0 = off), top_p / min_p (R,) float32 (1 / 0 = off), uniforms (R,) in [0, 1). Returns (R,) int64 tokens.
    Masses are float64 sums of float32 exp(s - M), so only a u or a threshold within rounding can differ."""
    return filtered_sample_sorted(logits, scale, top_k, top_p, min_p, uniforms, bool(((top_k > 0) | (top_p < 1)).any()))


def filtered_sample_sorted(
    logits: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    cut: bool = True,
) -> torch.Tensor:
    """``filtered_sample_ref`` without reading anything back to the host (the executor's GPU path for filtered
    rows: no sync, so overlapped steps stay overlapped). cut=False skips the sort when no row has top-k or
    top-p; a row with neither keeps every token either way."""
    s = _scaled_ref(logits, scale)  # (R, V)
    top = s.amax(dim=-1, keepdim=True)
    e = (s - top).exp()  # float32, like the kernel
    kept = e >= min_p[:, None]
    if cut:
        kept &= s >= _threshold(s, e, top_k, top_p)
    cdf = torch.where(kept, e.double(), 0.0).cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniforms.double()[:, None] * cdf[:, -1:], right=True).squeeze(1)
    last_kept = s.shape[1] - 1 - kept.flip(-1).int().argmax(dim=-1)
    return torch.minimum(sampled, last_kept)


def log_partition_ref(logits: torch.Tensor) -> torch.Tensor:
    """(R,) float32 log sum exp of each raw logits row (R, V)."""
    return logits.float().logsumexp(dim=-1)


def sample_rows_ref(
    logits: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits (B, V): the argmax where scale (B,) is 0 (greedy), else a draw at uniforms (B,)
    from softmax(x * scale) cut by top_k (B,) int (0 = off), top_p and min_p (B,) float32 (1 / 0 = off).
    Returns (tokens (B,) int64, non_finite (B,) bool: the row holds a NaN or an infinity). Only rows with a
    top-k or top-p are sorted."""
    tokens = logits.argmax(dim=-1)
    sampled = scale > 0
    sorted_rows = sampled & ((top_k > 0) | (top_p < 1))
    plain = sampled & ~sorted_rows
    for rows, k in ((sorted_rows, top_k), (plain, torch.zeros_like(top_k))):  # plain rows have top_p 1
        if bool(rows.any()):
            args = (logits[rows], scale[rows], k[rows], top_p[rows], min_p[rows], uniforms[rows])
            tokens[rows] = filtered_sample_ref(*args)
    return tokens, ~torch.isfinite(logits).all(dim=-1)


def penalize_ref(work: torch.Tensor, tokens: torch.Tensor, meta: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``fnvllm.kernels.penalties.penalize_``: in place on work (P, V) float32, row i penalised
    from tokens[meta[0, i], :meta[1, i]] (its last meta[2, i] being outputs) by factors[:, i] (repetition,
    frequency, presence); returns ``work``. Dense over the vocabulary: one scatter of counts and seen flags."""
    num_rows, vocab = work.shape
    if not num_rows:
        return work
    buffer_rows, ctx, outputs = meta.long().unbind(0)
    width = int(ctx.max())
    seq = tokens.index_select(0, buffer_rows)[:, :width].long()  # (P, L) padded past each row's ctx
    position = torch.arange(width, device=work.device)
    valid = (position < ctx[:, None]) & (seq >= 0) & (seq < vocab)
    output = valid & (position >= (ctx - outputs)[:, None])
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.int32, device=work.device)
    counts.scatter_add_(1, torch.where(output, seq, vocab), output.int())
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=work.device)
    seen.scatter_(1, torch.where(valid, seq, vocab), True)
    counts, seen = counts[:, :vocab].float(), seen[:, :vocab]
    repetition, frequency, presence = (f[:, None] for f in factors.float().unbind(0))
    edited = torch.where(work > 0, work / repetition, work * repetition)
    edited = edited - (frequency * counts + presence * (counts > 0).float())
    return work.copy_(torch.where(seen, edited, work))

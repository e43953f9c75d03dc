"""Grammar masks on the logits: a Triton kernel beside its torch reference.

Why: the constrained rows of a step (``fnvllm.executor.structured``) allow only the tokens their bitmask sets. In
torch that is a gather of the (R, W) bitmask to (R, V), two shifts, a compare, a row gather of the logits, a fill
and a scatter back: seven launches and several (R, V) temporaries per step (R 64, V 151,936: ~40 MB each). The
kernel writes MASKED_LOGIT straight into the disallowed positions of the constrained rows: it reads the bitmask
(1.2 MB) and writes only what it masks, no temporaries, one launch. The other rows are never touched.

Layout (xgrammar's): bit t % 32 of word t // 32 of a bitmask row is set when token t is allowed. Worked example,
V 40, one constrained row with words (0, 1 << 3): only token 32 + 3 = 35 is allowed; tokens 0..34 and 36..39 get
the masked value.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "mask_rows", "mask_rows_ref"]

BLOCK = 4096  # tokens per program: 38 programs per row for a 151,936-token vocabulary


def mask_rows_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, value: float) -> None:
    """Torch reference of ``mask_rows``: set ``logits[rows[r], t] = value`` (in place) wherever bit t of
    ``bitmask[r]`` is clear. logits (B, V); bitmask (R, ceil(V / 32)) int32; rows (R,) int64 distinct."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    words = bitmask.index_select(1, ids >> 5)  # (R, V)
    allowed = ((words >> (ids & 31)) & 1).bool()  # (R, V)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, value))


@triton.jit
def _mask_rows_kernel(logits_ptr, row_stride, bitmask_ptr, words, rows_ptr, vocab, value, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = ids < vocab
    word = tl.load(bitmask_ptr + r * words + (ids >> 5), mask=inside, other=-1)
    allowed = ((word >> (ids & 31)) & 1) != 0
    row = tl.load(rows_ptr + r).to(tl.int64)
    tl.store(logits_ptr + row * row_stride + ids, value, mask=inside & ~allowed)


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, value: float) -> None:
    """Set ``logits[rows[r], t] = value`` (in place, in the logits' dtype) wherever bit t of ``bitmask[r]`` is clear;
    every other element is left as it is. logits (B, V) with unit stride along V; bitmask (R, ceil(V / 32)) int32
    contiguous; rows (R,) integer, distinct, on the logits' device."""
    num_rows, words = bitmask.shape
    vocab = logits.shape[1]
    if logits.stride(1) != 1 or not bitmask.is_contiguous() or bitmask.dtype != torch.int32:
        raise ValueError("mask_rows: logits need unit stride along the vocabulary, the bitmask contiguous int32")
    if words * 32 < vocab or rows.shape != (num_rows,):
        raise ValueError(f"mask_rows: bitmask {tuple(bitmask.shape)} and rows {tuple(rows.shape)} for vocab {vocab}")
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _mask_rows_kernel[grid](
        logits, logits.stride(0), bitmask, words, rows, vocab, _rounded(value, logits.dtype), BLOCK=BLOCK
    )


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` as torch rounds it (the reference's fill), so the kernel stores the same bits."""
    return torch.tensor(value, dtype=dtype).item()

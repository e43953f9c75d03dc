"""Repetition / presence / frequency penalties from a device token buffer: a Triton kernel beside its reference.

Each penalised row i has its sequence in a row of a token buffer (``fnvllm.executor.history.SlotHistory``):
``tokens[buffer_row, 0:ctx]`` is prompt then outputs, the last ``num_outputs`` of them generated. The kernel edits
the row's float32 logits (a copy, ``work[i]``) only at the tokens the row has seen, as HF and OpenAI define them:

    repetition (every token seen in prompt or output):  x = x / r if x > 0 else x * r
    presence / frequency (output tokens, count c > 0):  x = x - (frequency * c + presence * (c > 0))

One program per row (G programs take rows g, g + G, ... in turn), three passes over its positions (no pass over
the vocabulary):

    1. count:  counts[i, tok] += 1 for each output position (atomic adds into a zeroed int32 scratch row);
    2. edit:   for each position, an atomic OR of OWNED into counts[i, tok] returns the count and elects one owner
               per distinct token (the position that saw the bit clear), which alone reads, edits and writes
               work[i, tok] -- so a token seen twice is edited once, from its original value;
    3. reset:  counts[i, tok] = 0 at every position, so the scratch is zero again for the next launch.

Cost per row: three reads of its ~ctx token ids and ctx scattered reads/writes of logits, against 155 MB per pass
for a dense (256, 151,936) float32 count tensor. The scratch is (G, V) int32, zeroed once by its owner.

Worked example: tokens (5, 7, 5 | 7, 7) with 2 outputs, r 2, frequency 1, presence 0.5: counts[7] = 2, counts[5]
= 0; token 5 becomes x5 / 2 (if positive), token 7 becomes x7 / 2 - (1 * 2 + 0.5).

Why that kernel is slow (61 us at 256 rows of ~1,100 tokens on the H200, for ~282k edits): 128 programs of 4
warps on 132 SMs, each taking two rows in turn, each row three passes of two 1,024-position blocks, every block a
chain of dependent global accesses (token ids, then atomics or loads, then stores) behind a barrier: latency, with
almost nothing to hide it. Two other routes, the same rows bit for bit:

    ``penalize_from_``  each edit reads its value from the source logits, not the copy, so rows of repetition
                        alone need no count and no owner: a (rows, REPETITION_PARTS) grid of short programs (with
                        ``float_rows``: 92 us against 131 at 256 rows, 24 against 43 at 64, measured there);
    ``penalised_rows``  the copy and the edits in one (rows, vocabulary blocks) launch, each block walking its
                        row's history for the tokens inside it (slower there: every block walks the whole history).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.sampling_ref import penalize_ref

__all__ = [
    "OWNED",
    "float_rows",
    "float_rows_ref",
    "penalised_rows",
    "penalize_",
    "penalize_from_",
    "penalize_ref",
]

OWNED = 1 << 30  # the owner bit of a count (output counts are below max_model_len, far below 2**30)
_BLOCK = 1024  # positions per block


@triton.jit
def _row_penalty(tokens_ptr, meta_ptr, factors_ptr, i, num_rows, stride_tokens):
    """Penalised row i's token row in the slot buffer, context length, first output position, and its repetition,
    frequency and presence factors (meta (3, P): slot, context length, outputs; factors (3, P))."""
    row_tokens = tokens_ptr + tl.load(meta_ptr + i) * stride_tokens
    ctx = tl.load(meta_ptr + num_rows + i)
    first_output = ctx - tl.load(meta_ptr + 2 * num_rows + i)
    repetition = tl.load(factors_ptr + i)
    frequency = tl.load(factors_ptr + num_rows + i)
    presence = tl.load(factors_ptr + 2 * num_rows + i)
    return row_tokens, ctx, first_output, repetition, frequency, presence


@triton.jit(do_not_specialize=["stride_tokens", "num_rows"])
def _penalize_kernel(
    work_ptr,  # (P, V) float32, edited in place at the row's seen tokens
    tokens_ptr,  # (N, L) int32 token buffer
    meta_ptr,  # (3, P) int64: buffer row, context length ctx, number of outputs (the last ones before ctx)
    factors_ptr,  # (3, P) float32: repetition, frequency, presence
    counts_ptr,  # (G, V) int32 scratch, one row per program, zero on entry and on exit
    src_ptr,  # FROM_SOURCE: (N, V) logits whose row src_rows[i] (or i) holds row i's values
    src_rows_ptr,  # FROM_SOURCE and HAS_SRC_ROWS: (P,) int32 / int64
    edited_ptr,  # FROM_SOURCE: (P, ceil(V / 32)) int32 bitmask, zero on entry: receives the edited tokens' bits
    stride_work,
    stride_tokens,
    stride_src,
    num_rows,
    vocab_size,
    OWNED_BIT: tl.constexpr,
    BLOCK: tl.constexpr,
    FROM_SOURCE: tl.constexpr,
    HAS_SRC_ROWS: tl.constexpr,
    MARK: tl.constexpr,
):
    """Penalise rows program_id(0), + G, + 2G, ... of ``work`` (G programs; see the module doc); FROM_SOURCE: read
    each edited value from the source logits (upcast) instead of ``work``, and (MARK) set its bit in ``edited``."""
    counts = counts_ptr + tl.program_id(0).to(tl.int64) * vocab_size
    ones = tl.full([BLOCK], 1, dtype=tl.int32)
    for i in range(tl.program_id(0).to(tl.int64), num_rows, tl.num_programs(0)):  # int64: i * stride_work
        row_tokens, ctx, first_output, repetition, frequency, presence = _row_penalty(
            tokens_ptr, meta_ptr, factors_ptr, i, num_rows, stride_tokens
        )
        if FROM_SOURCE:  # a row with a repetition penalty alone is _repetition_from_kernel's: no pass here
            counted = (frequency != 0.0) | (presence != 0.0)
            ctx = tl.where(counted, ctx, 0)
            first_output = tl.where(counted, first_output, 0)
        work = work_ptr + i * stride_work
        for start in range(first_output, ctx, BLOCK):  # 1. output counts
            pos = start + tl.arange(0, BLOCK)
            tok = tl.load(row_tokens + pos, mask=pos < ctx, other=0)
            tl.atomic_add(counts + tok, ones, mask=(pos < ctx) & (tok >= 0) & (tok < vocab_size))
        tl.debug_barrier()
        for start in range(0, ctx, BLOCK):  # 2. one owner per distinct token edits it
            pos = start + tl.arange(0, BLOCK)
            tok = tl.load(row_tokens + pos, mask=pos < ctx, other=0)
            ok = (pos < ctx) & (tok >= 0) & (tok < vocab_size)
            old = tl.atomic_or(counts + tok, ones * OWNED_BIT, mask=ok)
            owner = ok & ((old & OWNED_BIT) == 0)
            if FROM_SOURCE:
                src_row = tl.load(src_rows_ptr + i).to(tl.int64) if HAS_SRC_ROWS else i
                x = tl.load(src_ptr + src_row * stride_src + tok, mask=owner, other=0.0).to(tl.float32)
            else:
                x = tl.load(work + tok, mask=owner, other=0.0)
            x = tl.where(x > 0.0, tl.math.div_rn(x, repetition), x * repetition)
            c = old.to(tl.float32)
            x = x - (frequency * c + presence * (c > 0.0).to(tl.float32))
            tl.store(work + tok, x, mask=owner)
            if MARK:
                words = (vocab_size + 31) // 32
                tl.atomic_or(edited_ptr + i * words + tok // 32, ones << (tok % 32), mask=owner)
        tl.debug_barrier()
        for start in range(0, ctx, BLOCK):  # 3. the scratch back to zero
            pos = start + tl.arange(0, BLOCK)
            tok = tl.load(row_tokens + pos, mask=pos < ctx, other=0)
            tl.store(counts + tok, ones * 0, mask=(pos < ctx) & (tok >= 0) & (tok < vocab_size))
        tl.debug_barrier()


@triton.jit(do_not_specialize=["stride_tokens", "num_rows"])
def _repetition_from_kernel(
    work_ptr,  # (P, V) float32: receives the edited values
    tokens_ptr,  # (N, L) int32 token buffer
    meta_ptr,  # (3, P) int64: buffer row, context length, number of outputs
    factors_ptr,  # (3, P) float32: repetition, frequency, presence
    src_ptr,  # (N, V) logits whose row src_rows[i] (or i) holds row i's values
    src_rows_ptr,  # (P,) int32 / int64 (when HAS_SRC_ROWS)
    edited_ptr,  # (P, ceil(V / 32)) int32 bitmask: receives the edited tokens' bits
    stride_work,
    stride_tokens,
    stride_src,
    num_rows,
    vocab_size,
    HAS_SRC_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MARK: tl.constexpr,
):
    """Row program_id(0), if its only penalty is repetition, positions part, part + parts, ... (in BLOCKs) of its
    context: x = x / r if x > 0 else x * r from the source value. No count and no owner: every position of a
    token writes the same value (read from the source, never from work), so repeats need no election."""
    i = tl.program_id(0).to(tl.int64)
    frequency = tl.load(factors_ptr + num_rows + i)
    presence = tl.load(factors_ptr + 2 * num_rows + i)
    ctx = tl.where((frequency == 0.0) & (presence == 0.0), tl.load(meta_ptr + num_rows + i), 0)
    row_tokens = tokens_ptr + tl.load(meta_ptr + i) * stride_tokens
    repetition = tl.load(factors_ptr + i)
    source = src_ptr + (tl.load(src_rows_ptr + i).to(tl.int64) if HAS_SRC_ROWS else i) * stride_src
    edited = edited_ptr + i * ((vocab_size + 31) // 32)
    ones = tl.full([BLOCK], 1, dtype=tl.int32)
    first = tl.program_id(1).to(tl.int64) * BLOCK
    for start in range(first, ctx, tl.num_programs(1).to(tl.int64) * BLOCK):
        pos = start + tl.arange(0, BLOCK)
        tok = tl.load(row_tokens + pos, mask=pos < ctx, other=0)
        ok = (pos < ctx) & (tok >= 0) & (tok < vocab_size)
        x = tl.load(source + tok, mask=ok, other=0.0).to(tl.float32)
        x = tl.where(x > 0.0, tl.math.div_rn(x, repetition), x * repetition)
        tl.store(work_ptr + i * stride_work + tok, x, mask=ok)
        if MARK:
            tl.atomic_or(edited + tok // 32, ones << (tok % 32), mask=ok)


REPETITION_PARTS = 4  # programs per row of _repetition_from_kernel (a knob bench_penalties.py --sweep times)
REPETITION_BLOCK = 256  # positions per block of _repetition_from_kernel


def _check_penalize(
    work: torch.Tensor, tokens: torch.Tensor, meta: torch.Tensor, factors: torch.Tensor, counts: torch.Tensor
) -> None:
    """Raise ValueError naming the first of penalize_'s arguments that does not fit (see its doc)."""
    num_rows, vocab = work.shape
    if work.dtype != torch.float32 or work.stride(1) != 1:
        raise ValueError(f"work must be float32 with contiguous rows, got {work.dtype}, strides {work.stride()}")
    if tokens.dtype != torch.int32 or tokens.dim() != 2 or tokens.stride(1) != 1:
        raise ValueError(f"tokens must be a row-contiguous (N, L) int32 tensor, got {tokens.dtype} {tokens.shape}")
    if tuple(meta.shape) != (3, num_rows) or tuple(factors.shape) != (3, num_rows):
        raise ValueError(f"meta and factors must be (3, {num_rows}), got {tuple(meta.shape)}, {tuple(factors.shape)}")
    if counts.dtype != torch.int32 or counts.dim() != 2 or counts.shape[0] < 1 or counts.shape[1] != vocab:
        raise ValueError(f"counts must be (G >= 1, {vocab}) int32, got {counts.dtype} {tuple(counts.shape)}")


def penalize_(
    work: torch.Tensor, tokens: torch.Tensor, meta: torch.Tensor, factors: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """In place on ``work`` (P, V) float32 (row-contiguous): repetition, then presence / frequency penalties of
    each row from its tokens (module doc); returns ``work``.

    tokens: (N, L) int32 buffer; meta: (3, P) int64 buffer row, context length and output count per row (ctx <=
    L, outputs <= ctx); factors: (3, P) float32 repetition (> 0), frequency and presence; counts: (G, V) int32
    scratch that is all zero (and is left so): G programs, each penalising rows g, g + G, ... in turn.
    """
    num_rows, vocab = work.shape
    _check_penalize(work, tokens, meta, factors, counts)
    if num_rows:
        _penalize_kernel[(min(num_rows, counts.shape[0]),)](
            work, tokens, meta.contiguous(), factors.contiguous(), counts, work, work, work, work.stride(0),
            tokens.stride(0), 0, num_rows, vocab, OWNED_BIT=OWNED, BLOCK=_BLOCK, FROM_SOURCE=False, HAS_SRC_ROWS=False,
            MARK=False,
        )  # fmt: skip
    return work


def penalize_from_(
    work: torch.Tensor,
    source: torch.Tensor,
    rows: torch.Tensor | None,
    tokens: torch.Tensor,
    meta: torch.Tensor,
    factors: torch.Tensor,
    counts: torch.Tensor,
    edited: torch.Tensor | None,
    counted: bool = True,
) -> torch.Tensor:
    """``penalize_`` with each edited value read from ``source`` (N, V) (row rows[i] holds row i; rows None: row i)
    and upcast, written to ``work`` (P, V) float32 (only there), and, when ``edited`` is given, its bit set there
    ((P, ceil(V / 32)) int32, zero on entry: bit t % 32 of word t // 32): for a caller that makes the rest of the
    copy itself. Without ``edited``: ``work`` already holds the upcast rows (``float_rows``),
    and ends exactly as ``penalize_`` leaves it. Returns ``work``.
    Rows whose only penalty is repetition take a launch of their own on a (rows, REPETITION_PARTS) grid with no
    count pass (the edit of a token then depends on its source value alone); the others take ``penalize_``'s three
    passes. counted False: the caller knows that no row has a frequency or presence penalty, and that second launch
    is skipped (its programs would find no position to count)."""
    num_rows, vocab = work.shape
    if source.dim() != 2 or source.stride(1) != 1 or source.shape[1] != vocab:
        raise ValueError(f"source must be (N, {vocab}) with a contiguous last dim, got {tuple(source.shape)}")
    words = triton.cdiv(vocab, 32)
    if edited is not None and (tuple(edited.shape) != (num_rows, words) or edited.dtype != torch.int32):
        raise ValueError(f"edited must be ({num_rows}, {words}) int32, got {tuple(edited.shape)}")
    _check_penalize(work, tokens, meta, factors, counts)
    if num_rows:
        meta, factors, src_rows = meta.contiguous(), factors.contiguous(), source if rows is None else rows
        _repetition_from_kernel[(num_rows, REPETITION_PARTS)](
            work, tokens, meta, factors, source, src_rows, work if edited is None else edited, work.stride(0),
            tokens.stride(0), source.stride(0), num_rows, vocab, HAS_SRC_ROWS=rows is not None,
            BLOCK=REPETITION_BLOCK, MARK=edited is not None,
        )  # fmt: skip
        if not counted:
            return work
        _penalize_kernel[(min(num_rows, counts.shape[0]),)](
            work, tokens, meta, factors, counts, source, src_rows, work if edited is None else edited, work.stride(0),
            tokens.stride(0), source.stride(0), num_rows, vocab, OWNED_BIT=OWNED, BLOCK=_BLOCK, FROM_SOURCE=True,
            HAS_SRC_ROWS=rows is not None, MARK=edited is not None,
        )  # fmt: skip
    return work


_COPY_BLOCK = 4096  # elements per program of float_rows


@triton.jit
def _float_rows_kernel(src_ptr, rows_ptr, out_ptr, stride_src, vocab_size, HAS_ROWS: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    """Block program_id(1) of output row program_id(0): source row rows[i] (or i) upcast to float32."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    x = tl.load(src_ptr + row * stride_src + cols, mask=mask)
    tl.store(out_ptr + i.to(tl.int64) * vocab_size + cols, x.to(tl.float32), mask=mask)


def float_rows(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """(P, V) float32 contiguous copy of logits rows ``rows`` ((P,) int32 / int64; None: every row), upcast: one
    launch on a (rows, blocks) grid, in place of torch's index_select then ``.float()`` (a pass over a (256,
    151,936) bf16 batch ran at ~2 TB/s on the H200, about half the copy bandwidth). Reference: ``float_rows_ref``."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (N, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    out = torch.empty((num_rows, logits.shape[1]), dtype=torch.float32, device=logits.device)
    if num_rows and logits.shape[1]:
        _float_rows_kernel[(num_rows, triton.cdiv(logits.shape[1], _COPY_BLOCK))](
            logits, logits if rows is None else rows, out, logits.stride(0), logits.shape[1],
            HAS_ROWS=rows is not None, BLOCK=_COPY_BLOCK, num_warps=4,
        )  # fmt: skip
    return out


def float_rows_ref(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of ``float_rows``."""
    return (logits if rows is None else logits.index_select(0, rows.long())).float().contiguous()


SEEN = 1 << 30  # the seen bit of ``penalised_rows``' in-row scratch (output counts stay below max_model_len)
# ``penalised_rows``' tile: vocabulary columns per program (its share of the copy), history positions per pass, warps.
# Knobs a GPU run sweeps (benchmarks/bench_penalties.py --sweep). The best of 14 tiles on the H200 (mid call
# 2026-12-02 14:10, 256 rows of ~1,100 tokens, repetition alone): 16384 / 2048 / 16, 86.8 us per call (4096 / 1024 /
# 4: 126.3; fewer blocks per row walk its history fewer times); with presence and frequency 4096 / 2048 / 8 (171.8).
FUSED_BLOCK = 16384
FUSED_HISTORY_BLOCK = 2048
FUSED_WARPS = 16


@triton.jit(do_not_specialize=["stride_tokens", "num_rows"])
def _penalised_rows_kernel(
    src_ptr,  # (N, V) logits (any float dtype)
    rows_ptr,  # HAS_ROWS: (P,) int32 / int64 source row of output row i
    out_ptr,  # (P, V) float32 output, contiguous
    scratch_ptr,  # the same memory as out_ptr, as int32 (a counted row's block holds its counts, then its values)
    tokens_ptr,  # (N', L) int32 token buffer
    meta_ptr,  # (3, P) int64: buffer row, context length ctx, number of outputs (the last ones before ctx)
    factors_ptr,  # (3, P) float32: repetition, frequency, presence
    stride_src,
    stride_tokens,
    num_rows,
    vocab_size,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr,
    SEEN_BIT: tl.constexpr,
):
    """Columns [b * BLOCK, (b + 1) * BLOCK) of output row i (b = program_id(1), i = program_id(0)): the source
    row upcast, penalised at the tokens of the row's history that fall in them (see ``penalised_rows``)."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i
    low = tl.program_id(1) * BLOCK
    cols = low + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    high = tl.minimum(low + BLOCK, vocab_size)
    source = src_ptr + row * stride_src
    out = out_ptr + i * vocab_size
    row_tokens, ctx, first_output, repetition, frequency, presence = _row_penalty(
        tokens_ptr, meta_ptr, factors_ptr, i, num_rows, stride_tokens
    )
    counted = (frequency != 0.0) | (presence != 0.0)
    alone_ctx = tl.where(counted, 0, ctx)  # ctx for a row of repetition alone, else no position
    # The history's first HISTORY_BLOCK positions, and (repetition alone) their source values, before the copy's
    # load: their latency hides behind it; the loops below start after them.
    pos = tl.arange(0, HISTORY_BLOCK)
    tok = tl.load(row_tokens + pos, mask=pos < ctx, other=-1)
    ok = (pos < ctx) & (tok >= low) & (tok < high)
    v = tl.load(source + tok, mask=ok & (pos < alone_ctx), other=0.0).to(tl.float32)
    x = tl.load(source + cols, mask=inside, other=0.0).to(tl.float32)
    ones = tl.full([HISTORY_BLOCK], 1, dtype=tl.int32)
    if counted:  # the block's counts and seen bits in the output block itself
        scratch = scratch_ptr + i * vocab_size
        tl.store(scratch + cols, tl.zeros([BLOCK], dtype=tl.int32), mask=inside)
        tl.debug_barrier()
        tl.atomic_add(scratch + tok, ones, mask=ok & (pos >= first_output))
        tl.atomic_or(scratch + tok, ones * SEEN_BIT, mask=ok & (pos < first_output))
        for start in range(HISTORY_BLOCK, ctx, HISTORY_BLOCK):
            at = start + tl.arange(0, HISTORY_BLOCK)
            seen = tl.load(row_tokens + at, mask=at < ctx, other=-1)
            hit = (at < ctx) & (seen >= low) & (seen < high)
            tl.atomic_add(scratch + seen, ones, mask=hit & (at >= first_output))
            tl.atomic_or(scratch + seen, ones * SEEN_BIT, mask=hit & (at < first_output))
        tl.debug_barrier()
        state = tl.load(scratch + cols, mask=inside, other=0, cache_modifier=".cg")
        c = (state & (SEEN_BIT - 1)).to(tl.float32)
        edited = tl.where(x > 0.0, tl.math.div_rn(x, repetition), x * repetition)
        edited = edited - (frequency * c + presence * (c > 0.0).to(tl.float32))
        tl.debug_barrier()
        tl.store(out + cols, tl.where(state != 0, edited, x), mask=inside)
    else:  # repetition alone: the copy, then each seen token's value from the source (repeats write the same)
        tl.store(out + cols, x, mask=inside)
        tl.debug_barrier()
        tl.store(out + tok, tl.where(v > 0.0, tl.math.div_rn(v, repetition), v * repetition), mask=ok)
        for start in range(HISTORY_BLOCK, ctx, HISTORY_BLOCK):
            at = start + tl.arange(0, HISTORY_BLOCK)
            seen = tl.load(row_tokens + at, mask=at < ctx, other=-1)
            hit = (at < ctx) & (seen >= low) & (seen < high)
            w = tl.load(source + seen, mask=hit, other=0.0).to(tl.float32)
            tl.store(out + seen, tl.where(w > 0.0, tl.math.div_rn(w, repetition), w * repetition), mask=hit)


def penalised_rows(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    tokens: torch.Tensor,
    meta: torch.Tensor,
    factors: torch.Tensor,
    block: int | None = None,
    history_block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """(P, V) float32 rows ``rows`` of ``logits`` (None: every row), upcast and penalised, in ONE launch: equal bit
    for bit to ``penalize_(float_rows(logits, rows), tokens, meta, factors, counts)`` (tokens, meta, factors as
    there), without a count scratch.

    A (rows, vocabulary blocks) grid: each program upcasts its block of the row, then walks the row's history
    (~ctx token ids, read by every block of the row from L2) for the tokens in its block. A row with a repetition
    penalty alone writes its block, then each such token's penalised value computed from the source logits (so a
    token seen twice writes the same value twice). A row with a presence or frequency penalty first uses its
    output block as an int32 scratch: zeroed, then one atomic add per output position and one atomic OR of a
    seen bit per prompt position, then reads it back and writes every column, edited where the scratch is not
    zero. (A penalty of -0.0 counts as none: a logit of -0.0 may then keep its sign where the old path flips it.)
    block / history_block / num_warps: the tile (None: FUSED_BLOCK, FUSED_HISTORY_BLOCK, FUSED_WARPS)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (N, V) with a contiguous last dim, got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    vocab = logits.shape[1]
    if tokens.dtype != torch.int32 or tokens.dim() != 2 or tokens.stride(1) != 1:
        raise ValueError(f"tokens must be a row-contiguous (N, L) int32 tensor, got {tokens.dtype} {tokens.shape}")
    if tuple(meta.shape) != (3, num_rows) or tuple(factors.shape) != (3, num_rows):
        raise ValueError(f"meta and factors must be (3, {num_rows}), got {tuple(meta.shape)}, {tuple(factors.shape)}")
    out = torch.empty((num_rows, vocab), dtype=torch.float32, device=logits.device)
    if num_rows and vocab:
        block = block or FUSED_BLOCK
        _penalised_rows_kernel[(num_rows, triton.cdiv(vocab, block))](
            logits, logits if rows is None else rows, out, out.view(torch.int32), tokens, meta.contiguous(),
            factors.contiguous(), logits.stride(0), tokens.stride(0), num_rows, vocab, HAS_ROWS=rows is not None,
            BLOCK=block, HISTORY_BLOCK=history_block or FUSED_HISTORY_BLOCK, SEEN_BIT=SEEN,
            num_warps=num_warps or FUSED_WARPS,
        )  # fmt: skip
    return out

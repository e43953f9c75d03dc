"""The sampler's two backends over one ``SamplingBatch``: the fused Triton kernels, and their torch references.

``sample_with_kernels`` (CUDA): for each row group (the rows sampled from the logits as they are, and the
penalised rows sampled from their float32 copy) one ``sample_rows`` launch pair samples every row (greedy rows
take the argmax, unfiltered rows are done), then the group's top-k / top-p / min-p rows are redrawn: by one
``filtered_pick`` launch when every such row has a top-k or only a min-p (min-p-only batches by ``minp_pick``'s
two launches with MIN_P_BY_CHUNKS; with TOP_K_BY_SEGMENTS, top-k rows by
``segmented_pick``'s two launches at full parallelism; with TOP_K_BY_FILTER_KERNEL off, from their best candidates:
torch.topk, then one ``candidates_pick`` launch), else by sorting. A batch with no penalties and no filters is
exactly two kernel launches over the logits. Penalised rows: a float32 copy (by torch, or by ``float_rows`` with
PENALISED_COPY_BY_KERNEL), edited at each row's seen tokens by one launch of ``fnvllm.kernels.penalties`` (when the
penalties come from the executor's slot buffer).

``sample_with_references`` (CPU, or anywhere without Triton): the same computation with
``fnvllm.kernels.sampling_ref``; uniforms of unseeded rows come from a torch.Generator.

Worked example: rows (T 0.6), (T 0), (T 0.6, top_p 0.9), (T 0.8, repetition_penalty 1.1): rows 0-2 form the plain
group, read from the logits (row 1 greedy, row 2 also filtered); row 3 forms the penalised group, a (1, V) float32
copy edited in place before it is sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fnvllm.executor.base import NonFiniteLogitsError
from fnvllm.kernels.sampling_ref import filtered_sample_sorted, sample_rows_ref

if TYPE_CHECKING:
    from fnvllm.executor.sampler import RowGroup, SamplingBatch
    from fnvllm.kernels.sampling import RowSampling, SamplingScratch

__all__ = [
    "KernelGraphSampler",
    "NonFiniteLogitsError",
    "check_finite",
    "graph_top_k_limit",
    "sample_with_kernels",
    "sample_with_references",
]


def penalised_copy(logits: torch.Tensor, batch: SamplingBatch, kernels: bool = False) -> torch.Tensor | None:
    """(P, V) float32 copy of the penalised rows with their penalties applied, None when no row has one. kernels:
    the copy by ``fnvllm.kernels.penalties.float_rows`` when PENALISED_COPY_BY_KERNEL (one launch that gathers
    and upcasts), else by torch. With penalties from the slot buffer (the same rows bit for bit on every route):
    REPETITION_FROM_SOURCE and no row with a frequency or presence penalty, the edits by one launch of
    ``penalize_from_`` on a (rows, parts) grid, each edit from the logits; PENALISED_COPY_FUSED, the copy and the
    edits by one launch (``penalised_rows``)."""
    if batch.penalised is None or batch.penalties is None:
        return None
    rows = batch.penalised.rows
    if kernels and PENALISED_COPY_BY_KERNEL:
        from fnvllm.executor.history import SlotPenalties
        from fnvllm.kernels.penalties import float_rows, penalised_rows, penalize_from_

        pen = batch.penalties
        if PENALISED_COPY_FUSED and isinstance(pen, SlotPenalties) and pen.counts is not None:
            return penalised_rows(logits, rows, pen.tokens, pen.meta, pen.factors)
        slot = isinstance(pen, SlotPenalties) and pen.counts is not None
        if slot and (PENALTIES_FROM_SOURCE or (REPETITION_FROM_SOURCE and not pen.counted)):
            work = float_rows(logits, rows)
            return penalize_from_(work, logits, rows, pen.tokens, pen.meta, pen.factors, pen.counts, None, pen.counted)
        return pen.apply_(float_rows(logits, rows))
    work = logits.to(torch.float32, copy=True) if rows is None else logits.index_select(0, rows).float()
    return batch.penalties.apply_(work)


# The penalised rows' float32 copy by one Triton launch (True) or by torch (False: ``.float()`` of the rows ran at
# ~2 TB/s on the H200, 110 us for 256 x 151,936 bf16). Measured on the H200 (bench_sampling.py --topk, 2026-12-02),
# preset + repetition_penalty 1.05 at 256 rows, us per sampling call: 764 -> 586 (flat logits), 586 -> 552 (std 3).
PENALISED_COPY_BY_KERNEL = True
# With the copy kernel and penalties from the slot buffer: each edit reads its value from the logits, not from the
# copy, so a row whose only penalty is repetition needs no count pass and no owner election (a (rows, 4) grid of
# ``penalize_from_``; the penalty kernel took 61 us at 256 rows of ~1,100 tokens on the H200, one program per row).
# Same copy, bit for bit. Off: measured on the H200 (bench_sampling.py --topk --quick, 2026-12-02 09:35) 442.8 us per
# sampling call at 256 flat rows of the preset + repetition_penalty 1.05 against 433.3 without it.
PENALTIES_FROM_SOURCE = False
# PENALTIES_FROM_SOURCE's route for a batch whose penalised rows have a repetition penalty alone (``SlotPenalties.
# counted`` False: known on the host from the params), without its second launch (the count kernel, which had
# nothing to count there): float_rows + one (rows, REPETITION_PARTS) launch, as many launches as the old route.
# Measured on the H200 (bench_penalties.py, mid call 2026-12-02 14:10, CUDA graphs, device us per call, rows of
# ~1,100 tokens): float_rows + penalize_ 131.2 at 256 rows, 43.4 at 64; float_rows + penalize_from_ (with the
# count launch) 92.2 and 24.0; float_rows alone 63.1 and 16.5. Same rows bit for bit there. Rows with a frequency
# or presence penalty keep the old route (from the source they took 143.7 against 131.3).
REPETITION_FROM_SOURCE = True
# The copy and the edits in one launch of ``fnvllm.kernels.penalties.penalised_rows`` (a (rows, vocabulary blocks)
# grid; each block walks its row's history for the tokens in it), in place of float_rows + the penalty kernel.
# Same rows bit for bit. Off: measured on the H200 (bench_penalties.py, mid call 2026-12-02 14:10, device us per
# call, ~1,100-token rows): repetition alone 126.5 at 256 rows (tile 4096 / 1024 / 4 warps; the best tile, 16384 /
# 2048 / 16, 86.8) and 34.4 at 64, against 92.2 and 24.0 by float_rows + penalize_from_; with presence and
# frequency 231.3 (best tile 171.8) against 131.3 by float_rows + penalize_: every block of a row walks the row's
# whole history, and a counted block makes a round trip through its int32 scratch.
PENALISED_COPY_FUSED = False


# Top-k rows by the filter kernel (True) or by torch.topk candidates and ``candidates_pick`` (False). Measured on
# the H200 at 256 rows x 151,936 bf16, top_p 0.95 / top_k 20 (bench_sampling.py, call of 2026-12-01 20:41): 0.49 ms
# per sampling call by the kernel, 0.62 by the candidates (torch.topk alone: 0.44 ms); with logits of a random-weight
# checkpoint's spread (std 0.64): 0.52 and 0.65.
TOP_K_BY_FILTER_KERNEL = True
# Chunk of the maxima the filter kernel skips by, when every filtered row has a top-k and they are sampled from the
# logits as they are (None: ``sample_rows``' own, CHUNK 4096, 38 chunks a row). A top-k row compacts every chunk
# whose maximum reaches its k-th largest chunk maximum: with 38 chunks and top_k 20, about half the row; with
# chunks of 1024, 20 of 149. Finer maxima cost one more read of those rows (``chunk_summaries``).
FILTER_CHUNK: int | None = None
# Top-k rows on that route by ``segmented_pick`` (``fnvllm.kernels.sampling_segments``: their candidates found by a
# (rows, chunks) grid, then one short program per row) instead of ``filtered_pick``'s one program per row, which
# streams every chunk that reaches the row's floor (290 us per call at 256 flat rows x 151,936 on the H200,
# torch.profiler 2026-12-02: latency-bound). Same draws for the same uniforms (bench_sampling.py --topk: the tokens
# of 3 seeded steps of 256 rows equal, flat and std-3 logits, with and without repetition penalties). Measured there
# with each (row, chunk) program finding its row's floor itself (since computed once per row): us per sampling call
# at 256 rows, preset 410 -> 379 (flat) and 394 -> 371 (std 3), + repetition_penalty 764 -> 469 with the copy kernel.
TOP_K_BY_SEGMENTS = True
# With TOP_K_BY_SEGMENTS, the chunk of the finer maxima taken when a top-k exceeds the 4096-token chunks (HF's
# default top_k 50 against 38 chunks: 149 chunks of 1024), and the candidate slots per chunk there (149 x 8 in one
# 2048-slot vector per row; with 4, 4 of 256 flat rows overflowed and took the per-row path, ~150 us on the H200).
SEGMENTS_FINE_CHUNK = 1024
SEGMENTS_FINE_SEGMENT = 8
# Min-p-only batches (``SamplingBatch.min_p_only``: no filtered row has a top-k or a top-p) by ``minp_pick``
# (``fnvllm.kernels.sampling_minp``: each chunk's kept mass on a (rows, chunks) grid, then one short draw per row)
# instead of ``filtered_pick``'s one program per row streaming the row twice (306.9 us per call at 256 flat rows x
# 151,936 bf16 on the H200, torch.profiler 2026-12-02: latency-bound). Same draws for the same uniforms up to float32
# rounding of the kept mass. Measured on the H200 (benchmarks/bench_sampling_minp.py, 2026-12-02 14:10): device us
# per sampling call (host launch time hidden), min_p 0.05 at T 0.6, 256 rows: 362.7 -> 90.1 flat, 182.0 -> 73.5 std 3
# (temperature only: 56); 64 rows: 155.7 -> 31.0 flat, 90.4 -> 28.2 std 3 (temperature only: 18); seeded tokens equal.
MIN_P_BY_CHUNKS = True


def graph_top_k_limit(vocab_size: int) -> int:
    """The largest top-k the decode CUDA graphs redraw (``KernelGraphSampler.filter``) as ``sample_with_kernels``
    would: the chunks of ``sample_rows`` (past it the eager path takes finer chunk summaries), or 0 when a module
    knob sends top-k rows down another route (TOP_K_BY_FILTER_KERNEL, TOP_K_BY_SEGMENTS off, FILTER_CHUNK set)."""
    from fnvllm.kernels.sampling import CHUNK

    if not (TOP_K_BY_FILTER_KERNEL and TOP_K_BY_SEGMENTS) or FILTER_CHUNK is not None:
        return 0
    return -(-vocab_size // CHUNK)


class KernelGraphSampler:
    """The sampler's Triton kernels as the decode CUDA graphs capture them (``fnvllm.executor.cuda_graphs.
    GraphSampler``): ``sample`` is ``sample_with_kernels``' ``sample_rows`` and ``filter`` its top-k redraw
    (``segmented_pick``), over a bucket's every row, reading what changes per step from device memory. Its scratch
    is its own and sized for ``max_rows`` at once: a capture keeps the addresses it saw, so the scratch must never
    move (the eager sampler's grows on demand)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        from fnvllm.kernels.sampling import CHUNK, SamplingScratch

        self.scratch = SamplingScratch()
        self.num_chunks = -(-vocab_size // CHUNK)
        self.scratch.chunk_stats(max_rows, self.num_chunks, device)  # the largest views first: no later growth
        self.scratch.drawn(max_rows, device)
        self.rows = torch.arange(max_rows, dtype=torch.int32, device=device)

    def sample(
        self, logits: torch.Tensor, scale: torch.Tensor, fixed: torch.Tensor, uniforms: torch.Tensor,
        live: torch.Tensor, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """``fnvllm.kernels.sampling.sample_rows_graphed`` with this sampler's scratch."""
        from fnvllm.kernels.sampling import sample_rows_graphed

        sample_rows_graphed(logits, scale, fixed, uniforms, live, out, self.scratch)

    def filter(
        self, logits: torch.Tensor, filters: tuple[torch.Tensor, ...], live: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``fnvllm.kernels.sampling_segments.segmented_pick_graphed`` over ``sample``'s summaries and draws."""
        from fnvllm.kernels.sampling_segments import segmented_pick_graphed

        n = logits.shape[0]
        stats, _ = self.scratch.chunk_stats(n, self.num_chunks, logits.device)
        drawn = self.scratch.drawn(n, logits.device)
        scale, top_k, top_p, min_p = filters
        segmented_pick_graphed(logits, self.rows[:n], stats, scale, top_k, top_p, min_p, drawn, out, live)


def sample_with_kernels(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seed: int,
    filter_kernel: bool = False,
    scratch: SamplingScratch | None = None,
) -> torch.Tensor:
    """(2, B) int64 tokens and non-finite flags by the Triton kernels; ``seed`` keys unseeded rows' Philox.

    Filtered rows (top-k / top-p / min-p) are drawn by ``filtered_pick`` (one program per row that reads only the
    chunks that can reach its threshold) when ``filter_kernel``, or when every one has a top-k (its tokens at or
    above the k-th largest chunk maximum are compacted and sorted in registers; TOP_K_BY_FILTER_KERNEL) or only a
    min-p; otherwise (a row with a top-p and no top-k) by sorting whole rows on the device
    (``filtered_sample_sorted``). Why: the kernel's
    top-p search reads a row many times where logits are nearly flat (the bench's random-weight checkpoint: top_p
    0.95 / top_k 20 fell from 22.6k to 11.6k output tok/s end to end before top-k rows compacted their
    candidates). Measured on the H200 at 256 rows x 151,936 (bench_sampling.py): top_p 0.95 / top_k 20 by the
    kernel 0.49 ms per call, by torch.topk candidates 0.62 ms (torch.topk alone 0.44 ms); min-p alone runs at full
    speed with the kernel and slowly with a full sort. scratch: the kernels' device scratch kept between calls
    (``fnvllm.kernels.sampling.SamplingScratch``; None: fresh tensors)."""
    from fnvllm.kernels.sampling import RowSampling, sample_rows

    device = logits.device
    state = RowSampling(
        scale=batch.scale,
        fixed=batch.fixed,
        uniforms=batch.uniforms,
        drawn=(  # uniforms, maxima, sums
            torch.empty((3, batch.num_rows), dtype=torch.float32, device=device)
            if scratch is None
            else scratch.drawn(batch.num_rows, device)
        ),
        out=torch.empty((2, batch.num_rows), dtype=torch.int64, device=device),
    )
    for group, penalised in ((batch.plain, False), (batch.penalised, True)):
        source = penalised_copy(logits, batch, kernels=True) if penalised else logits
        if group is None or source is None:
            continue
        dense = penalised and group.rows is not None
        stats = sample_rows(source, state, seed, rows=group.rows, dense=dense, scratch=scratch)
        if not group.filtered.shape[0]:
            continue
        if filter_kernel or batch.min_p_only or (batch.candidates is not None and TOP_K_BY_FILTER_KERNEL):
            whole = source is logits or group.rows is None  # every batch row at its own index
            _pick_filtered(source, group, batch, stats, state, whole)
        else:
            _filtered_by_sorting(source, group, batch, state.drawn, state.out)
    return state.out


def _pick_filtered(
    source: torch.Tensor, group: RowGroup, batch: SamplingBatch, stats: torch.Tensor, state: RowSampling, whole: bool
) -> None:
    """Redraw the group's filtered rows by ``filtered_pick`` or (TOP_K_BY_SEGMENTS, every row with a top-k)
    ``segmented_pick``, from ``stats`` (``sample_rows``' summaries of the group) or, when ``whole`` (source holds
    every batch row at its own index), from finer chunk summaries: FILTER_CHUNK's, or SEGMENTS_FINE_CHUNK's when
    the largest top-k exceeds the chunks (the segments' floor is the k-th largest chunk maximum: at top_k 50 and 38
    chunks there is none, and those rows would take the per-row path)."""
    from fnvllm.executor.sampler import TIE_MARGIN
    from fnvllm.kernels.sampling import chunk_summaries
    from fnvllm.kernels.sampling_filters import filtered_pick
    from fnvllm.kernels.sampling_segments import segmented_pick

    if MIN_P_BY_CHUNKS and batch.min_p_only:  # no row with a top-k or a top-p: ``minp_pick``'s (rows, chunks) grid
        from fnvllm.kernels import sampling_minp

        sources, programs = group.filtered_sources, group.filtered_programs
        args = (batch.scale, batch.min_p, state.drawn, state.out)
        sampling_minp.minp_pick(source, group.filtered, sources, programs, stats, *args)
        return
    settings = (batch.scale, batch.top_k, batch.top_p, batch.min_p, state.drawn, state.out)
    segments = TOP_K_BY_SEGMENTS and batch.candidates is not None
    pick = segmented_pick if segments else filtered_pick
    chunk, extra = (FILTER_CHUNK if batch.candidates is not None else None), {}
    num_chunks = stats.shape[2]
    largest_k = (batch.candidates or 0) - TIE_MARGIN  # at most the batch's largest top-k
    finer = -(-source.shape[1] // SEGMENTS_FINE_CHUNK) > num_chunks
    if segments and chunk is None and largest_k > num_chunks and finer:
        chunk, extra = SEGMENTS_FINE_CHUNK, {"segment": SEGMENTS_FINE_SEGMENT}
    if chunk is not None and whole:
        fine = chunk_summaries(source, batch.scale, group.filtered, chunk)  # (3, F, C')
        programs = torch.arange(group.filtered.shape[0], dtype=torch.int32, device=source.device)
        pick(source, group.filtered, group.filtered, programs, fine, *settings, chunk=chunk, **extra)
        return
    pick(source, group.filtered, group.filtered_sources, group.filtered_programs, stats, *settings)


def _filtered_by_sorting(
    source: torch.Tensor, group: RowGroup, batch: SamplingBatch, drawn: torch.Tensor, out: torch.Tensor
) -> None:
    """Overwrite out[0] at the group's filtered rows with their filtered draws, at the uniforms ``sample_rows``
    recorded in drawn[0] (so a seeded row draws what the kernel path would draw). When every filtered row has a
    top-k, only each row's ``batch.candidates`` best tokens are looked at (``torch.topk``; its kept set lies among
    them: top-p and min-p only cut further, ties at the k-th logit included up to the margin), and one
    ``candidates_pick`` launch thresholds and draws every row in registers; otherwise rows are sorted whole."""
    from fnvllm.kernels.sampling_filters import candidates_pick

    every = group.filtered.shape[0] == source.shape[0]  # then the sources are 0..F-1, ascending: no copy
    values = source if every else source.index_select(0, group.filtered_sources.long())  # (F, V)
    if batch.candidates is None:
        rows = group.filtered.long()  # (F,) batch rows
        settings = [t.index_select(0, rows) for t in (batch.scale, batch.top_k, batch.top_p, batch.min_p, drawn[0])]
        out[0].index_copy_(0, rows, filtered_sample_sorted(values, *settings))
        return
    ids = values.topk(batch.candidates, dim=-1).indices.sort(dim=-1).values  # (F, C) token ids, ascending
    settings = (batch.scale, batch.top_k, batch.top_p, batch.min_p, drawn)
    candidates_pick(values.gather(1, ids).float(), ids, group.filtered, *settings, out)  # one variant: float32


def _group_rows(group: RowGroup, num_rows: int, device: torch.device) -> torch.Tensor:
    """The group's batch rows as a tensor (all rows when it has no list)."""
    return group.rows.long() if group.rows is not None else torch.arange(num_rows, device=device)


def sample_with_references(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """(2, B) int64 tokens and non-finite flags by the torch references (unseeded uniforms from ``generator``)."""
    device = logits.device
    drawn = torch.rand(batch.num_rows, generator=generator, device=device)
    uniforms = torch.where(batch.fixed.bool(), batch.uniforms, drawn)
    values = logits.float()
    work = penalised_copy(logits, batch)
    if work is not None and batch.penalised is not None:
        values = values.index_copy(0, _group_rows(batch.penalised, batch.num_rows, device), work)
    tokens, non_finite = sample_rows_ref(values, batch.scale, batch.top_k, batch.top_p, batch.min_p, uniforms)
    return torch.stack([tokens, non_finite.long()])


def check_finite(flags: Sequence[int], seq_ids: Sequence[str]) -> None:
    """Raise NonFiniteLogitsError naming the rows whose flag is set (flags and seq_ids in sampled-row order)."""
    bad = [rid for rid, flag in zip(seq_ids, flags, strict=True) if flag]
    if bad:
        raise NonFiniteLogitsError(
            f"the model produced NaN or infinite logits for {len(bad)} sampled sequence(s), e.g. {bad[:4]}; "
            "check the checkpoint's weights and dtype"
        )

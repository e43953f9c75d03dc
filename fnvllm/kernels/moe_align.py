"""Token alignment for the fused-MoE kernels: a step's assignments sorted by expert, padded to whole blocks.

The T*K assignments of a step (flat index a = t*K + k) are sorted by expert (stable: token order inside a
group), each expert's group padded to a multiple of BLOCK_M, so that every block of BLOCK_M sorted slots belongs
to one expert. Worked example, K=1, BLOCK_M=4, topk_ids = [2, 0, 2, 2, 2] (T=5, E=3):

    counts [1, 0, 4] -> padded [4, 0, 4] -> sorted slots [1 P P P | 0 2 3 4]   (P = padding, stored as T*K)
    block_experts [0, 2, 3, 3]  (blocks past the last used one name expert E and exit at once)

The kernel path, two launches (three with many chunks, below). The assignments are cut into at most
``programs`` chunks (default ``ALIGN_PROGRAMS``), each a whole number of TILE-row one-hot tiles:

1. ``_count_kernel``, one program per chunk: the chunk's count per expert (one-hot sums, tile by tile, in
   registers: no atomics), and its share of the slots filled with the padding value;
2. ``_place_kernel``, one program per chunk: every chunk's counts summed (the totals) and those of the earlier
   chunks (this chunk's start inside each expert's group), the padded group starts as an exclusive scan over the
   experts, then tile by tile each assignment's slot = its expert's start + the expert's count in earlier chunks
   and tiles + its rank in this tile (an exclusive cumsum of the one-hot); and the chunk's share of the block
   experts (a searchsorted of each block's first slot in the group ends); program 0 stores the slot count.

With many chunks (more than SCAN_ABOVE, or when asked), a third launch between the two, one program per expert,
turns the chunks' counts into exclusive prefix sums over the chunks (a Triton scan), which the place programs
read instead of summing every row themselves. A decode step (256 tokens, top-8: 2,048 assignments) is 32 chunks
of one tile; an 8,192-token prefill (65,536) 1,024 chunks of one tile and the scan launch: 24.7 us on an H200
(before: the same chunks with a torch cumsum between the launches, 205 us; 128 chunks of 8 tiles, 83.6 us;
``programs`` picks the trade-off, swept by bench_moe.py).
No atomics, so it is deterministic, stable, and equals the torch path bit for bit. The number of slots is bounded
without looking at the data: each expert that got c > 0 assignments uses at most c + BLOCK_M - 1 slots, and at
most min(T*K, E) experts got any, so the grid is fixed for a given T (CUDA-graph safe: no host sync).

``align_by_expert`` is the kernel path; ``align_by_expert_ref`` the same in ~20 torch ops around a stable sort
(the reference). Both give identical tensors.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from fnvllm.kernels.fused_ops import pdl_launch, use_pdl, wait_for_previous_kernel

__all__ = [
    "ALIGN_PROGRAMS",
    "SCAN_ABOVE",
    "AlignPlan",
    "ExpertAlignment",
    "align_by_expert",
    "align_by_expert_ref",
    "align_plan",
    "max_slots",
]

# Chunks (programs of each launch) at most. On the H200 at 8,192 tokens (65,536 assignments, 1,024 tiles), 1,024
# one-tile chunks and the scan launch took 24.7 us, 128 chunks of 8 tiles 83.6 us: a tile's pass is latency-bound,
# so more programs with fewer tiles each win. A 256-token decode step (32 tiles) is 32 chunks either way.
ALIGN_PROGRAMS = 1024
SCAN_ABOVE = 128  # chunks above which a scan launch sums the chunks' counts (else the place kernel does)
_FILL = 256  # padding slots one store of the count kernel writes


@attrs.frozen(eq=False)
class ExpertAlignment:
    """Assignments sorted by expert, each expert's group padded to whole blocks (see the module docstring).

    sorted_ids: (max_slots,) int32 flat assignment index (t*K + k) per slot; padding slots hold T*K.
    block_experts: (max_slots / block_m,) int32 expert of each block of slots; num_experts past the used ones.
    num_slots: (1,) int32 slots in use (a multiple of block_m), on the device.
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    num_slots: torch.Tensor
    block_m: int


@attrs.frozen
class AlignPlan:
    """How ``align_by_expert`` cuts ``n`` assignments: ``chunks`` programs of ``tiles`` one-hot tiles of ``tile``
    assignments each (the last chunk may be short)."""

    tile: int
    tiles: int
    chunks: int


def max_slots(num_assignments: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded slots of any routing of ``num_assignments`` (a multiple of block_m)."""
    bound = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_plan(num_assignments: int, num_experts: int, programs: int = ALIGN_PROGRAMS) -> AlignPlan:
    """The chunking of ``num_assignments``: one-hot tiles of 16-128 rows (8,192 elements with the experts padded
    to a power of two), as few tiles per chunk as keep the chunks at most ``programs``."""
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    tile = max(16, min(128, 8192 // triton.next_power_of_2(num_experts)))
    total_tiles = max(1, triton.cdiv(num_assignments, tile))
    tiles = triton.cdiv(total_tiles, programs)
    return AlignPlan(tile=tile, tiles=tiles, chunks=triton.cdiv(total_tiles, tiles))


def align_by_expert(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    programs: int = ALIGN_PROGRAMS,
    scan: bool | None = None,
) -> ExpertAlignment:
    """Sort the assignments of ``topk_ids`` (T, K) by expert and pad each expert's group to block_m slots (stable:
    token order inside a group). Two Triton launches of at most ``programs`` programs each, and with ``scan``
    (None: when there are more than SCAN_ABOVE chunks) a third between them, one program per expert, that turns
    the chunks' counts into exclusive prefix sums (else each place program sums the rows it needs); no host sync,
    so it can be captured in a CUDA graph."""
    flat = topk_ids.reshape(-1)  # (T*K,)
    n, e_pow2 = flat.numel(), triton.next_power_of_2(num_experts)
    plan = align_plan(n, num_experts, programs)
    slots = max_slots(n, num_experts, block_m)
    num_blocks = slots // block_m
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    num_slots = torch.empty(1, dtype=torch.int32, device=flat.device)
    chunk_counts = torch.empty(plan.chunks, e_pow2, dtype=torch.int32, device=flat.device)
    fill = triton.cdiv(slots, plan.chunks)
    pdl = {"USE_PDL": use_pdl(flat.device), **pdl_launch(flat.device)}
    _count_kernel[(plan.chunks,)](
        flat, chunk_counts, sorted_ids, n, plan.tiles, slots, fill, TILE=plan.tile, E_POW2=e_pow2, FILL=_FILL, **pdl
    )
    scanned = plan.chunks > SCAN_ABOVE if scan is None else scan
    totals = chunk_counts  # unused unless scanned
    if scanned:  # chunk_counts becomes the counts of the earlier chunks, totals the sums
        totals = torch.empty(e_pow2, dtype=torch.int32, device=flat.device)
        _scan_kernel[(e_pow2,)](
            chunk_counts, totals, plan.chunks, E_POW2=e_pow2, CHUNKS_POW2=triton.next_power_of_2(plan.chunks), **pdl
        )
    rows = max(1, min(triton.next_power_of_2(plan.chunks), 4096 // e_pow2))
    _place_kernel[(plan.chunks,)](
        flat, chunk_counts, totals, sorted_ids, block_experts, num_slots, n, plan.chunks, plan.tiles, num_blocks,
        triton.cdiv(num_blocks, plan.chunks), num_experts, BLOCK_M=block_m, TILE=plan.tile, E_POW2=e_pow2, ROWS=rows,
        SCANNED=scanned, **pdl,
    )  # fmt: skip
    return ExpertAlignment(sorted_ids, block_experts, num_slots, block_m)


@triton.jit
def _count_kernel(
    ids_ptr,
    chunk_counts_ptr,
    sorted_ids_ptr,
    n,
    tiles,
    slots,
    fill,
    TILE: tl.constexpr,
    E_POW2: tl.constexpr,
    FILL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Chunk program_id(0) (``tiles`` tiles of TILE assignments): how many went to each expert; and this
    program's share of the slots filled with the padding value n (the place kernel, launched after, overwrites
    the used ones)."""
    wait_for_previous_kernel(USE_PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for i in range(tiles):
        offs = (c * tiles + i) * TILE + tl.arange(0, TILE)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_POW2)  # E_POW2 matches no expert
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # one-hot (TILE, E_POW2)
    tl.store(chunk_counts_ptr + c * E_POW2 + experts, counts)
    end = tl.minimum((c + 1) * fill, slots)
    for start in range(c * fill, end, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + offs, tl.zeros((FILL,), dtype=tl.int32) + n, mask=offs < end)


@triton.jit
def _scan_kernel(chunk_counts_ptr, totals_ptr, num_chunks, E_POW2: tl.constexpr, CHUNKS_POW2: tl.constexpr,
                 USE_PDL: tl.constexpr):  # fmt: skip
    """Expert program_id(0)'s column of the chunks' counts, in place, to exclusive prefix sums over the chunks
    (each chunk's count of that expert in earlier chunks), and its total."""
    wait_for_previous_kernel(USE_PDL)
    e = tl.program_id(0)
    rows = tl.arange(0, CHUNKS_POW2)
    ptrs = chunk_counts_ptr + rows * E_POW2 + e
    counts = tl.load(ptrs, mask=rows < num_chunks, other=0)
    tl.store(ptrs, tl.cumsum(counts, axis=0) - counts, mask=rows < num_chunks)
    tl.store(totals_ptr + e, tl.sum(counts, axis=0))


@triton.jit
def _place_kernel(
    ids_ptr,
    chunk_counts_ptr,
    totals_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_slots_ptr,
    n,
    num_chunks,
    tiles,
    num_blocks,
    blocks_per_chunk,
    num_experts,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    E_POW2: tl.constexpr,
    ROWS: tl.constexpr,
    SCANNED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Slot of each assignment of chunk c = its expert's padded start + the expert's assignments in earlier
    chunks (SCANNED: row c of the scanned counts; else summed here, ROWS chunks' counts at a time) and earlier
    tiles of this chunk + those earlier in its tile; then this chunk's share of the block experts (program 0 also
    stores the slot count)."""
    wait_for_previous_kernel(USE_PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    if SCANNED:
        before = tl.load(chunk_counts_ptr + c * E_POW2 + experts)
        total = tl.load(totals_ptr + experts)
    else:
        total = tl.zeros((E_POW2,), dtype=tl.int32)
        before = tl.zeros((E_POW2,), dtype=tl.int32)
        for r0 in range(0, num_chunks, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            counts = tl.load(
                chunk_counts_ptr + rows[:, None] * E_POW2 + experts[None, :], mask=rows[:, None] < num_chunks, other=0
            )  # (ROWS, E_POW2)
            total += tl.sum(counts, axis=0)
            before += tl.sum(tl.where(rows[:, None] < c, counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    running = ends - padded + before  # next free slot of each expert for this chunk
    for i in range(tiles):
        offs = (c * tiles + i) * TILE + tl.arange(0, TILE)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_POW2)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # (TILE, E_POW2)
        earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert assignments earlier in this tile
        dest = tl.sum(onehot * (running[None, :] + earlier), axis=1)
        tl.store(sorted_ids_ptr + dest, offs.to(tl.int32), mask=offs < n)
        running += tl.sum(onehot, axis=0)
    if c == 0:
        tl.store(num_slots_ptr, tl.sum(padded, axis=0))
    first_block = c * blocks_per_chunk
    end_block = tl.minimum(first_block + blocks_per_chunk, num_blocks)
    for b0 in range(first_block, end_block, TILE):
        blocks = b0 + tl.arange(0, TILE)
        first_slot = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_slot[:, None]).to(tl.int32), axis=1)  # searchsorted, right
        tl.store(block_experts_ptr + blocks, tl.minimum(expert, num_experts), mask=blocks < end_block)


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """``align_by_expert`` in torch ops (the reference)."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # (T*K,)
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    ends = padded.cumsum(0)  # (E,) end slot of each expert's group
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, in token order inside a group
    grouped = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[grouped]  # position inside its group
    slots = max_slots(n, num_experts, block_m)
    sorted_ids = torch.full((slots,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (ends - padded)[grouped] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, slots, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return ExpertAlignment(sorted_ids, block_experts, ends[-1:].to(torch.int32), block_m)

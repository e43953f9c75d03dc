"""Token alignment for the fused-MoE kernels: a step's assignments sorted by expert, padded to whole blocks.

The T*K assignments of a step (flat index a = t*K + k) are sorted by expert (stable: token order inside a
group), each expert's group padded to a multiple of BLOCK_M, so that every block of BLOCK_M sorted slots belongs
to one expert. Worked example, K=1, BLOCK_M=4, topk_ids = [2, 0, 2, 2, 2] (T=5, E=3):

    counts [1, 0, 4] -> padded [4, 0, 4] -> sorted slots [1 P P P | 0 2 3 4]   (P = padding, stored as T*K)
    block_experts [0, 2, 3, 3]  (blocks past the last used one name expert E and exit at once)

The kernel path: per chunk of assignments, a count per expert (one-hot sums); then per chunk, each assignment's
slot = its expert's padded start + the expert's count in earlier chunks + its rank in this chunk (an exclusive
cumsum of the one-hot). The counts of earlier chunks are summed inside the place kernel up to PREFIX_IN_KERNEL
chunks (decode sizes: two launches); above, that would be O(chunks^2) (1024 chunks at an 8192-token prefill),
so one torch cumsum over the chunks runs between the two launches and each chunk reads its row. No atomics, so it
is deterministic and equals the torch path. The number of slots is bounded without looking at the data: each
expert that got c > 0 assignments uses at most c + BLOCK_M - 1 slots, and at most min(T*K, E) experts got any, so
the grid is fixed for a given T.

``align_by_expert`` is the kernel path; ``align_by_expert_ref`` the same in ~20 torch ops around a stable sort
(the reference). Both give identical tensors.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

__all__ = ["PREFIX_IN_KERNEL", "ExpertAlignment", "align_by_expert", "align_by_expert_ref", "max_slots"]


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


def max_slots(num_assignments: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded slots of any routing of ``num_assignments`` (a multiple of block_m)."""
    bound = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


PREFIX_IN_KERNEL = 32  # chunks up to which the place kernel sums the earlier chunks' counts itself


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort the assignments of ``topk_ids`` (T, K) by expert and pad each expert's group to block_m slots (stable:
    token order inside a group). Two Triton launches (and a torch cumsum between them above PREFIX_IN_KERNEL
    chunks); no host sync, so it can be captured in a CUDA graph."""
    flat = topk_ids.reshape(-1)  # (T*K,)
    n, e_pow2 = flat.numel(), triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 8192 // e_pow2))
    num_chunks, slots = max(1, triton.cdiv(n, chunk)), max_slots(n, num_experts, block_m)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(slots // block_m, dtype=torch.int32, device=flat.device)
    num_slots = torch.empty(1, dtype=torch.int32, device=flat.device)
    chunk_counts = torch.empty(num_chunks, e_pow2, dtype=torch.int32, device=flat.device)
    fill = triton.cdiv(slots, num_chunks)
    _count_kernel[(num_chunks,)](flat, chunk_counts, sorted_ids, n, slots, fill, CHUNK=chunk, E_POW2=e_pow2)
    in_kernel = num_chunks <= PREFIX_IN_KERNEL
    through = chunk_counts if in_kernel else chunk_counts.cumsum(0, dtype=torch.int32)  # counts of chunks 0..c
    _place_kernel[(num_chunks,)](
        flat, chunk_counts, through, sorted_ids, block_experts, num_slots, n, num_chunks, slots // block_m,
        num_experts, BLOCK_M=block_m, CHUNK=chunk, E_POW2=e_pow2, SUM_IN_KERNEL=in_kernel,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks) if in_kernel else 1,
    )  # fmt: skip
    return ExpertAlignment(sorted_ids, block_experts, num_slots, block_m)


@triton.jit
def _count_kernel(ids_ptr, chunk_counts_ptr, sorted_ids_ptr, n, slots, fill, CHUNK: tl.constexpr, E_POW2: tl.constexpr):
    """Per chunk of CHUNK assignments: how many went to each expert; and fill this program's share of the
    slots with the padding value n (the place kernel, launched after, overwrites the used ones)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_POW2)  # E_POW2 matches no expert
    experts = tl.arange(0, E_POW2)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # (CHUNK, E_POW2)
    tl.store(chunk_counts_ptr + c * E_POW2 + experts, tl.sum(onehot, axis=0))
    end = tl.minimum((c + 1) * fill, slots)
    for start in range(c * fill, end, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=offs < end)


@triton.jit
def _place_kernel(
    ids_ptr,
    chunk_counts_ptr,
    through_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_slots_ptr,
    n,
    num_chunks,
    num_blocks,
    num_experts,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_POW2: tl.constexpr,
    SUM_IN_KERNEL: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
):
    """Slot of each assignment of chunk c = its expert's padded start + the expert's assignments in earlier
    chunks (SUM_IN_KERNEL: summed here, all rows loaded at once; else ``through`` row c - chunk c's counts) +
    those earlier in this chunk; program 0 also writes the block experts and the slot count."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    if SUM_IN_KERNEL:  # every chunk's counts in one (CHUNKS_POW2, E_POW2) load, summed in registers
        rows = tl.arange(0, CHUNKS_POW2)
        counts = tl.load(chunk_counts_ptr + rows[:, None] * E_POW2 + experts[None, :], mask=rows[:, None] < num_chunks)
        total = tl.sum(counts, axis=0)
        before = tl.sum(tl.where(rows[:, None] < c, counts, 0), axis=0)
    else:
        before = tl.load(through_ptr + c * E_POW2 + experts) - tl.load(chunk_counts_ptr + c * E_POW2 + experts)
        total = tl.load(through_ptr + (num_chunks - 1) * E_POW2 + experts)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=E_POW2)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # (CHUNK, E_POW2)
    earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert assignments earlier in this chunk
    dest = tl.sum(onehot * (ends - padded + before)[None, :] + earlier * onehot, axis=1)
    tl.store(sorted_ids_ptr + dest, offs.to(tl.int32), mask=offs < n)
    if c == 0:
        tl.store(num_slots_ptr, tl.sum(padded, axis=0))
        for b0 in range(0, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            first_slot = blocks * BLOCK_M
            expert = tl.sum((ends[None, :] <= first_slot[:, None]).to(tl.int32), axis=1)  # searchsorted, right
            tl.store(block_experts_ptr + blocks, tl.minimum(expert, num_experts), mask=blocks < num_blocks)


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """``align_by_expert`` in torch ops (the reference, and the path for large steps)."""
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

"""Host-to-device inputs of a step: the attention metadata built from the plan's rows, and ``upload``.

The metadata contract itself (``AttentionMetadata``, the KV layout, a worked example) is in
``fnvllm.kernels.attention``; this module is the executor's side of it, the host arrays and their copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fnvllm.kernels.attention import AttentionMetadata

# numpy dtype (``dtype.str``) -> torch dtype, for the dtypes the executor uploads.
_TORCH_DTYPES = {
    np.dtype(t).str: torch.from_numpy(np.zeros(1, dtype=t)).dtype
    for t in (np.int64, np.int32, np.float32, np.float64, np.bool_, np.uint8, np.int8, np.int16, np.uint16)
}


def upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device``. To a GPU the copy goes through pinned host memory and does not wait:
    a copy from pageable memory may block the host until the device has finished the work queued before it,
    which would serialise a step's launch behind the previous step. The staging tensor comes from torch's caching
    pinned allocator (``torch.empty(pin_memory=True)``), which keeps it alive until the copy has run; filling it
    from numpy skips ``Tensor.pin_memory()``'s first step, asking the driver whether the pageable source is
    already pinned, which dominated an upload's host time in the H200 profile."""
    if torch.device(device).type != "cuda":
        return torch.from_numpy(array).to(device)
    dtype = _TORCH_DTYPES.get(array.dtype.str)
    if dtype is None:  # a dtype the table does not know: the slower, general path
        return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)
    staging = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    staging.numpy()[...] = array
    return staging.to(device, non_blocking=True)


def build_attention_metadata(
    start_positions: Sequence[int],
    q_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata for sequences feeding q_lens[i] tokens from start_positions[i], KV in block_tables[i]."""
    _validate_batch(start_positions, q_lens, block_tables, block_size)
    starts = np.asarray(start_positions, dtype=np.int64)  # (B,)
    lens = np.asarray(q_lens, dtype=np.int64)  # (B,)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)  # (B+1,)
    np.cumsum(lens, out=cu[1:])
    table = _pad_block_tables(block_tables)  # (B, max_blocks)
    positions, slots = token_positions_and_slots(starts, lens, table, block_size)
    seq_lens = starts + lens
    return AttentionMetadata(
        positions=upload(positions, device),
        slot_mapping=upload(slots, device),
        cu_seqlens_q=upload(cu.astype(np.int32), device),
        seq_lens=upload(seq_lens.astype(np.int32), device),
        block_tables=upload(table.astype(np.int32), device),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(seq_lens.max()),
        block_size=block_size,
    )


def token_positions_and_slots(
    starts: np.ndarray, q_lens: np.ndarray, tables: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(T,) int64 positions and KV slots of the flat token batch: sequence b feeds q_lens[b] tokens from
    starts[b] (both (B,) int64), its blocks in row b of ``tables`` (B, w)."""
    offsets = np.cumsum(q_lens) - q_lens  # (B,) where each sequence's tokens start in the flat batch
    positions = np.arange(int(q_lens.sum())) + np.repeat(starts - offsets, q_lens)  # (T,)
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)  # (T,)
    blocks = tables[seq_of_token, positions // block_size].astype(np.int64)  # (T,)
    return positions, blocks * block_size + positions % block_size


def _validate_batch(
    start_positions: Sequence[int],
    q_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> None:
    """Raise ValueError naming the field when the batch description is inconsistent."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not q_lens:
        raise ValueError("q_lens is empty: a step needs at least one sequence")
    if not len(start_positions) == len(q_lens) == len(block_tables):
        raise ValueError(
            f"start_positions, q_lens and block_tables must have one entry per sequence, got lengths "
            f"{len(start_positions)}, {len(q_lens)}, {len(block_tables)}"
        )
    for i, (start, q_len, table) in enumerate(zip(start_positions, q_lens, block_tables, strict=True)):
        if start < 0 or q_len < 1:
            raise ValueError(f"sequence {i}: need start_positions >= 0 and q_lens >= 1, got {start}, {q_len}")
        if len(table) * block_size < start + q_len:
            raise ValueError(
                f"block_tables[{i}] has {len(table)} blocks ({len(table) * block_size} slots) but "
                f"sequence {i} needs {start + q_len} slots"
            )
        if table and min(table) < 0:
            raise ValueError(f"block_tables[{i}] holds a negative block id: {tuple(table)}")


def _pad_block_tables(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, max_blocks) int64 array of the tables, right-padded with 0."""
    width = max(1, max(len(t) for t in block_tables))
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = t
    return table

"""``prepare_inputs``: a StepPlan flattened into the host arrays and device tensors of one step.

Worked example (block_size 4): rows "b" (decode of token 77 at position 9, blocks (3, 8, 6)) and "a" (prompt
chunk 11..14 from position 0, blocks (5,)):

    input_ids    = [77, 11, 12, 13, 14]
    positions    = [9, 0, 1, 2, 3]
    slot_mapping = [25, 20, 21, 22, 23]        # 6*4+1, then 5*4+0 .. 5*4+3
    sample_index = [0, 4]                      # last fed row of each sampling sequence
"""

from __future__ import annotations

import itertools
from operator import itemgetter

import attrs
import numpy as np
import torch

from fnvllm.executor.device_inputs import build_attention_metadata, upload
from fnvllm.kernels.attention import AttentionMetadata
from fnvllm.state import StepPlan


@attrs.frozen(eq=False)
class PreparedInputs:
    """Device arrays of one step. input_ids (T,) int64; sample_index (S,) int64 rows of the sampled positions."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor


@attrs.frozen(eq=False)
class DecodeArrays:
    """Host arrays of an all-decode step (B rows, one token each), ready for a CUDA-graph replay.

    input_ids (B,) int64; positions (B,) int64; slots (B,) int64; seq_lens (B,) int32; block_tables (B, w) int32.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray


def is_decode_only(plan: StepPlan) -> bool:
    """True when every row feeds exactly one token and samples it (a graph-able decode step). C-level passes
    only (this runs every step): B rows that each feed at least one token, B tokens in all, feed one each."""
    if plan.num_samples != plan.num_seqs or sum(map(len, plan.input_tokens)) != plan.num_seqs:
        return False
    return min(map(len, plan.input_tokens), default=1) >= 1


def pad_tables(tables: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """(B, w) int32 array of block tables right-padded with 0 (w = longest table, at least 1).

    One flat copy and one masked scatter (row-major, so the flat order is the tables' order) instead of a
    per-row slice assignment: this runs on the host every decode step for every sequence.
    """
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))  # (B,)
    width = max(1, int(lens.max(initial=0)))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lens[:, None]] = flat
    return out


def prepare_decode(plan: StepPlan) -> DecodeArrays:
    """Host arrays for an all-decode plan (see ``is_decode_only``)."""
    bs = plan.block_size
    tables = pad_tables(plan.block_tables)  # (B, w)
    positions = np.fromiter(plan.start_positions, dtype=np.int64, count=plan.num_seqs)  # (B,)
    rows = np.arange(plan.num_seqs)
    slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs  # (B,)
    ids = np.fromiter((t[0] for t in plan.input_tokens), dtype=np.int64, count=plan.num_seqs)
    return DecodeArrays(ids, positions, slots, (positions + 1).astype(np.int32), tables)


def stage_decode(
    plan: StepPlan,
    arrays: tuple[np.ndarray, ...],
    fill_ids: bool = True,
    staged: list[tuple[int, ...] | None] | None = None,
) -> None:
    """Write an all-decode plan's rows straight into a CUDA graph's staged host arrays (``prepare_decode``'s
    values without its intermediate arrays: this runs every decode step). ``arrays``: (input_ids, positions,
    slots, seq_lens, block_tables) views of at least B rows, the tables at least as wide as the widest table.
    Table columns past a row's blocks keep whatever they held (the kernel stops at seq_lens). ``fill_ids``:
    False when the device feeds every row's token (the host's ids would be overwritten).

    ``staged``: the table object last written to each row of these arrays (None: unknown), updated here. The pure
    core hands a row the same tuple until that row gains a block, so a table that ``is`` the staged one is already
    in place and only the rows that grew or changed hands are written: at 256 rows of ~40 blocks that is ~16 rows
    per step instead of ~10,000 entries.
    """
    ids, pos, slots, lens, tables = arrays
    b, bs = plan.num_seqs, plan.block_size
    positions = pos[:b]
    positions[:] = plan.start_positions
    if fill_ids:
        ids[:b] = np.fromiter(map(itemgetter(0), plan.input_tokens), dtype=np.int64, count=b)
    if staged is not None:
        _stage_changed_tables(plan.block_tables, tables, staged)
    elif b == 1:
        table = plan.block_tables[0]
        tables[0, : len(table)] = table
    else:
        lens_ = np.fromiter(map(len, plan.block_tables), dtype=np.int64, count=b)  # (B,)
        width = max(1, int(lens_.max()))
        flat = np.fromiter(itertools.chain.from_iterable(plan.block_tables), dtype=np.int32, count=int(lens_.sum()))
        tables[:b, :width][np.arange(width) < lens_[:, None]] = flat  # row-major: the tables' order
    blocks = tables[np.arange(b), positions // bs].astype(np.int64)  # (B,) the block of each row's token
    np.add(blocks * bs, positions % bs, out=slots[:b])
    np.add(positions, 1, out=lens[:b], casting="same_kind")


def _stage_changed_tables(
    block_tables: tuple[tuple[int, ...], ...], tables: np.ndarray, staged: list[tuple[int, ...] | None]
) -> None:
    """Write the rows of ``block_tables`` that are not (by identity) the ones ``staged`` says each row holds."""
    for row, table in enumerate(block_tables):
        if table is not staged[row]:
            tables[row, : len(table)] = table
            staged[row] = table


def prepare_inputs(plan: StepPlan, device: torch.device) -> PreparedInputs:
    """Flatten ``plan`` into device arrays: token ids, attention metadata and the sampled rows."""
    q_lens = [len(t) for t in plan.input_tokens]
    flat = [token for tokens in plan.input_tokens for token in tokens]
    meta = build_attention_metadata(plan.start_positions, q_lens, plan.block_tables, plan.block_size, device)
    ends = np.cumsum(q_lens) - 1  # (B,) last fed row of each sequence
    sample_index = ends[np.asarray(plan.sample, dtype=bool)]
    return PreparedInputs(
        input_ids=upload(np.asarray(flat, dtype=np.int64), device),
        meta=meta,
        sample_index=upload(sample_index.astype(np.int64), device),
    )


@attrs.frozen(eq=False)
class Feed:
    """Input ids on the device for the rows an overlapped step feeds from the previous step's samples.

    ids: (F,) int64. rows: (F,) which batch rows they are, token_rows: (F,) where those rows' tokens sit in the
    flat token batch; both None when every row is fed, in order (ids is then the whole (B,) input).
    """

    ids: torch.Tensor
    rows: torch.Tensor | None
    token_rows: torch.Tensor | None

    def apply(self, input_ids: torch.Tensor, token_rows: bool) -> torch.Tensor:
        """``input_ids`` ((B,) one per row, or the flat (T,) batch with ``token_rows``) with the fed ids in place."""
        if self.rows is None:
            return self.ids
        index = self.token_rows if token_rows else self.rows
        assert index is not None
        return input_ids.index_copy_(0, index, self.ids)

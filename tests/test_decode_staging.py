"""``stage_decode`` writes a decode step's rows straight into the CUDA graph's staged host arrays: the same ids,
positions, slots, lengths and table rows as ``prepare_decode`` (the arrays ``DecodeGraphs.run`` used to copy)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from fnvllm.executor.cuda_graphs import StagedLayout
from fnvllm.executor.inputs import prepare_decode, stage_decode
from fnvllm.state import StepPlan


@st.composite
def decode_plans(draw: st.DrawFn) -> StepPlan:
    """All-decode plans: 1-6 rows, blocks of 1-8 tokens, each row's token in its table's last block."""
    block_size = draw(st.integers(1, 8))
    rows = draw(st.integers(1, 6))
    tables, positions = [], []
    for _ in range(rows):
        table = tuple(draw(st.lists(st.integers(0, 50), min_size=1, max_size=6)))
        tables.append(table)
        positions.append(draw(st.integers((len(table) - 1) * block_size, len(table) * block_size - 1)))
    tokens = tuple((draw(st.integers(0, 99)),) for _ in range(rows))
    ids = tuple(f"r{i}" for i in range(rows))
    return StepPlan(0, block_size, ids, tokens, tuple(positions), tuple(tables), (True,) * rows)


@given(plan=decode_plans(), fill_ids=st.booleans())
def test_staged_rows_equal_prepare_decode(plan: StepPlan, fill_ids: bool) -> None:
    """Staged over stale contents, every row's id (when filled), position, slot, length and table entries are
    prepare_decode's; ids are left alone when the device feeds them."""
    layout = StagedLayout(8, 6)
    buffer = np.full(layout.num_bytes, 0x7F, dtype=np.uint8)  # stale bytes everywhere
    arrays = tuple(t.numpy() for t in layout.views(torch.from_numpy(buffer)))
    stale_ids = arrays[0].copy()
    stage_decode(plan, arrays, fill_ids)
    expected = prepare_decode(plan)
    b = plan.num_seqs
    ids, pos, slots, lens, tables = arrays
    assert np.array_equal(ids[:b], expected.input_ids if fill_ids else stale_ids[:b])
    assert np.array_equal(pos[:b], expected.positions)
    assert np.array_equal(slots[:b], expected.slots)
    assert np.array_equal(lens[:b], expected.seq_lens)
    for row, table in enumerate(plan.block_tables):
        assert tuple(tables[row, : len(table)]) == table


@given(data=st.data(), steps=st.integers(2, 5))
def test_incremental_staging_equals_prepare_decode(data: st.DataObject, steps: int) -> None:
    """Staged step after step with the tracked table objects, rows that keep their table object (in the same row
    or moved to another) are skipped and every other row is rewritten: each step's arrays are prepare_decode's."""
    layout = StagedLayout(8, 6)
    buffer = np.full(layout.num_bytes, 0x7F, dtype=np.uint8)
    arrays = tuple(t.numpy() for t in layout.views(torch.from_numpy(buffer)))
    staged: list[tuple[int, ...] | None] = [None] * 8
    previous: tuple[tuple[int, ...], ...] = ()
    for _ in range(steps):
        plan = data.draw(decode_plans())
        if previous:  # reuse earlier table objects where they fit, in any row (a row that moved or stayed)
            tables = list(plan.block_tables)
            for row in range(len(tables)):
                if data.draw(st.booleans()):
                    tables[row] = data.draw(st.sampled_from(previous))
            plan = _with_tables(plan, tuple(tables))
        stage_decode(plan, arrays, True, staged)
        expected = prepare_decode(plan)
        b = plan.num_seqs
        assert np.array_equal(arrays[2][:b], expected.slots)
        for row, table in enumerate(plan.block_tables):
            assert tuple(arrays[4][row, : len(table)]) == table
        previous = plan.block_tables


def _with_tables(plan: StepPlan, tables: tuple[tuple[int, ...], ...]) -> StepPlan:
    """``plan`` with these block tables, each row's position moved into its table's last block."""
    bs = plan.block_size
    positions = tuple((len(t) - 1) * bs + p % bs for t, p in zip(tables, plan.start_positions, strict=True))
    return StepPlan(0, bs, plan.seq_ids, plan.input_tokens, positions, tables, plan.sample)


def test_staged_views_tile_the_buffer_without_overlap() -> None:
    """Every staged array (ids, positions, slots, lengths, order, the sampling arrays, live, tables) has its own
    bytes, aligned for its dtype, and the tables come last (a prefix of the buffer covers table rows :B)."""
    layout = StagedLayout(8, 6)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    ids, pos, slots, lens, tables = layout.views(buffer)
    views = [ids, pos, slots, lens, layout.order(buffer), *layout.sampling(buffer), tables]
    spans = sorted((v.data_ptr() - buffer.data_ptr(), v.numel() * v.element_size(), v.element_size()) for v in views)
    for (start, size, _), (next_start, _, _) in pairwise(spans):
        assert start + size <= next_start
    assert all(start % align == 0 for start, _, align in spans)
    assert spans[-1] == (layout.tables_offset, 4 * 8 * 6, 4) and layout.tables_offset + 4 * 8 * 6 == layout.num_bytes
    scale, fixed, uniforms, top_k, top_p, min_p, live = layout.sampling(buffer)
    dtypes = [t.dtype for t in (scale, fixed, uniforms, top_k, top_p, min_p, live)]
    assert dtypes == [torch.float32, torch.int32, torch.float32, torch.int32, torch.float32, torch.float32, torch.int32]
    assert all(t.numel() == 8 for t in (scale, fixed, uniforms, top_k, top_p, min_p)) and live.numel() == 2

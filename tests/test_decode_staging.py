"""``stage_decode`` writes a decode step's rows straight into the CUDA graph's staged host arrays: the same ids,
positions, slots, lengths and table rows as ``prepare_decode`` (the arrays ``DecodeGraphs.run`` used to copy)."""

from __future__ import annotations

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

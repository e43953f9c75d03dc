"""``stage_mixed`` writes a mixed step (prompt chunks beside decode rows) into the mixed CUDA graphs' staged host
arrays: the same ids, positions, slots, query offsets, lengths and sampled rows as the eager path's
``prepare_inputs``, plus the bucket's padding (tokens in the scratch block, sequences without tokens) and the
prefill kernel's work list. The graphs themselves need a GPU (tests/test_llm_equality.py runs them there)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fnvllm.executor.inputs import prepare_inputs
from fnvllm.executor.mixed_graphs import Bucket, MixedLayout, mixed_token_buckets, stage_mixed
from fnvllm.kernels.prefill_work import prefill_work_list
from fnvllm.state import StepPlan

SCRATCH_SLOT, TOKENS_PER_TILE = 999, 4


@st.composite
def mixed_plans(draw: st.DrawFn) -> StepPlan:
    """1-6 rows feeding 1-12 tokens each from a cached prefix, blocks of 1-8 tokens, some rows not sampling."""
    block_size = draw(st.integers(1, 8))
    rows = draw(st.integers(1, 6))
    q_lens = [draw(st.integers(1, 12)) for _ in range(rows)]
    starts = [draw(st.integers(0, 20)) for _ in range(rows)]
    tables = [
        tuple(draw(st.lists(st.integers(0, 90), min_size=n, max_size=n)))
        for n in (math.ceil((s + q) / block_size) for s, q in zip(starts, q_lens, strict=True))
    ]
    tokens = tuple(tuple(draw(st.integers(0, 99)) for _ in range(q)) for q in q_lens)
    sample = tuple(draw(st.booleans()) for _ in range(rows))
    ids = tuple(f"r{i}" for i in range(rows))
    return StepPlan(0, block_size, ids, tokens, tuple(starts), tuple(tables), sample)


def bucket_for(tokens: int, max_seqs: int) -> Bucket:
    """The smallest bucket of ``mixed_token_buckets(96)`` holding ``tokens``, as MixedGraphs sizes it."""
    n = next(b for b in mixed_token_buckets(96) if b >= tokens)
    seqs = min(n, max_seqs)
    return Bucket(n, seqs, n // TOKENS_PER_TILE + seqs)


@given(plan=mixed_plans())
def test_staged_step_equals_prepare_inputs_plus_padding(plan: StepPlan) -> None:
    """Over stale bytes, the real rows equal prepare_inputs' arrays; padding tokens sit in the scratch slot at
    position 0, padding sequences feed nothing, the work list is the kernel's, the sampled rows are the last rows."""
    layout = MixedLayout(96, 8, 96 // TOKENS_PER_TILE + 8, 32)  # 32 blocks: 20 + 12 tokens in blocks of 1
    buffer = np.full(layout.num_bytes, 0x7F, dtype=np.uint8)
    arrays = tuple(t.numpy() for t in layout.views(torch.from_numpy(buffer)))
    total = sum(map(len, plan.input_tokens))
    bucket = bucket_for(total, 8)
    step = stage_mixed(plan, arrays, layout, bucket, SCRATCH_SLOT, TOKENS_PER_TILE)
    expected = prepare_inputs(plan, torch.device("cpu"))
    ids, pos, slots, sample_index, cu, seq_lens, work, tables = arrays
    t, b, n = step.num_tokens, step.num_seqs, bucket.tokens
    assert (t, b, step.num_samples) == (total, plan.num_seqs, sum(plan.sample))
    assert np.array_equal(ids[:t], expected.input_ids.numpy())
    assert np.array_equal(pos[:t], expected.meta.positions.numpy())
    assert np.array_equal(slots[:t], expected.meta.slot_mapping.numpy())
    assert np.array_equal(cu[: b + 1], expected.meta.cu_seqlens_q.numpy())
    assert np.array_equal(seq_lens[:b], expected.meta.seq_lens.numpy())
    assert np.array_equal(sample_index[: step.num_samples], expected.sample_index.numpy())
    for row, table in enumerate(plan.block_tables):
        assert tuple(tables[row, : len(table)]) == table
    assert (ids[t:n] == 0).all() and (pos[t:n] == 0).all() and (slots[t:n] == SCRATCH_SLOT).all()
    assert (cu[b + 1 : bucket.seqs + 1] == t).all() and (seq_lens[b : bucket.seqs] == 0).all()
    q_lens = np.diff(cu[: b + 1].astype(np.int64))
    assert np.array_equal(work[: bucket.work_rows], prefill_work_list(q_lens, TOKENS_PER_TILE, bucket.work_rows))
    assert step.inline_tables and step.end == layout.tables_offset + b * layout.max_blocks * 4


def test_buckets() -> None:
    """Buckets double to 128, then step by 128, and end at the limit; below two tokens there are none."""
    assert mixed_token_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert mixed_token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert mixed_token_buckets(16) == [16]
    assert mixed_token_buckets(1) == []


def test_layout_views_tile_the_buffer() -> None:
    """The eight views cover the buffer end to end without overlap, tables last (rows :B are a prefix)."""
    layout = MixedLayout(64, 8, 24, 5)
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    views = layout.views(buffer)
    spans = sorted((v.data_ptr() - buffer.data_ptr(), v.numel() * v.element_size()) for v in views)
    assert spans[0][0] == 0 and all(a + n == c for (a, n), (c, _) in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] == layout.num_bytes == layout.tables_offset + 8 * 5 * 4
    assert views[7].shape == (8, 5) and views[6].shape == (24, 2)


def test_mixed_graph_tokens_is_checked() -> None:
    """EngineConfig.mixed_graph_tokens outside [0, 4096] is refused, naming the field."""
    from fnvllm.config import EngineConfig
    from fnvllm.state import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="mixed_graph_tokens"):
        EngineConfig(mixed_graph_tokens=5000)
    assert EngineConfig(mixed_graph_tokens=0).mixed_graph_tokens == 0

"""Decode attention's measured small-batch knobs (``SMALL_BATCH_DECODE``): which batches take them, and that the
kernel under them still matches its reference (Triton's interpreter without a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_triton import TOLERANCE, rel_err, run_decode

from fnvllm.kernels import decode_attention
from fnvllm.kernels.decode_attention import DecodeKernelConfig, small_batch_config

ONE_PARTITION = DecodeKernelConfig(partition_size=4096, tile_size=16, num_stages=2, fused_reduce=True)
SPLIT_REDUCE = DecodeKernelConfig(partition_size=32, tile_size=16, num_warps=2, fused_reduce=False)


def test_small_batch_table_serves_its_bucket_and_caps_the_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry serves batches up to its key (the smallest key >= B), with the partition capped at the table's
    width (a power of two, at least a tile); FP8 caches, larger batches and an empty table get None."""
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE", {1: ONE_PARTITION, 16: SPLIT_REDUCE})
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE_SHORT", {})
    assert small_batch_config(1, 300, False) == dataclasses.replace(ONE_PARTITION, partition_size=512)
    assert small_batch_config(2, 4096, False) == SPLIT_REDUCE and small_batch_config(16, 64, False) == SPLIT_REDUCE
    assert small_batch_config(1, 8, False).partition_size == 16  # never below one tile
    assert small_batch_config(17, 4096, False) is None and small_batch_config(1, 4096, True) is None
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE", {1: None, 16: SPLIT_REDUCE})
    assert small_batch_config(1, 4096, False) is None and small_batch_config(2, 4096, False) == SPLIT_REDUCE
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE", {})
    assert small_batch_config(1, 4096, False) is None


def test_short_tables_take_the_short_entry_for_its_batch_range_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables of at most SHORT_CONTEXT tokens take a SMALL_BATCH_DECODE_SHORT entry for batches inside its range
    (16-bit caches only); longer tables, other batch sizes and FP8 caches keep the other tables."""
    short = DecodeKernelConfig(partition_size=512, tile_size=16, num_stages=2, fused_reduce=True, preload_kv=True)
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE", {1: ONE_PARTITION, 16: SPLIT_REDUCE})
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE_SHORT", {(9, 16): short})
    limit = decode_attention.SHORT_CONTEXT
    assert small_batch_config(9, limit, False) == short and small_batch_config(16, 256, False).preload_kv
    assert small_batch_config(16, 256, False).partition_size == 256  # still capped at the table's width
    assert (
        small_batch_config(16, 2 * limit, False) == SPLIT_REDUCE and small_batch_config(8, 256, False) == SPLIT_REDUCE
    )
    fp8_entry = decode_attention.SMALL_BATCH_DECODE_FP8[16]  # FP8: its own table
    assert small_batch_config(12, 256, True) == dataclasses.replace(fp8_entry, partition_size=256)
    assert small_batch_config(17, 256, False) is None


def test_short_graph_widths_name_the_buckets_of_the_short_entries() -> None:
    """Buckets whose rows take a short entry get a short capture SHORT_CONTEXT tokens wide, in whole blocks, when
    the full tables are wider; none for FP8 caches, tables already that short, or blocks that do not divide it."""
    from fnvllm.executor.cuda_graphs import capture_key

    limit = decode_attention.SHORT_CONTEXT
    buckets = [1, 2, 4, 8, 16, 32]
    widths = decode_attention.short_graph_widths(buckets, 256, 40960, False)
    assert widths == {16: limit // 256}
    assert decode_attention.short_graph_widths(buckets, 256, 40960, True) == {}
    assert decode_attention.short_graph_widths(buckets, 256, limit, False) == {}
    assert decode_attention.short_graph_widths(buckets, 3 * limit // 2, 40960, False) == {}
    full = 40960 // 256
    assert capture_key(buckets, widths, full, 256, 12, lambda: limit) == (16, limit // 256)
    assert capture_key(buckets, widths, full, 256, 12, lambda: limit + 1) == (16, full)
    assert capture_key(buckets, widths, full, 256, 20, lambda: 1 / 0) == (32, full)  # not asked: no short capture
    assert capture_key(buckets, {}, full, 256, 1, lambda: 1 / 0) == (1, full)


@pytest.mark.parametrize("num_seqs", [12, 56], ids=["9-16-rows", "49-64-rows"])
def test_decode_under_the_shipped_short_entry_matches_reference(num_seqs: int) -> None:
    """Sequences in tables of SHORT_CONTEXT tokens run the shipped short entry of their batch size (one
    partition, first tile read before the launch wait, merged in-kernel) and match the float32 reference, padding
    rows zero."""
    lengths = ([1, 16, 33, 0, 64, 47, 100, 5, 9, 77, 128, 2] * 5)[:num_seqs]
    width = decode_attention.SHORT_CONTEXT // 64  # blocks of 64 tokens
    short = decode_attention.short_table_config(num_seqs, width * 64, False)
    assert short is not None and short == decode_attention.small_batch_config(num_seqs, width * 64, False)
    out, ref = run_decode(lengths, 4, 2, 64, torch.bfloat16, width=width)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    assert torch.all(out[3] == 0)


def test_shipped_small_batch_table_is_launchable() -> None:
    """Every shipped entry passes the launcher's config checks, merges split partials somehow, and one sequence
    keeps the automatic rules (the measured best there)."""
    assert small_batch_config(1, 4096, False) is None
    for cfg in [*decode_attention.SMALL_BATCH_DECODE.values(), *decode_attention.SMALL_BATCH_DECODE_SHORT.values()]:
        if cfg is not None:
            decode_attention._check_config(cfg)
            assert cfg.fused_reduce is not None


@pytest.mark.parametrize("entry", [ONE_PARTITION, SPLIT_REDUCE], ids=["one-partition", "split-reduce"])
@pytest.mark.parametrize("lengths", [[47], [1, 16, 33, 0, 64, 47]], ids=["one-seq", "six-seqs"])
def test_decode_under_measured_knobs_matches_reference(
    monkeypatch: pytest.MonkeyPatch, entry: DecodeKernelConfig, lengths: list[int]
) -> None:
    """With a measured entry for the batch (one partition per sequence, or 32-token splits merged by the reduce
    kernel), bf16 decode attention matches the float32 reference, padding rows zero."""
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE", {8: entry})
    out, ref = run_decode(lengths, 4, 2, 16, torch.bfloat16, width=5)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    for row, n in enumerate(lengths):
        if n == 0:
            assert torch.all(out[row] == 0)


def test_explicit_knobs_override_the_measured_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's partition size and merge choice win over the table's (float32, exact to rounding)."""
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE", {8: ONE_PARTITION})
    out, ref = run_decode([40, 70], 4, 2, 16, torch.float32, partition_size=32, fused_reduce=False)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_fp8_table_serves_mid_batches_and_leaves_tiny_ones_to_the_rules() -> None:
    """FP8 caches read ``SMALL_BATCH_DECODE_FP8``: up to 4 sequences keep the automatic rules, 5-128 take their
    bucket's measured knobs (the FP8 path kept), larger batches none; the 16-bit table is not consulted."""
    table = decode_attention.SMALL_BATCH_DECODE_FP8
    for b in (1, 4):
        assert small_batch_config(b, 4096, True) is None
    assert small_batch_config(5, 4096, True) == table[16] and small_batch_config(33, 4096, True) == table[64]
    assert small_batch_config(128, 4096, True) == table[128] and small_batch_config(129, 4096, True) is None
    assert small_batch_config(20, 256, True).partition_size == 256  # capped at the table's width
    for cfg in table.values():
        if cfg is not None:
            decode_attention._check_config(cfg)
            assert cfg.fp8_path == decode_attention.FP8_PATH_DEFAULT and cfg.fused_reduce is not None
    assert small_batch_config(64, 4096, False) == decode_attention.SMALL_BATCH_DECODE[64]


def test_fp8_decode_under_a_mid_batch_entry_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six sequences over FP8 caches under a measured FP8 entry (32-token partitions merged in-kernel) match the
    torch FP8 reference."""
    from test_fp8_kv import fp8_caches, random_tables

    from fnvllm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    entry = DecodeKernelConfig(partition_size=32, tile_size=16, num_warps=2, fused_reduce=True)
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE_FP8", {8: entry})
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 16, 33, 0, 64, 47]
    table = random_tables(lengths, 16, gen)
    _, _, k8, v8, k_scale, v_scale = fp8_caches(table, 2, 16, 16, gen)
    device = k8.device
    q = torch.randn(len(lengths), 4, 16, generator=gen).to(torch.bfloat16).to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    args = (q, k8, v8, table.to(device), seq_lens, 0.25)
    out = paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(*args, k_scale, v_scale)
    assert rel_err(out.float(), ref.float()) < TOLERANCE[torch.bfloat16]


ORDER_KNOBS = {
    "merged": {"partition_size": 32, "fused_reduce": True},
    "reduce-kernel": {"partition_size": 32, "fused_reduce": False},
    "one-part": {"partition_size": 128},
}


@pytest.mark.parametrize("knobs", list(ORDER_KNOBS.values()), ids=list(ORDER_KNOBS))
def test_16bit_decode_in_a_given_order_equals_batch_order(monkeypatch: pytest.MonkeyPatch, knobs: dict) -> None:
    """A bf16 cache's decode launch given the step's order (longest first, or any permutation) takes its programs
    in that order, split partitions included, and writes every sequence's row bit-equal to batch order."""
    import numpy as np

    from fnvllm.executor.cuda_graphs import longest_first

    monkeypatch.setattr(decode_attention, "ORDERED_MIN_PROGRAMS_16BIT", 1)  # the tiny batch counts as large
    lengths = [5, 70, 0, 33, 70, 1]
    out, _ = run_decode(lengths, 4, 2, 16, torch.bfloat16, tile_size=16, **knobs)
    order = np.zeros(len(lengths), dtype=np.int32)
    longest_first(np.array(lengths, dtype=np.int32), order)
    for given in (order, np.array([2, 0, 5, 3, 1, 4], dtype=np.int32)):
        seq_order = torch.from_numpy(given).to(out.device)
        got, _ = run_decode(lengths, 4, 2, 16, torch.bfloat16, tile_size=16, seq_order=seq_order, **knobs)
        assert torch.equal(got, out)
    if knobs.get("fused_reduce") is not False:  # (the reduce kernel reads every row's partials in batch order)
        repeated = torch.zeros(len(lengths), dtype=torch.int32, device=out.device)  # serves sequence 0 only
        got, _ = run_decode(lengths, 4, 2, 16, torch.bfloat16, tile_size=16, seq_order=repeated, **knobs)
        assert torch.equal(got[0], out[0]) and bool(got[1].isnan().all())


def test_order_rules_by_cache_dtype() -> None:
    """16-bit caches take the order from ORDERED_MIN_PROGRAMS_16BIT programs whatever the partitions; FP8 caches
    from ORDERED_MIN_PROGRAMS programs with one partition only."""
    from fnvllm.kernels.attention import KVCache

    bf16 = KVCache(torch.empty(0), torch.empty(0), None, None)
    fp8 = KVCache(torch.empty(0), torch.empty(0), torch.ones(1), torch.ones(1))
    small, large = decode_attention.ORDERED_MIN_PROGRAMS_16BIT, decode_attention.ORDERED_MIN_PROGRAMS
    assert decode_attention.orders_longest_first(small // 8, 8, 4, bf16)
    assert not decode_attention.orders_longest_first(small // 8 - 1, 8, 1, bf16)
    assert not decode_attention.orders_longest_first(small // 8, 8, 1, fp8)
    assert decode_attention.orders_longest_first(large // 8, 8, 1, fp8)
    assert not decode_attention.orders_longest_first(large // 8, 8, 2, fp8)


def test_a_gpu_models_own_short_entries_replace_the_shared_ones_for_that_model_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``DEVICE_SHORT_CONFIGS`` gives a GPU model its own entry for a range SMALL_BATCH_DECODE_SHORT has; other
    models, no model (CPU tensors) and ranges the model does not list keep the shared entries."""
    shared = DecodeKernelConfig(partition_size=512, tile_size=16, num_stages=3, fused_reduce=True, preload_kv=True)
    other = DecodeKernelConfig(partition_size=256, tile_size=32, num_stages=2, fused_reduce=True)
    monkeypatch.setattr(decode_attention, "SMALL_BATCH_DECODE_SHORT", {(9, 16): shared, (49, 64): shared})
    monkeypatch.setattr(decode_attention, "DEVICE_SHORT_CONFIGS", {"GPU A": {(9, 16): other}})
    limit = decode_attention.SHORT_CONTEXT
    assert small_batch_config(12, limit, False, "GPU A") == other
    assert small_batch_config(12, 256, False, "GPU A").partition_size == 256  # capped at the table as before
    assert small_batch_config(50, limit, False, "GPU A") == shared  # a range the model does not list
    assert small_batch_config(12, limit, False, "GPU B") == shared and small_batch_config(12, limit, False) == shared
    assert small_batch_config(12, 2 * limit, False, "GPU A") != other  # long tables: the other tables
    assert small_batch_config(12, limit, True, "GPU A") != other  # FP8: its own table


def test_device_short_entries_only_replace_listed_ranges_and_attend_as_the_reference() -> None:
    """Every GPU model's own entries are for ranges the shared table lists (which batch sizes get a short CUDA-graph
    capture is decided without the GPU model), and the kernel under each matches the float32 reference."""
    for model, entries in decode_attention.DEVICE_SHORT_CONFIGS.items():
        assert set(entries) <= set(decode_attention.SMALL_BATCH_DECODE_SHORT), model
        for (lo, hi), cfg in entries.items():
            assert decode_attention.short_table_config(hi, 256, False, model) == cfg
            lengths = ([1, 16, 33, 0, 64, 47, 100, 5, 9, 77, 128, 2] * 6)[:hi]
            out, ref = run_decode(lengths, 4, 2, 64, torch.bfloat16, width=4, **dataclasses.asdict(cfg))
            assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], (model, lo, hi)


@pytest.mark.parametrize(
    ("tile", "head_dim", "expected"),
    [(64, 64, 64), (64, 128, 64), (64, 256, 32), (64, 512, 16), (128, 256, 64), (32, 256, 16), (16, 256, 16)],
)
def test_wider_heads_take_narrower_tiles(tile: int, head_dim: int, expected: int) -> None:
    """A tile tuned at head_dim 128 is halved per doubling of the head past 128 (a stage's K/V bytes, tile x
    head_dim, stay at most the tuned ones), never below 16 tokens; narrower heads keep theirs."""
    assert decode_attention.tile_for_head_dim(tile, head_dim) == expected
    assert expected * head_dim <= tile * 128 or expected == 16


@pytest.mark.parametrize("head_dim", [128, 256])
def test_launch_narrows_the_tile_for_wide_heads_unless_given(monkeypatch: pytest.MonkeyPatch, head_dim: int) -> None:
    """paged_decode_attention launches head_dim 256 with half the knob set's tile (Gemma 3: the default 64-token
    tiles asked an H100 for more shared memory than a block may hold), 128 with the tile as tuned, and an explicit
    tile_size as given; the narrowed launch still matches the reference (interpreted)."""
    launched: list[int] = []
    real = decode_attention._launch_partitions

    def spy(*args: object) -> None:
        launched.append(args[8].tile_size)  # (q, kv, tables, lens, scale, out, workspace, num_parts, cfg, ...)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_attention, "_launch_partitions", spy)
    lengths = [1, 40, 90, 0]
    out, ref = run_decode(lengths, 4, 2, 16, torch.float32, head_dim=head_dim, partition_size=128)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    run_decode(lengths, 4, 2, 16, torch.float32, head_dim=head_dim, partition_size=128, tile_size=64)
    tuned = decode_attention.DEFAULT_DECODE_CONFIG.tile_size
    assert launched == [tuned * 128 // head_dim, 64]

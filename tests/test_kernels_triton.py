"""Our Triton kernels against their torch references: under the interpreter on tiny shapes, on a GPU at real sizes.

Without a CUDA device the module switches Triton's interpreter on (TRITON_INTERPRET=1) before importing triton,
since Triton decides at @triton.jit time whether to interpret (its own library functions included); when
something imported triton earlier without it, the module is skipped with that reason. Tolerances are on
||out - ref|| / ||ref||, with the reference in float32 from the same (rounded) inputs: 1e-5 for float32, 1e-2 for
bfloat16 (the interpreter also rounds bf16 by truncation).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from triton_guard import require_triton

DEVICE = require_triton()

from fnvllm.executor.device_inputs import build_attention_metadata  # noqa: E402
from fnvllm.kernels import decode_attention, fused_ops, prefill_attention, prefill_work, sampling, store_kv  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out (an unwritten element) gives inf."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def random_tables(lengths: list[int], block_size: int, gen: torch.Generator, width: int | None = None) -> torch.Tensor:
    """(B, width) int32 block tables drawn in random order from a shuffled pool; padded with 0."""
    needed = [max(1, math.ceil(n / block_size)) for n in lengths]
    width = width or max(needed)
    perm = torch.randperm(sum(needed) + 2, generator=gen)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[used : used + n]
        used += n
    return table


def random_cache(
    table: torch.Tensor,
    lengths: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache), random in the slots holding the sequences' tokens and NaN everywhere else.

    NaN past each sequence's end, in unused blocks and in the padding block catches any read a kernel should
    not make (a masked-out NaN key would still poison its row through 0 * NaN).
    """
    num_blocks = int(table.max()) + 3
    shape = (num_blocks * block_size, num_kv_heads, head_dim)  # flat slots
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for row, n in zip(table, lengths, strict=True):
        pos = torch.arange(n)
        slots = row[pos // block_size].long() * block_size + pos % block_size
        k_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return k_cache.view(cache_shape).to(dtype).to(DEVICE), v_cache.view(cache_shape).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(block_size: int, dtype: torch.dtype) -> None:
    """store_kv writes strided k/v views of a fused qkv into random slots exactly as the reference does."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 7, 2, 16
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)  # strided (T, Hkv, D)
    v = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    k_cache = torch.zeros(3, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(3 * block_size, generator=gen)[:num_tokens].to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv.store_kv(k, v, k_cache, v_cache, slots)
    store_kv.store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_casts_to_the_cache_dtype() -> None:
    """float32 k/v stored into a bf16 cache land within one bf16 rounding of the reference's cast."""
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(5, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    k_cache = torch.zeros(2, 16, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    v_cache, k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(k_cache), torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 0, 31, 8], device=DEVICE)
    store_kv.store_kv(k, v, k_cache, v_cache, slots)
    store_kv.store_kv_ref(k, v, k_ref, v_ref, slots)
    assert rel_err(k_cache, k_ref) < 1e-2 and rel_err(v_cache, v_ref) < 1e-2


def test_store_kv_rejects_bad_arguments() -> None:
    """Mismatched shapes, a non-contiguous cache and a wrong slot count are ValueErrors naming the argument."""
    k = torch.zeros(4, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="k and v"):
        store_kv.store_kv(k, k[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="heads and dim"):
        store_kv.store_kv(k, k, cache[:, :, :1], cache[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv.store_kv(k, k, cache, cache, slots[:3])
    with pytest.raises(ValueError, match="contiguous"):
        store_kv.store_kv(k, k, cache.transpose(0, 1), cache.transpose(0, 1), slots)


# ---------------------------------------------------------------------------------------------- decode


def run_decode(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    head_dim: int = 16,
    width: int | None = None,
    seed: int = 0,
    **knobs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output poisoned with NaN first, float32 reference) for one decode batch."""
    gen = torch.Generator().manual_seed(seed)
    table = random_tables(lengths, block_size, gen, width)
    k_cache, v_cache = random_cache(table, lengths, num_kv_heads, head_dim, dtype, gen, block_size)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    table, seq_lens = table.to(DEVICE), torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    decode_attention.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, out, **knobs)
    ref = decode_attention.paged_decode_attention_ref(
        q.float(), k_cache.float().nan_to_num(), v_cache.float().nan_to_num(), table, seq_lens, scale
    )
    return out, ref


# Contexts: 1, exact multiples of the block (16), one past it, and a padding row (0).
DECODE_LENGTHS = [1, 16, 33, 0, 64, 47]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("gqa_mode", ["dot", "sum", "kq"])
def test_decode_gqa_ratios_split_k(num_heads: int, num_kv_heads: int, gqa_mode: str) -> None:
    """GQA ratios 1/2/4/8, 32-token partitions over 16-token blocks (partials + reduce), every G variant."""
    out, ref = run_decode(
        DECODE_LENGTHS, num_heads, num_kv_heads, 16, torch.float32, partition_size=32, tile_size=16, gqa_mode=gqa_mode
    )
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    assert torch.all(out[3] == 0)  # the padding row is zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefetch,heads_inner", [(False, True), (True, False)])
def test_decode_tiles_spanning_blocks(dtype: torch.dtype, prefetch: bool, heads_inner: bool) -> None:
    """32-token tiles over 4-token blocks gather one block id per token; fp32/bf16; prefetch and grid order."""
    knobs = {"partition_size": 64, "tile_size": 32, "prefetch": prefetch, "heads_inner": heads_inner}
    out, ref = run_decode([1, 8, 37, 0, 70], 4, 2, 4, dtype, **knobs)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("gqa_mode", ["dot", "sum", "kq"])
def test_decode_block_256_spans_partitions(gqa_mode: str) -> None:
    """A 256-token block split over 16-token partitions (and 16-token tiles) with bf16 inputs."""
    out, ref = run_decode(
        [1, 256, 40, 0], 4, 1, 256, torch.bfloat16, partition_size=16, tile_size=16, gqa_mode=gqa_mode
    )
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2), (8, 1)])
def test_decode_fused_merge_matches_the_reduce_kernel(num_heads: int, num_kv_heads: int) -> None:
    """The in-kernel merge by the last partition (default) equals the separate reduce kernel and the reference,
    for even and odd (3) GQA groups and up to 19 live partitions, and leaves its arrival counters at zero."""
    lengths = [300, 1, 17, 0, 150]
    knobs = {"partition_size": 16, "tile_size": 16}
    fused, ref = run_decode(lengths, num_heads, num_kv_heads, 16, torch.float32, width=20, fused_reduce=True, **knobs)
    separate, _ = run_decode(lengths, num_heads, num_kv_heads, 16, torch.float32, width=20, fused_reduce=False, **knobs)
    assert rel_err(fused, ref) < TOLERANCE[torch.float32]
    torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
    assert int(decode_attention.split_counters(fused.device, 10).abs().sum()) == 0


def test_decode_merges_in_kernel_by_default_only_above_tiny_batches() -> None:
    """The default merge: the reduce kernel up to TINY_BATCH_PAIRS (sequence, KV head) pairs, in-kernel above."""
    tiny = decode_attention.TINY_BATCH_PAIRS
    assert not decode_attention.fuses_reduce(1, 8) and not decode_attention.fuses_reduce(tiny // 8, 8)
    assert decode_attention.fuses_reduce(tiny // 8 + 1, 8) and decode_attention.fuses_reduce(64, 8)


def test_decode_single_partition_skips_the_reduce() -> None:
    """When every table fits one partition the kernel writes the output itself, padding rows as zeros."""
    out, ref = run_decode([5, 0, 32], 4, 2, 16, torch.float32, partition_size=512)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    assert torch.all(out[1] == 0)


def test_decode_auto_partition_is_one_partition_only_for_big_batches() -> None:
    """Big batches (>= 1024 sequence x KV-head programs) get one partition spanning the table; small ones split
    (<= 32 pairs) into one-tile partitions, coarser only when the partials would pass their cap."""
    default = decode_attention.DEFAULT_DECODE_CONFIG.partition_size
    small = decode_attention.SMALL_BATCH_PARTITION
    assert decode_attention.auto_partition_size(256, 8, 4096) == 4096
    assert decode_attention.auto_partition_size(128, 8, 300) == max(default, 512)
    assert decode_attention.auto_partition_size(127, 8, 4096) == default
    assert decode_attention.auto_partition_size(1, 8, 4096) == small
    assert decode_attention.auto_partition_size(4, 8, 4096) == small
    assert decode_attention.auto_partition_size(4, 8, 1 << 20) == 512  # 4 x 8 x 2048 partials = the cap
    for seqs, heads, context in ((1, 8, 4096), (4, 8, 1 << 22), (8, 4, 40960)):
        size = decode_attention.auto_partition_size(seqs, heads, context)
        assert seqs * heads * -(-context // size) <= decode_attention.SMALL_BATCH_MAX_PARTIALS


def test_decode_head_dim_64_wide_table_and_workspace() -> None:
    """head_dim 64, a table wider than any sequence (dead partitions exit), and a caller-owned workspace."""
    gen = torch.Generator().manual_seed(3)
    lengths, block_size = [3, 40, 0], 16
    table = random_tables(lengths, block_size, gen, width=6).to(DEVICE)
    k_cache, v_cache = random_cache(table.cpu(), lengths, 2, 64, torch.float32, gen, block_size)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    workspace = decode_attention.make_decode_workspace(q, table, block_size, partition_size=16)
    assert workspace.partial_out.shape == (3, 4, 6, 64)
    out = decode_attention.paged_decode_attention(
        q, k_cache, v_cache, table, seq_lens, 0.125, partition_size=16, tile_size=16, workspace=workspace
    )
    ref = decode_attention.paged_decode_attention_ref(
        q, k_cache.nan_to_num(), v_cache.nan_to_num(), table, seq_lens, 0.125
    )
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_decode_rejects_bad_arguments() -> None:
    """Wrong index dtypes, a mis-sized workspace and bad knobs are ValueErrors naming the argument."""
    q = torch.zeros(2, 4, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 16, device=DEVICE)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    attend = decode_attention.paged_decode_attention
    with pytest.raises(ValueError, match="block_tables"):
        attend(q, cache, cache, table.long(), lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        attend(q, cache, cache, table, lens.long(), 1.0)
    with pytest.raises(ValueError, match="partition_size"):
        attend(q, cache, cache, table, lens, 1.0, partition_size=48)
    with pytest.raises(ValueError, match="workspace"):
        bad = decode_attention.make_decode_workspace(q, table, 16, partition_size=32)
        attend(q, cache, cache, table, lens, 1.0, partition_size=16, workspace=bad)
    with pytest.raises(ValueError, match="dtype"):
        attend(q.bfloat16(), cache, cache, table, lens, 1.0)
    for scale in (0.0, -0.5, float("nan"), float("inf")):  # the kernel scales row maxima: only > 0 is allowed
        out = torch.full_like(q, 7.0)
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            attend(q, cache, cache, table, lens, scale, out)
        assert bool((out == 7.0).all())  # nothing launched


# ---------------------------------------------------------------------------------------------- prefill


def run_prefill(
    batch: tuple[tuple[int, int], ...],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    head_dim: int = 16,
    seed: int = 0,
    **knobs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output poisoned with NaN first, float32 reference) for (cached prefix, q_len) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [start + q_len for start, q_len in batch]
    table = random_tables(lengths, block_size, gen)
    k_cache, v_cache = random_cache(table, lengths, num_kv_heads, head_dim, dtype, gen, block_size)
    tables = [row[: math.ceil(n / block_size)].tolist() for row, n in zip(table, lengths, strict=True)]
    meta = build_attention_metadata([s for s, _ in batch], [n for _, n in batch], tables, block_size, DEVICE)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    args = (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_seqlen_q, head_dim**-0.5)
    prefill_attention.paged_prefill_attention(q, k_cache, v_cache, *args, out, **knobs)
    ref = prefill_attention.paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), *args)
    return out, ref


# (cached prefix, query length): fresh prefills, chunks over a cached prefix (some block-aligned), decodes.
MIXED_BATCH = ((0, 9), (13, 1), (5, 7), (32, 1), (0, 1), (16, 20), (40, 3))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1)])
def test_prefill_mixed_batch_gqa_ratios(num_heads: int, num_kv_heads: int) -> None:
    """Prefill chunks over cached prefixes plus decode rows in one launch, GQA ratios 1/2/4/8, fp32."""
    out, ref = run_prefill(MIXED_BATCH, num_heads, num_kv_heads, 16, torch.float32, block_m=16, block_n=16)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_prefill_bf16_small_blocks_and_wide_tiles() -> None:
    """bf16, 4-token blocks under 32-token key tiles (one block id per key), several query tiles per chunk."""
    out, ref = run_prefill(((0, 40), (7, 1), (24, 17)), 8, 2, 4, torch.bfloat16, block_m=16, block_n=32)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_prefill_block_256() -> None:
    """A 256-token block holding a long prefix; the key loop runs inside one block (one id per tile)."""
    out, ref = run_prefill(((50, 6), (0, 1), (3, 2)), 4, 2, 256, torch.bfloat16, block_m=32, block_n=16)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_prefill_work_list_padded_batch_matches_reference() -> None:
    """The captured-launch form: a work list sized for a padded bucket (padding tokens and sequences with no
    tokens) gives the reference's output on the real tokens and leaves the padding rows unwritten."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(3)
    lengths = [start + q_len for start, q_len in MIXED_BATCH]
    table = random_tables(lengths, block_size, gen)
    k_cache, v_cache = random_cache(table, lengths, num_kv_heads, head_dim, torch.float32, gen, block_size)
    tables = [row[: math.ceil(n / block_size)].tolist() for row, n in zip(table, lengths, strict=True)]
    starts, q_lens = [s for s, _ in MIXED_BATCH], [n for _, n in MIXED_BATCH]
    meta = build_attention_metadata(starts, q_lens, tables, block_size, DEVICE)
    num_tokens, num_seqs, pad_tokens, pad_seqs = meta.num_tokens, meta.num_seqs, 5, 3
    q = torch.randn(num_tokens + pad_tokens, num_heads, head_dim, generator=gen).to(DEVICE)
    cu = torch.cat([meta.cu_seqlens_q, meta.cu_seqlens_q[-1:].repeat(pad_seqs)])  # padding sequences: no tokens
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32, device=DEVICE)])
    block_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:pad_seqs])])
    tokens = prefill_work.prefill_tokens_per_tile(num_heads, num_kv_heads)
    capacity = (num_tokens + pad_tokens) // tokens + num_seqs + pad_seqs
    work = torch.from_numpy(prefill_work.prefill_work_list(np.array(q_lens), tokens, capacity)).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention.paged_prefill_attention(
        q, k_cache, v_cache, cu, seq_lens, block_tables, 1, head_dim**-0.5, out, work=work
    )
    args = (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.max_seqlen_q, head_dim**-0.5)
    ref = prefill_attention.paged_prefill_attention_ref(q[:num_tokens], k_cache, v_cache, *args)
    assert rel_err(out[:num_tokens], ref) < TOLERANCE[torch.float32]
    assert torch.isnan(out[num_tokens:]).all()


def test_prefill_work_list_order_padding_and_capacity() -> None:
    """Counter 0 of every sequence first, padding rows ask for an unreachable counter, overflow is refused."""
    work = prefill_work.prefill_work_list(np.array([1, 9]), 4, 6)
    assert work.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [0, 6], [0, 6]]
    with pytest.raises(ValueError, match="holds 3 tiles, the step needs 4"):
        prefill_work.prefill_work_list(np.array([1, 9]), 4, 3)


def test_prefill_rejects_bad_arguments() -> None:
    """A cu_seqlens_q of the wrong length and a block_m below the GQA group are ValueErrors."""
    q = torch.zeros(3, 4, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 1, 16, device=DEVICE)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    attend = prefill_attention.paged_prefill_attention
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attend(q, cache, cache, cu[:1], lens, table, 3, 1.0)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        attend(q, cache, cache, cu, lens, table, 0, 1.0)
    with pytest.raises(ValueError, match="block_m"):
        attend(torch.zeros(3, 32, 16, device=DEVICE), cache, cache, cu, lens, table, 3, 1.0, block_m=16)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        attend(q, cache, cache, cu, lens, table, 3, -1.0)


# ---------------------------------------------------------------------------------------------- fused ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_references(dtype: torch.dtype) -> None:
    """rmsnorm, fused add+rmsnorm, silu_and_mul (strided rows) and rotary (a strided q view) match the references."""
    gen = torch.Generator().manual_seed(4)
    tol = TOLERANCE[dtype]
    x, res = (torch.randn(5, 96, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype).to(DEVICE)
    assert rel_err(fused_ops.rmsnorm(x, w, 1e-6), fused_ops.rmsnorm_ref(x, w, 1e-6)) < tol
    for got, want in zip(
        fused_ops.fused_add_rmsnorm(x, res, w, 1e-6), fused_ops.fused_add_rmsnorm_ref(x, res, w, 1e-6), strict=True
    ):
        assert rel_err(got, want) < tol
    gate_up = torch.randn(5, 3 * 40, generator=gen).to(dtype).to(DEVICE)[:, :80]  # rows strided by 120
    assert rel_err(fused_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul_ref(gate_up)) < tol
    qkv = torch.randn(5, 6 * 16, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : 3 * 16].view(5, 3, 16)  # (T, H, D) with token stride 96
    angles = (torch.rand(5, 8, generator=gen) * 6).to(DEVICE)
    assert (
        rel_err(fused_ops.rotary(q, angles.cos(), angles.sin()), fused_ops.rotary_ref(q, angles.cos(), angles.sin()))
        < tol
    )
    k = qkv[:, 3 * 16 : 5 * 16].view(5, 2, 16)  # the k view, also strided
    head_w = (1 + 0.1 * torch.randn(16, generator=gen)).to(dtype).to(DEVICE)
    for view in (q, k):
        got = fused_ops.norm_rotary(view, head_w, 1e-6, angles.cos(), angles.sin())
        assert rel_err(got, fused_ops.norm_rotary_ref(view, head_w, 1e-6, angles.cos(), angles.sin())) < tol
    assert torch.equal(
        fused_ops.norm_rotary(q, None, 1e-6, angles.cos(), angles.sin()),
        fused_ops.rotary(q, angles.cos(), angles.sin()),
    )


# ---------------------------------------------------------------------------------------------- GPU, real sizes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("gqa_mode", ["dot", "sum", "kq"])
def test_gpu_decode_real_sizes(block_size: int, gqa_mode: str) -> None:
    """B 64, Hq 16 / Hkv 8 / D 128, bf16, contexts up to 2048 (and two padding rows), default knobs."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 2049, (64,), generator=gen).tolist()
    lengths[:4] = [1, 2048, 0, block_size]
    lengths[-1] = 0
    tile = {"dot": None, "sum": 16, "kq": None}[gqa_mode]
    out, ref = run_decode(lengths, 16, 8, block_size, torch.bfloat16, head_dim=128, gqa_mode=gqa_mode, tile_size=tile)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    assert torch.all(out[2] == 0) and torch.all(out[-1] == 0)


@gpu
@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay() -> None:
    """The decode launcher captures in a CUDA graph and replays correctly after seq_lens and q change in place."""
    gen = torch.Generator().manual_seed(6)
    block_size, width, num_seqs = 16, 128, 32
    table = random_tables([width * block_size] * num_seqs, block_size, gen, width).cuda()
    k_cache, v_cache = random_cache(
        table.cpu(), [width * block_size] * num_seqs, 8, 128, torch.bfloat16, gen, block_size
    )
    q = torch.randn(num_seqs, 16, 128, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.randint(1, width * block_size, (num_seqs,), device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    workspace = decode_attention.make_decode_workspace(q, table, block_size, partition_size=512)
    attend = functools.partial(decode_attention.paged_decode_attention, partition_size=512, workspace=workspace)
    attend(q, k_cache, v_cache, table, seq_lens, 0.088, out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(q, k_cache, v_cache, table, seq_lens, 0.088, out)
    seq_lens.copy_(torch.randint(0, width * block_size, (num_seqs,), device="cuda", dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref = decode_attention.paged_decode_attention_ref(
        q, k_cache.nan_to_num(), v_cache.nan_to_num(), table, seq_lens, 0.088
    )
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_prefill_real_sizes(block_size: int) -> None:
    """A mixed batch at real sizes: long chunks over cached prefixes and 32 decode rows, Hq 16 / Hkv 8 / D 128."""
    batch = ((0, 1024), (300, 700), (1500, 548), (2000, 17), *((n * 61 % 2000, 1) for n in range(32)))
    out, ref = run_prefill(batch, 16, 8, block_size, torch.bfloat16, head_dim=128)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@gpu
@pytest.mark.gpu
def test_gpu_store_kv_and_fused_ops_real_sizes() -> None:
    """store_kv at 4096 tokens x Hkv 8 x D 128 is exact; the fused ops at hidden 1024 / 16 heads match."""
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(4096, 8, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    k_cache = torch.zeros(300, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache, k_ref, v_ref = (torch.zeros_like(k_cache) for _ in range(3))
    slots = torch.randperm(300 * 16, generator=gen)[:4096].cuda()
    store_kv.store_kv(k, v, k_cache, v_cache, slots)
    store_kv.store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    x, res = (torch.randn(512, 1024, generator=gen).bfloat16().cuda() for _ in range(2))
    w = torch.randn(1024, generator=gen).bfloat16().cuda()
    normed, new_res = fused_ops.fused_add_rmsnorm(x, res, w, 1e-6)
    ref_normed, ref_res = fused_ops.fused_add_rmsnorm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res) and rel_err(normed, ref_normed) < 1e-2
    q = torch.randn(512, 16, 128, generator=gen).bfloat16().cuda()
    angles = torch.rand(512, 64, generator=gen).cuda() * 6
    assert (
        rel_err(fused_ops.rotary(q, angles.cos(), angles.sin()), fused_ops.rotary_ref(q, angles.cos(), angles.sin()))
        < 1e-2
    )


# ---------------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sample_matches_reference_given_the_same_uniforms(dtype: torch.dtype) -> None:
    """Tokens equal the torch reference fed the kernel's own Philox uniforms (several chunks per row, a ragged
    last chunk); greedy rows are the argmax."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 1000, generator=gen) * 3).to(dtype).to(DEVICE)
    temperature = torch.tensor([0.0, 0.3, 1.0, 2.5, 0.0, 0.7], device=DEVICE)
    for seed in (1234, 99, 7):
        out = sampling.fused_sample(logits, temperature, seed=seed, chunk=128)
        ref, non_finite = sampling.sample_ref(logits, temperature, sampling.philox_uniforms(6, seed, DEVICE))
        assert out[0].tolist() == ref.tolist()
        assert out[1].tolist() == non_finite.long().tolist() == [0] * 6
    greedy = logits.float().argmax(dim=-1)
    assert out[0, 0] == greedy[0] and out[0, 4] == greedy[4]


def test_fused_sample_agrees_with_reference_over_many_draws() -> None:
    """64 rows of peaked and flat logits at several temperatures: every draw equals the reference's."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 300, generator=gen) * torch.linspace(0.1, 8, 64)[:, None]
    temperature = torch.tensor([0.0, 0.2, 0.6, 1.0, 1.7, 3.0, 0.05, 0.9] * 8)
    out = sampling.fused_sample(logits.to(DEVICE), temperature.to(DEVICE), seed=2024, chunk=64)
    ref, _ = sampling.sample_ref(logits, temperature, sampling.philox_uniforms(64, 2024, DEVICE).cpu())
    assert out[0].cpu().tolist() == ref.tolist()


def test_sample_ref_draws_softmax_of_scaled_logits() -> None:
    """The reference inverts the CDF correctly: over 100,000 uniforms its token frequencies match
    softmax(logits / T) within 4 standard errors."""
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 2.2, 0.0, 1.5])
    rows, t = 100_000, 0.7
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0))
    tokens, _ = sampling.sample_ref(logits.repeat(rows, 1), torch.full((rows,), t), uniforms)
    freq = torch.bincount(tokens, minlength=7).double() / rows
    expected = (logits.double() / t).softmax(-1)
    assert (freq - expected).abs().max().item() < 4 * math.sqrt(0.25 / rows)


def test_philox_uniforms_look_uniform() -> None:
    """The row uniforms lie in [0, 1) with the mean and deciles of U(0, 1) (within 4 standard errors)."""
    n = 1000
    u = sampling.philox_uniforms(n, 5, DEVICE).cpu().double()
    assert u.min().item() >= 0 and u.max().item() < 1
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    deciles = torch.bincount((u * 10).long(), minlength=10).double() / n
    assert (deciles - 0.1).abs().max().item() < 4 * math.sqrt(0.09 / n)


def test_fused_sample_is_a_function_of_the_seed() -> None:
    """The same seed repeats the draw exactly; another seed draws differently."""
    logits, temperature = torch.zeros(16, 500, device=DEVICE), torch.ones(16, device=DEVICE)
    a, b = (sampling.fused_sample(logits, temperature, seed=7, chunk=256)[0] for _ in range(2))
    c = sampling.fused_sample(logits, temperature, seed=8, chunk=256)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_fused_sample_flags_non_finite_rows_and_rejects_bad_arguments() -> None:
    """A NaN or an infinity anywhere in a row sets that row's flag; bad shapes, seeds and chunks raise."""
    logits = torch.zeros(4, 300, device=DEVICE)
    logits[1, 257] = math.nan
    logits[2, 3] = -math.inf
    out = sampling.fused_sample(logits, torch.ones(4, device=DEVICE), seed=0, chunk=128)
    assert out[1].tolist() == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="temperature"):
        sampling.fused_sample(logits, torch.ones(3, device=DEVICE), seed=0)
    with pytest.raises(ValueError, match="seed"):
        sampling.fused_sample(logits, torch.ones(4, device=DEVICE), seed=-1)
    with pytest.raises(ValueError, match="chunk"):
        sampling.fused_sample(logits, torch.ones(4, device=DEVICE), seed=0, chunk=100)


@gpu
@pytest.mark.gpu
def test_gpu_fused_sample_real_sizes() -> None:
    """B 256 x V 151,936 bf16: the kernel agrees with the float64 reference on the same uniforms (a u within
    float32 rounding of a CDF step may land one token over, so allow one row in a hundred) and greedy rows are
    exactly the argmax."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(256, 151936, generator=gen) * 4).bfloat16().cuda()
    temperature = torch.full((256,), 0.6, device="cuda")
    temperature[::7] = 0.0
    out = sampling.fused_sample(logits, temperature, seed=42)
    ref, _ = sampling.sample_ref(logits, temperature, sampling.philox_uniforms(256, 42, "cuda"))
    assert (out[0] == ref).float().mean().item() >= 0.99
    assert torch.equal(out[0, ::7], logits[::7].float().argmax(dim=-1))

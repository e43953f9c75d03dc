"""The paged attention reference and its metadata, checked against naive dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch

import fnvllm.kernels.attention as attention_module
from fnvllm.executor.device_inputs import build_attention_metadata
from fnvllm.kernels import AttentionMetadata, paged_attention_ref, write_kv
from fnvllm.kernels.attention import attention
from fnvllm.kernels.backends import BackendUnavailableError, backend_names, get_backend, resolve_backend

HEAD_DIM = 8
# (start position, query length) per sequence: fresh prefills, chunks over a cached prefix, decodes.
MIXED_BATCH = ((0, 9), (13, 1), (5, 7), (30, 1), (0, 1), (17, 4))
ALL_DECODE = ((0, 1), (13, 1), (40, 1), (6, 1))


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive float64 attention of q (n, Hq, D) at the last n of L positions over k, v (L, Hkv, D)."""
    num_queries, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # (L, Hq, D)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # (L, Hq, D)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # (Hq, n, L)
    query_pos = torch.arange(seq_len - num_queries, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), v)


def shuffled_tables(lengths: list[int], block_size: int, seed: int) -> tuple[list[tuple[int, ...]], int]:
    """Disjoint block tables drawn from a shuffled pool (non-contiguous, out of order), and the pool size."""
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(tuple(perm[used : used + n]))
        used += n
    return tables, num_blocks


def run_batch(
    batch: tuple[tuple[int, int], ...],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend a batch through the paged cache (prefixes pre-written); returns (paged out, dense out), (T, Hq, D)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [start + q_len for start, q_len in batch]
    tables, num_blocks = shuffled_tables(lengths, block_size, seed)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, HEAD_DIM), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=g).to(dtype) for n in lengths]
    values = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=g).to(dtype) for n in lengths]
    queries = [torch.randn(q_len, num_heads, HEAD_DIM, generator=g).to(dtype) for _, q_len in batch]
    for i, (start, _) in enumerate(batch):
        if start:
            prefix = build_attention_metadata([0], [start], [tables[i]], block_size, "cpu")
            write_kv(keys[i][:start], values[i][:start], k_cache, v_cache, prefix.slot_mapping)
    meta = build_attention_metadata([s for s, _ in batch], [n for _, n in batch], tables, block_size, "cpu")
    scale = HEAD_DIM**-0.5
    new_k = torch.cat([k[start:] for k, (start, _) in zip(keys, batch, strict=True)])
    new_v = torch.cat([v[start:] for v, (start, _) in zip(values, batch, strict=True)])
    out = attention(torch.cat(queries), new_k, new_v, k_cache, v_cache, meta, scale, get_backend("torch"))
    dense = [dense_causal_attention(q, k, v, scale) for q, k, v in zip(queries, keys, values, strict=True)]
    return out, torch.cat(dense)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_dense(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """A batch mixing prefills, chunks over cached prefixes and decodes equals dense causal attention."""
    out, dense = run_batch(MIXED_BATCH, num_heads, num_kv_heads, block_size)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_all_decode_batch_matches_dense(block_size: int) -> None:
    """An all-decode batch (the batched-gather path) equals dense attention, despite NaN in unused slots."""
    out, dense = run_batch(ALL_DECODE, 4, 2, block_size)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)


def test_bfloat16_matches_dense() -> None:
    """bf16 inputs give dense-attention results within bf16 rounding."""
    out, dense = run_batch(MIXED_BATCH, 4, 2, 4, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense, atol=2e-2, rtol=2e-2)


def test_score_chunking_matches_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tiny score budget the reference splits queries and batches into chunks and still agrees."""
    monkeypatch.setattr(attention_module, "_MAX_SCORE_ELEMENTS", 64)
    for batch in (MIXED_BATCH, ALL_DECODE):
        out, dense = run_batch(batch, 4, 2, 4)
        torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)


def test_metadata_worked_example() -> None:
    """build_attention_metadata reproduces the worked example in the module docstring."""
    meta = build_attention_metadata([0, 9], [6, 1], [(5, 2), (3, 8, 6)], 4, "cpu")
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 9]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 25]
    assert meta.cu_seqlens_q.tolist() == [0, 6, 7]
    assert meta.seq_lens.tolist() == [6, 10]
    assert meta.block_tables.tolist() == [[5, 2, 0], [3, 8, 6]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size) == (6, 10, 4)
    assert meta.positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.cu_seqlens_q.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32


def test_metadata_rejects_short_block_table() -> None:
    """A block table too short for its sequence is a ValueError naming that table."""
    with pytest.raises(ValueError, match=r"block_tables\[1\]"):
        build_attention_metadata([0, 8], [4, 1], [(0,), (1, 2)], 4, "cpu")


def test_metadata_rejects_mismatched_lengths() -> None:
    """Per-sequence lists of different lengths are rejected instead of silently truncated."""
    with pytest.raises(ValueError, match="one entry per sequence"):
        build_attention_metadata([0, 0], [1], [(0,), (1,)], 4, "cpu")


def test_write_kv_fills_slots() -> None:
    """write_kv stores token t's key and value at flat slot slot_mapping[t] and nowhere else."""
    k_cache = torch.zeros(3, 2, 1, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(2, 1, HEAD_DIM)
    write_kv(k, -k, k_cache, v_cache, torch.tensor([5, 0]))
    flat_k, flat_v = k_cache.view(-1, 1, HEAD_DIM), v_cache.view(-1, 1, HEAD_DIM)
    torch.testing.assert_close(flat_k[[5, 0]], k)
    torch.testing.assert_close(flat_v[[5, 0]], -k)
    assert flat_k[1:5].abs().sum() == 0


def test_backend_lookup() -> None:
    """The "torch" backend is the reference; an unknown name is a ValueError listing the known ones."""
    assert get_backend("torch").attend is paged_attention_ref
    with pytest.raises(ValueError, match="torch"):
        get_backend("cudnn")


def test_backend_registry_and_auto_on_cpu() -> None:
    """Every backend module is registered by name; on the CPU "auto" resolves to torch and flash is refused."""
    assert {"torch", "triton", "flash"} <= set(backend_names())
    assert resolve_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises((BackendUnavailableError, ValueError), match="flash"):
        resolve_backend("flash", torch.device("cpu"))


def test_shape_mismatch_is_rejected() -> None:
    """q whose heads do not divide into the cache's KV heads is a ValueError."""
    meta: AttentionMetadata = build_attention_metadata([0], [2], [(0,)], 4, "cpu")
    k_cache = torch.zeros(1, 4, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="heads"):
        paged_attention_ref(torch.zeros(2, 3, HEAD_DIM), k_cache, k_cache, meta, 1.0)

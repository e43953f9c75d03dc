"""Paged attention: the metadata contract, the KV-cache layout, and the pure-torch reference backend.

KV cache, per layer: `k_cache`, `v_cache`, each (num_blocks, block_size, num_kv_heads, head_dim) (the
flash-attn-4 paged layout). Token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened (num_blocks * block_size) cache.
Every kernel indexes the caches as that shape, but two memory orders exist (``KV_LAYOUTS``, ``kv_layout``):
"NHD", contiguous, where one token's heads sit side by side (a KV head's row of a token is D elements, Hkv * D
apart from the next token's), and "HND", a permuted view of contiguous (num_blocks, Hkv, block_size, D) memory,
where one head's tokens of a block form one contiguous run (FlashInfer's default). A decode program reads one KV
head, so "HND" hands it block_size * D contiguous elements where "NHD" hands it D-element pieces.

Worked example (block_size 4): "a" feeds 6 prompt tokens from position 0 with blocks (5, 2); "b" decodes one
token at position 9 with blocks (3, 8, 6):

    positions    = [0, 1, 2, 3, 4, 5, 9]
    slot_mapping = [20, 21, 22, 23, 8, 9, 25]     # 5*4+0 .. 5*4+3, 2*4+0, 2*4+1, 6*4+1
    cu_seqlens_q = [0, 6, 7]
    seq_lens     = [6, 10]
    block_tables = [[5, 2, 0], [3, 8, 6]]         # padded with 0; seq_lens says what is valid

Attention is causal with the queries aligned to the end of each sequence: the query at position p attends that
sequence's keys at positions 0..p, read from the cache (prefix from earlier steps plus this step's writes).

Sliding-window attention (Mistral, Qwen2 with use_sliding_window): a layer with a window of w tokens (``window``,
an int >= 1; None = full attention) lets the query at position p see the keys at positions p - w + 1 .. p only,
i.e. key j iff 0 <= p - j < w (transformers' sliding-window causal mask). Worked example (w 3): the query at
position 6 sees keys 4, 5, 6; a chunk feeding positions 5..7 reads keys 3..7 between its rows. The window is a
constant of the layer, so the kernels take it as a compile-time constant (a CUDA graph replays it); every backend
in this package honours it (``AttentionBackend.supports_sliding_window``). The KV blocks that fell out of every
sequence's window stay allocated (and are simply not read): freeing them is a separate memory optimisation, not
done.

An FP8 cache (``kv_cache_dtype="fp8"``, see ``fp8.py``) holds float8_e4m3fn values and comes with a float32
scale per KV head for K and one for V (``KVCache.k_scale`` / ``v_scale``); the reference dequantizes every cache
row it reads (``row * scale``) and computes in float32 as for any other cache.

Backends ("torch" = this file's reference, "triton", "flash") are plug-ins in `fnvllm.kernels.backends`;
`attention()` writes this step's K/V with the backend's `store_kv`, then calls its `attend`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from fnvllm.kernels.fp8 import check_kv_scales, dequantize_fp8, quantize_fp8

if TYPE_CHECKING:
    from fnvllm.kernels.backends import AttentionBackend

# Most float32 score elements the reference materialises at once (bounds its memory on long contexts).
_MAX_SCORE_ELEMENTS = 1 << 26


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Where each fed token goes in the paged KV cache and what it attends to, for one step.

    positions: (T,) int64, position of each fed token in its sequence.
    slot_mapping: (T,) int64, flat KV slot of each fed token (block_id * block_size + position % block_size).
    cu_seqlens_q: (B+1,) int32, cumulative query lengths; sequence i owns tokens cu[i]:cu[i+1].
    seq_lens: (B,) int32, context length of each sequence after this step (start + q_len).
    block_tables: (B, max_blocks) int32, KV block ids per sequence, padded with 0.
    max_seqlen_q: longest query chunk this step (1 means an all-decode batch).
    max_seqlen_k: longest context this step.
    block_size: tokens per KV block.
    prefill_work: a mixed step captured in a CUDA graph: the (W, 2) int32 work list of the Triton prefill kernel
        (``prefill_attention.prefill_work_list``), which sizes its grid instead of max_seqlen_q; None otherwise
        (backends without it never see such a step).
    decode_order: an all-decode step's (B,) int32 sequences longest first, where the executor stages it (the
        Triton decode kernel takes large FP8 batches in that order); None otherwise. Any order gives the same
        output.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    prefill_work: torch.Tensor | None = None
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch (B)."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """Number of fed tokens (T)."""
        return self.positions.shape[0]


class KVCache(NamedTuple):
    """One layer's paged KV cache: k and v (num_blocks, block_size, Hkv, D), and for an FP8 cache the float32
    dequantization scales k_scale and v_scale, (Hkv,) each (None for a cache in the model's dtype)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


# The caches' memory orders (see the module docstring). A tensor's strides tell which one it has (``kv_layout``).
KV_LAYOUTS = ("NHD", "HND")


def kv_layout(cache: torch.Tensor) -> str:
    """The memory order of a (num_blocks, block_size, Hkv, D) cache: "NHD" when contiguous, "HND" when it is the
    (0, 2, 1, 3) permutation of contiguous (num_blocks, Hkv, block_size, D) memory; ValueError otherwise."""
    if cache.dim() != 4:
        raise ValueError(f"a KV cache is (num_blocks, block_size, Hkv, D), got shape {tuple(cache.shape)}")
    if cache.is_contiguous():
        return "NHD"
    _, block_size, num_kv_heads, head_dim = cache.shape
    if cache.stride() == (num_kv_heads * block_size * head_dim, head_dim, block_size * head_dim, 1):
        return "HND"  # read from the strides: no permuted view built on every launch
    raise ValueError(
        f"a KV cache must be contiguous (NHD) or a (0, 2, 1, 3) view of contiguous (num_blocks, Hkv, block_size, D) "
        f"memory (HND); got shape {tuple(cache.shape)}, strides {cache.stride()}"
    )


def check_same_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """The caches' shared layout (``kv_layout``); ValueError when they differ in shape, strides or layout."""
    layout = kv_layout(k_cache)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have one shape and one layout, got {tuple(k_cache.shape)} "
            f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}"
        )
    return layout


def zeros_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    layout: str = "NHD",
) -> torch.Tensor:  # fmt: skip
    """A zeroed (num_blocks, block_size, Hkv, D) cache in ``layout`` memory order; float8 ones are zeroed as bytes
    (0x00 is +0.0) and viewed as float8 (torch.zeros has no float8 kernel everywhere)."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "HND":
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if dtype.itemsize == 1:
        cache = torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return cache.permute(0, 2, 1, 3) if layout == "HND" else cache


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store this step's keys/values (T, Hkv, D) into their slots of the paged caches, in place; an FP8 cache
    stores them quantized by its scales (``fp8.quantize_fp8``)."""
    check_kv_scales(k_cache, k_scale, v_scale)
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # (T,) each: either memory order
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if s is None:
            cache[blocks, offsets] = x.to(cache.dtype)
        else:  # float8 index_put_ is not on every device: write the bytes
            cache.view(torch.uint8)[blocks, offsets] = quantize_fp8(x, s).view(torch.uint8)


def check_window(window: int | None) -> None:
    """Raise ValueError unless ``window`` (a sliding window in tokens) is None (full attention) or an int >= 1."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None (full attention) or an int >= 1 (tokens), got {window!r}")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q (T, Hq, D) over the paged caches; float32 softmax; returns (T, Hq, D).

    FP8 caches need their scales k_scale, v_scale (Hkv,) and are dequantized row by row as they are read.
    window: each query sees only the last ``window`` positions up to its own (None: all of them).
    Decoding sequences (q_len 1) are batched through one gather; the others loop one sequence at a time.
    """
    _check_shapes(q, k_cache, v_cache, meta)
    check_kv_scales(k_cache, k_scale, v_scale)
    check_window(window)
    kv = KVCache(k_cache, v_cache, k_scale, v_scale)
    if meta.max_seqlen_q == 1:  # all-decode batch: no host sync
        return _decode_attention(q, kv, meta.block_tables, meta.seq_lens, meta.max_seqlen_k, scale, window)
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q.tolist()
    seq_lens = meta.seq_lens.tolist()
    decodes = [i for i in range(meta.num_seqs) if cu[i + 1] - cu[i] == 1]
    if decodes:
        tokens = torch.tensor([cu[i] for i in decodes], device=q.device)
        seqs = torch.tensor(decodes, device=q.device)
        max_len = max(seq_lens[i] for i in decodes)
        tables, lens = meta.block_tables[seqs], meta.seq_lens[seqs]
        out[tokens] = _decode_attention(q[tokens], kv, tables, lens, max_len, scale, window)
    for i in range(meta.num_seqs):
        if cu[i + 1] - cu[i] > 1:
            out[cu[i] : cu[i + 1]] = _prefill_attention(
                q[cu[i] : cu[i + 1]], kv, meta.block_tables[i], seq_lens[i], scale, window
            )
    return out


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Raise ValueError when q and the caches do not fit the documented layout."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q (T, Hq, D) and caches (num_blocks, block_size, Hkv, D), got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not fit cache heads/dim {tuple(k_cache.shape[2:])}")
    if k_cache.shape[1] != meta.block_size or q.shape[0] != meta.num_tokens:
        raise ValueError(
            f"cache block_size {k_cache.shape[1]} / q tokens {q.shape[0]} do not match metadata "
            f"block_size {meta.block_size} / num_tokens {meta.num_tokens}"
        )


def read_rows(cache: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache[index] in float32 (index selects blocks), dequantized by ``scale`` (Hkv,), given for FP8 caches."""
    if scale is None:
        return cache[index].float()
    rows = cache.view(torch.uint8)[index].view(cache.dtype)  # gather the bytes: float8 indexing is not everywhere
    return dequantize_fp8(rows, scale)


def _decode_attention(
    q: torch.Tensor,
    kv: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query per sequence, q (B, Hq, D): gather each sequence's blocks at once; returns (B, Hq, D). With a
    ``window``, keys more than window - 1 positions before the query (at seq_len - 1) are hidden too."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv.k.shape[1], kv.k.shape[2]
    table = block_tables[:, : math.ceil(max_seq_len / block_size)]  # (B, nb)
    span = table.shape[1] * block_size
    per_seq = span * num_heads
    step = max(1, _MAX_SCORE_ELEMENTS // max(per_seq, span * num_kv_heads * head_dim))
    out = torch.empty_like(q)
    for lo in range(0, num_seqs, step):
        hi = min(num_seqs, lo + step)
        # Slots past a sequence's end (tail of its last block, padding blocks) hold garbage, maybe NaN: zero
        # their values as well as masking their scores, since 0 * NaN is NaN.
        key_pos = torch.arange(span, device=q.device)[None, :]  # (1, L)
        hidden = key_pos >= seq_lens[lo:hi, None]  # (b, L)
        if window is not None:  # key j is seen from the query at seq_len - 1 iff seq_len - 1 - j < window
            hidden |= key_pos < seq_lens[lo:hi, None] - window
        k = read_rows(kv.k, table[lo:hi], kv.k_scale).flatten(1, 2)  # (b, L, Hkv, D)
        v = read_rows(kv.v, table[lo:hi], kv.v_scale).flatten(1, 2).masked_fill(hidden[:, :, None, None], 0.0)
        qg = q[lo:hi].reshape(hi - lo, num_kv_heads, -1, head_dim).float()  # (b, Hkv, G, D)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # (b, Hkv, G, L)
        probs = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(dim=-1)
        out[lo:hi] = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(hi - lo, num_heads, head_dim).to(q.dtype)
    return out


def _prefill_attention(
    q: torch.Tensor, kv: KVCache, block_table: torch.Tensor, seq_len: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """One sequence's chunk q (n, Hq, D) at positions seq_len-n .. seq_len-1, causal (within ``window`` when
    given); returns (n, Hq, D). Keys before the first query's window are not read."""
    num_queries, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv.k.shape[1], kv.k.shape[2]
    first = 0 if window is None else max(0, seq_len - num_queries - window + 1)  # first key any query sees
    blocks = block_table[first // block_size : math.ceil(seq_len / block_size)]
    skipped = first // block_size * block_size  # positions in the blocks not read
    k = read_rows(kv.k, blocks, kv.k_scale).flatten(0, 1)[first - skipped : seq_len - skipped]  # (L, Hkv, D)
    v = read_rows(kv.v, blocks, kv.v_scale).flatten(0, 1)[first - skipped : seq_len - skipped]  # (L, Hkv, D)
    key_pos = torch.arange(first, seq_len, device=q.device)  # (L,)
    out = torch.empty_like(q)
    step = max(1, _MAX_SCORE_ELEMENTS // ((seq_len - first) * num_heads))
    for lo in range(0, num_queries, step):
        hi = min(num_queries, lo + step)
        qg = q[lo:hi].reshape(hi - lo, num_kv_heads, -1, head_dim).float()  # (n, Hkv, G, D)
        scores = torch.einsum("nhgd,lhd->hgnl", qg, k) * scale  # (Hkv, G, n, L)
        query_pos = torch.arange(seq_len - num_queries + lo, seq_len - num_queries + hi, device=q.device)
        hidden = key_pos[None, :] > query_pos[:, None]  # (n, L)
        if window is not None:
            hidden |= key_pos[None, :] <= query_pos[:, None] - window  # (n, L)
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[lo:hi] = torch.einsum("hgnl,lhd->nhgd", probs, v).reshape(hi - lo, num_heads, head_dim).to(q.dtype)
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: AttentionBackend,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's k, v (T, Hkv, D) into the caches, then attend q (T, Hq, D); returns (T, Hq, D).

    k_scale / v_scale: the (Hkv,) float32 scales of FP8 caches (None for caches in the model's dtype).
    window: the layer's sliding window in tokens (None: full attention); see the module docstring."""
    if k_scale is None and v_scale is None:  # the caches' dtype is the model's: every backend takes this call
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return attend_stored(q, k_cache, v_cache, meta, scale, backend, k_scale, v_scale, window)


def attend_stored(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: AttentionBackend,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attend q (T, Hq, D) over caches that already hold this step's K/V (written by a fused kernel, e.g.
    ``store_kv.norm_rope_store``); returns (T, Hq, D). A ``window`` goes to the backend as its ``window`` keyword
    (only then: a backend without sliding windows keeps its signature, and is refused here by name)."""
    check_sliding_window(backend, window)
    scales = () if k_scale is None and v_scale is None else (k_scale, v_scale)
    if window is None:
        return backend.attend(q, k_cache, v_cache, meta, scale, *scales)
    return backend.attend(q, k_cache, v_cache, meta, scale, *scales, window=window)


def check_sliding_window(backend: AttentionBackend, window: int | None) -> None:
    """Raise ValueError for a bad ``window`` (``check_window``), or one that ``backend`` cannot honour, naming it and
    the backends that can (never silently attend over the whole context)."""
    check_window(window)
    if window is not None and not backend.supports_sliding_window:
        from fnvllm.kernels.backends import sliding_window_backends  # (the backends import this module)

        raise ValueError(
            f"attention backend {backend.name!r} has no sliding-window attention (window={window}); use one of "
            f"{sliding_window_backends()}"
        )

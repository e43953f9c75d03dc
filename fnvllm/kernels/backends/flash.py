"""FlashAttention-4 (``flash_attn.cute``, the ``[flash]`` extra: ``pip install flash-attn-4``) on Hopper and
Blackwell: varlen queries over paged K/V (``page_table`` = our block tables, ``seqused_k`` = our seq_lens).

K/V are written by our Triton store kernel (flash-attn has none for this layout). No FP8 KV cache here
(``supports_fp8_kv`` False: ``kv_cache_dtype="fp8"`` with ``attention_backend="flash"`` is refused when the engine
is built, and "auto" picks a backend that reads FP8). A sliding window of w tokens is flash-attn's
``window_size=(w - 1, 0)`` with causal=True: the query at position i (queries aligned to the end of the keys) sees
keys i - (w - 1) .. i, transformers' rule (key j iff 0 <= i - j < w); flash-attn skips the key blocks before it.
"""

from __future__ import annotations

import torch

from fnvllm.kernels.attention import AttentionMetadata
from fnvllm.kernels.backends import AttentionBackend
from fnvllm.kernels.store_kv import store_kv

try:
    from flash_attn.cute import flash_attn_varlen_func
except ImportError as e:
    raise ImportError("flash-attn-4 is not installed (pip install flash-attn-4, the [flash] extra)") from e


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Paged attention of q (T, Hq, D) through flash_attn_varlen_func, within a sliding ``window`` of tokens when
    given; returns (T, Hq, D)."""
    local = {} if window is None else {"window_size": window_size(window)}  # full attention: flash-attn's default
    out = flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        max_seqlen_q=meta.max_seqlen_q,
        seqused_k=meta.seq_lens,
        page_table=meta.block_tables,
        softmax_scale=scale,
        causal=True,
        pack_gqa=True,
        **local,
    )
    return out[0] if isinstance(out, tuple) else out


def window_size(window: int) -> tuple[int, int]:
    """flash-attn's (left, right) ``window_size`` for a sliding window of ``window`` tokens: (window - 1, 0), each
    query seeing itself and the window - 1 keys before it."""
    return (window - 1, 0)


def _unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA device, got {device}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"FlashAttention-4 needs compute capability >= 9.0 (Hopper/Blackwell), got {major}.x"
    return None


BACKEND = AttentionBackend(
    name="flash",
    store_kv=store_kv,
    attend=attend,
    priority=10,
    unavailable_reason=_unavailable,
    supports_cuda_graphs=False,
    supports_sliding_window=True,
)

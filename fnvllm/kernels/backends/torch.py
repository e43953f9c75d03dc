"""The reference backend: pure torch (``paged_attention_ref``), on any device. Slow; the yardstick (FP8 caches
included: rows are dequantized as they are read; sliding windows included: keys outside a query's window are
masked, and a prefill chunk reads no block before its first query's window)."""

from __future__ import annotations

import torch

from fnvllm.kernels.attention import paged_attention_ref, write_kv
from fnvllm.kernels.backends import AttentionBackend


def _always(_: torch.device) -> str | None:
    return None


BACKEND = AttentionBackend(
    name="torch",
    store_kv=write_kv,
    attend=paged_attention_ref,
    priority=0,
    unavailable_reason=_always,
    supports_cuda_graphs=False,  # the decode path reads max_seqlen_k on the host
    supports_fp8_kv=True,
    kv_layouts=("NHD", "HND"),
    supports_sliding_window=True,
)

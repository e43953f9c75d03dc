"""Our Triton kernels: slot-mapped KV store, split-K decode attention, varlen paged prefill attention.

All-decode steps (every query chunk of length 1) go to the bandwidth-built decode kernel, whose launch depends
only on tensor shapes, so it can be captured in CUDA graphs; mixed steps go to the varlen prefill kernel. Both
take a layer's sliding window as a compile-time constant and skip the KV tiles before it.
"""

from __future__ import annotations

import torch

from fnvllm.kernels.attention import AttentionMetadata
from fnvllm.kernels.backends import AttentionBackend
from fnvllm.kernels.decode_attention import paged_decode_attention
from fnvllm.kernels.prefill_attention import paged_prefill_attention
from fnvllm.kernels.store_kv import store_kv


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Paged attention of q (T, Hq, D) over the caches (FP8 ones with their (Hkv,) scales), within a sliding
    ``window`` of tokens when given; returns (T, Hq, D)."""
    if meta.max_seqlen_q == 1:  # all-decode: T == B
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
            seq_order=meta.decode_order,
            window=window,
        )
    return paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.cu_seqlens_q,
        meta.seq_lens,
        meta.block_tables,
        meta.max_seqlen_q,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
        work=meta.prefill_work,
        window=window,
    )


def _unavailable(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    return f"the Triton kernels need a CUDA device, got {device} (kernel tests run them under TRITON_INTERPRET=1)"


def auto_kv_layout(kv_cache_dtype: str) -> str:
    """Head-major ("HND") FP8 caches, token-major ("NHD") 16-bit ones. H100, 2026-12-06 (BENCHMARKS.md, thirtieth
    session), same call: the FP8 decode kernel ("mma_eo", B 256, contexts U(100, 2048)) 207.5 us a launch over
    HND caches against 217.7 over NHD (209.7 against 216.7 on 88 SMs, the H200 stand-in), the Qwen3-0.6B bench
    workload with an FP8 cache 31,230 / 31,233 tok/s against 30,495 / 30,569; the bf16 kernel level (404.7
    against 404.8 us) and the bf16 latency rows slower in HND (device ms at 16 / 64 requests 1.140 / 1.713
    against 1.135 / 1.695)."""
    return "HND" if kv_cache_dtype == "fp8" else "NHD"


BACKEND = AttentionBackend(
    name="triton",
    store_kv=store_kv,
    attend=attend,
    priority=20,
    unavailable_reason=_unavailable,
    supports_cuda_graphs=True,
    supports_fp8_kv=True,
    kv_layouts=("NHD", "HND"),
    auto_kv_layout=auto_kv_layout,
    supports_sliding_window=True,
)

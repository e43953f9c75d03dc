"""The FP8 KV-cache format and its torch reference: float8_e4m3fn values with a float32 scale per KV head.

A cached key (or value) row x of KV head h is stored as ``q = e4m3(clamp(x / scale[h], -448, 448))``, rounded to
nearest even, and read back as ``q * scale[h]``. Each layer has its own ``k_scale`` and ``v_scale``, both (Hkv,)
float32 (a tensor-parallel rank holds its own KV heads' entries). Without calibration data the scale is 1.0: keys
after the per-head norm and rope, and values, are O(1-10) in the Qwen3/Llama models, far inside e4m3's range
(+-448), so the relative rounding error is that of a 3-bit mantissa: at most 2**-4 = 6.25 % per element (half an
ulp), about 2-3 % on average, plus an absolute 2**-10 for tiny values (below e4m3's 2**-6 normals).

Worked example (scale 0.5): x = 3.3 -> 3.3 / 0.5 = 6.6 -> e4m3 6.5 (6.6 lies between 6.5 and 7.0) -> read as
6.5 * 0.5 = 3.25. x = 500 -> 1000 -> saturates to 448 -> 224.

The Triton store kernel (``store_kv.py``) encodes the same bits as ``quantize_fp8`` (tested bit for bit); the
attention kernels read e4m3 and fold the scales in (the key scale into the softmax scale, the value scale into
the output), which is exact up to float32 rounding.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_CACHE_DTYPES = ("auto", "fp8")  # EngineConfig.kv_cache_dtype's choices


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for ``EngineConfig.kv_cache_dtype``: "auto" = the model's, "fp8" = e4m3."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def is_fp8(t: torch.Tensor) -> bool:
    """True when ``t`` holds float8_e4m3fn values (an FP8 KV cache)."""
    return t.dtype == FP8_DTYPE


def default_kv_scales(num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The scale used when the checkpoint carries none: 1.0 per KV head, (Hkv,) float32."""
    return torch.ones(num_kv_heads, dtype=torch.float32, device=device)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., Hkv, D) -> float8_e4m3fn of x / scale (scale (Hkv,)), saturated to +-448, rounded to nearest even."""
    scaled = x.float() / scale.float()[:, None]  # (..., Hkv, D)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 x (..., Hkv, D) -> float32 x * scale (scale (Hkv,))."""
    return x.float() * scale.float()[:, None]


def check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, what: str = "caches"
) -> None:
    """Raise ValueError unless an FP8 cache (num_blocks, block_size, Hkv, D) comes with contiguous (Hkv,) float32
    k_scale and v_scale on its device; a cache of another dtype takes no scales."""
    if not is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for float8_e4m3fn {what}; these are {k_cache.dtype}")
        return
    num_kv_heads = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"float8_e4m3fn {what} need {name} ((Hkv,) float32, one scale per KV head)")
        if s.shape != (num_kv_heads,) or s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(
                f"{name} must be ({num_kv_heads},) float32 on {k_cache.device}, got {tuple(s.shape)} {s.dtype} "
                f"on {s.device}"
            )
        if not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

"""Store this step's keys and values into the paged KV cache: a Triton kernel beside its torch reference.

Algorithm: one program per fed token t. It reads the token's keys and values, (Hkv, D) each, as one flat
vector and writes them to row `slot_mapping[t]` of the flattened caches, viewed as (num_slots, Hkv, D) with
num_slots = num_blocks * block_size. Slots are always valid: the engine pads CUDA-graph batches with a real
scratch block, so there is no "skip this token" sentinel.

Worked example (block_size 4, Hkv 2, D 8): token t with slot_mapping[t] = 9 (block 2, offset 1) copies its 16
key values to k_cache.view(-1, 16)[9], i.e. k_cache[2, 1], and its 16 value values to v_cache[2, 1].

k and v may be strided views of a fused qkv projection ((T, Hkv, D) with any token and head stride); only the
last dim must be contiguous. The caches must be contiguous. Values are cast to the cache dtype on store.

FP8 caches (float8_e4m3fn, with (Hkv,) float32 k_scale / v_scale; see ``fp8.py``): each value x of head h is
stored as e4m3(x / scale[h]), saturated to +-448 and rounded to nearest even. The kernel writes the e4m3 bits
itself (``e4m3_bits``) into a uint8 view of the cache rather than casting to tl.float8e4nv: Triton's CPU
interpreter (triton 3.9) converts float32 to e4m3 wrongly (7.77 -> 4.0, truncation elsewhere), while its e4m3
loads are right, so one bit-exact encoder serves the interpreter tests and the GPU alike. The division is
IEEE-rounded (``div_rn``) so the bits equal ``fp8.quantize_fp8``'s on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.attention import write_kv
from fnvllm.kernels.fp8 import check_kv_scales, is_fp8


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference: write k, v (T, Hkv, D) into slots `slot_mapping` (T,) of the caches (quantized by the
    scales when FP8), in place."""
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@triton.jit
def e4m3_bits(x):
    """float32 x -> the uint8 bits of float8_e4m3fn(x): saturated to +-448, rounded to nearest even, NaN -> 0x7F
    (keeping its sign bit).

    Normals (|x| >= 2**-6): round the float32 mantissa to 3 bits by adding 0x7FFFF plus the kept lsb to the
    bits, then rebias the exponent (127 -> 7). Subnormals (k * 2**-9, k in 0..8): |x| * 512 + 2**23 rounds
    |x| * 512 to an integer (float32 spacing there is 1), read off the low bits; k = 8 is the smallest normal.
    Worked example: 6.6 = 0x40D33333 -> (0x40D33333 + 0x7FFFF + 1) >> 20 = 0x40D (exponent 129, mantissa 0b101)
    -> 0x40D - 960 = 0x4D = 6.5.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)  # FP8_MAX
    a_bits = a.to(tl.int32, bitcast=True)
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) & 0xF
    code = tl.where(a >= 0.015625, normal, subnormal)
    code = tl.where(x != x, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def quantized_bits(x, scale_ptr, head, mask):
    """e4m3 bits of x / scale[head] (x and head of one shape; IEEE division, so equal to torch's)."""
    s = tl.load(scale_ptr + head, mask=mask, other=1.0)
    return e4m3_bits(tl.math.div_rn(x.to(tl.float32), s))


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,  # (Hkv,) float32 scales of an FP8 cache (unread otherwise)
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_DIM
    KV_FP8: tl.constexpr,  # the caches are uint8 views of e4m3 caches: store quantized bits
):
    """Copy token program_id(0)'s (Hkv, D) keys and values to its cache slot (quantized when KV_FP8)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # flat (head, dim) index
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    row = token.to(tl.int64)
    k = tl.load(k_ptr + row * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + dim, mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs
    if KV_FP8:
        tl.store(k_cache_ptr + dst, quantized_bits(k, k_scale_ptr, head, mask), mask=mask)
        tl.store(v_cache_ptr + dst, quantized_bits(v, v_scale_ptr, head, mask), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v (T, Hkv, D) into slots `slot_mapping` (T,) of the paged caches, in place (Triton).

    The caches are (num_blocks, block_size, Hkv, D) and contiguous; every slot must be in range (not checked on
    the device: the launcher reads no device values, so it can be captured in a CUDA graph). FP8 caches need
    k_scale and v_scale, (Hkv,) float32, and store the values quantized (see the module docstring).
    """
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    fp8 = is_fp8(k_cache)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        slot_mapping if k_scale is None else k_scale,  # any pointer where the kernel reads no scale
        slot_mapping if v_scale is None else v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        KV_FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def _check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Raise ValueError naming the argument when shapes, dtypes, devices or layouts do not fit."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be (T, Hkv, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, Hkv, D), got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k/v heads and dim {tuple(k.shape[1:])} != cache heads and dim {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be ({k.shape[0]},) int32/int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if not (k.dtype.is_floating_point and v.dtype == k.dtype and v_cache.dtype == k_cache.dtype):
        raise ValueError(
            f"k and v must share a float dtype, and so must the caches; got k {k.dtype}, v {v.dtype}, "
            f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if k.stride(2) != 1 or v.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k and v need a contiguous last dim, and k_cache / v_cache must be contiguous")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"k, v, caches and slot_mapping must be on one device, got {sorted(map(str, devices))}")

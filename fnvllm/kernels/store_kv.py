"""Store this step's keys and values into the paged KV cache: a Triton kernel beside its torch reference.

Algorithm: one program per fed token t. It reads the token's keys and values, (Hkv, D) each, as one flat
vector and writes them to slot `slot_mapping[t]` = block * block_size + offset, i.e. k_cache[block, offset]
(Hkv, D). Slots are always valid: the engine pads CUDA-graph batches with a real scratch block, so there is no
"skip this token" sentinel.

Worked example (block_size 4, Hkv 2, D 8): token t with slot_mapping[t] = 9 (block 2, offset 1) copies its 16
key values to k_cache[2, 1] and its 16 value values to v_cache[2, 1]. In a token-major ("NHD") cache that is
one 16-element run at element 9 * 16; in a head-major ("HND", ``attention.kv_layout``) one it is two 8-element
runs, head h's at element (2 * 2 + h) * 4 * 8 + 1 * 8 (``cache_row_offsets``).

k and v may be strided views of a fused qkv projection ((T, Hkv, D) with any token and head stride); only the
last dim must be contiguous. The caches must be in one of the two memory orders, both the same. Values are cast
to the cache dtype on store.

FP8 caches (float8_e4m3fn, with (Hkv,) float32 k_scale / v_scale; see ``fp8.py``): each value x of head h is
stored as e4m3(x / scale[h]), saturated to +-448 and rounded to nearest even. The kernel writes the e4m3 bits
itself (``e4m3_bits``) into a uint8 view of the cache rather than casting to tl.float8e4nv: Triton's CPU
interpreter (triton 3.9) converts float32 to e4m3 wrongly (7.77 -> 4.0, truncation elsewhere), while its e4m3
loads are right, so one bit-exact encoder serves the interpreter tests and the GPU alike. The division is
IEEE-rounded (``div_rn``) so the bits equal ``fp8.quantize_fp8``'s on both.

``norm_rope_store`` is the attention prologue of a layer in one kernel: from the qkv projection's output it
RMS-normalises each q and k head (Qwen3's q_norm / k_norm; skipped without weights), rotates q and k, writes the
rotated q out and stores the rotated k and the v into the caches (quantized for FP8) -- where the unfused path
runs norm+rotary on q, norm+rotary on k and ``store_kv`` (three launches). Its reference is
``norm_rope_store_ref``; the arithmetic is the unfused kernels', so the outputs are the same bits.

Two grids compute it: "token" (one program per token does all its Hq + 2 Hkv heads) and "head" (one program per
(block of up to 16 tokens, head): 40 programs at one token for Qwen3-0.6B's 16 q and 8 kv heads, so the work
spreads over more SMs; faster at <= 64 tokens, where the default "auto" takes it: see ``NORM_ROPE_GRIDS``). The
per-head work is ``prologue_head_rows``, which the qkv projection's epilogue (``skinny_gemm.norm_linear_rope_store``)
runs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.env import env_choice
from fnvllm.kernels.attention import check_same_layout, kv_layout, write_kv
from fnvllm.kernels.fp8 import check_kv_scales, is_fp8
from fnvllm.kernels.fused_ops import (
    SplitPartials,
    _check_rotary_args,
    _row_warps,
    norm_rope_heads,
    pdl_launch,
    sum_split_partials,
    triggers_first,
    use_pdl,
    wait_for_previous_kernel,
)
from fnvllm.kernels.reference import norm_rotary_ref


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
def cache_row_offsets(
    slot, head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_MAJOR: tl.constexpr
):
    """Element offset of KV head ``head``'s row of cache slot ``slot`` (int64, broadcastable shapes): token-major
    ("NHD") caches (slot * Hkv + head) * D; head-major ("HND", ``attention.kv_layout``) ones
    (block * Hkv + head) * block_size * D + offset * D, with slot = block * block_size + offset."""
    if HEAD_MAJOR:
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        return (block * NUM_KV_HEADS + head) * (BLOCK_SIZE * HEAD_DIM) + offset * HEAD_DIM
    return (slot * NUM_KV_HEADS + head) * HEAD_DIM


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
    BLOCK_SIZE: tl.constexpr,  # tokens a cache block
    HEAD_MAJOR: tl.constexpr,  # the caches' memory order is "HND" (else "NHD")
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
    dst = cache_row_offsets(slot, head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, HEAD_MAJOR) + dim
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

    The caches are (num_blocks, block_size, Hkv, D) in either memory order (``attention.kv_layout``); every slot
    must be in range (not checked on the device: the launcher reads no device values, so it can be captured in a
    CUDA graph). FP8 caches need k_scale and v_scale, (Hkv,) float32, and store the values quantized (see the
    module docstring).
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
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_MAJOR=kv_layout(k_cache) == "HND",
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
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k and v need a contiguous last dim, got strides {k.stride()} and {v.stride()}")
    check_same_layout(k_cache, v_cache)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"k, v, caches and slot_mapping must be on one device, got {sorted(map(str, devices))}")


def norm_rope_store_ref(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: split qkv (T, (Hq + 2 Hkv) D) into q, k, v; q and k per-head RMSNorm (when weights are
    given) and rotary; store k, v into the caches at slot_mapping (quantized by the scales when FP8); return q
    (T, Hq, D)."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = norm_rotary_ref(q.reshape(num_tokens, num_heads, head_dim), q_weight, eps, cos, sin)  # (T, Hq, D)
    k = norm_rotary_ref(k.reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps, cos, sin)  # (T, Hkv, D)
    write_kv(k, v.reshape(num_tokens, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


@triton.jit
def _norm_rope_store_kernel(
    qkv_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    stride_t,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_HEADS
    BLOCK_KV: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens a cache block
    HEAD_MAJOR: tl.constexpr,  # the caches' memory order is "HND" (else "NHD")
    USE_PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,
):
    """Token program_id(0): q heads normed, rotated and written to q_out (T, Hq, D); k heads normed, rotated and
    stored, v stored, at the token's cache slot (e4m3 bits of value / scale[head] when KV_FP8)."""
    wait_for_previous_kernel(USE_PDL, TRIGGER_FIRST)
    tok = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + tok * stride_ct + j)[None, :].to(tl.float32)  # (1, HALF)
    sin = tl.load(sin_ptr + tok * stride_st + j)[None, :].to(tl.float32)
    row = qkv_ptr + tok * stride_t
    h = tl.arange(0, BLOCK_H)
    q_mask = (h < NUM_HEADS)[:, None]
    q_offs = h[:, None] * (2 * HALF) + j[None, :]  # (BLOCK_H, HALF)
    q1, q2 = norm_rope_heads(row + q_offs, q_mask, q_w_ptr, cos, sin, eps, HALF, HAS_NORM, dtype)
    q_dst = q_out_ptr + tok * (NUM_HEADS * 2 * HALF) + q_offs
    tl.store(q_dst, q1.to(dtype), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(dtype), mask=q_mask)
    kh = tl.arange(0, BLOCK_KV)
    kv_mask = (kh < NUM_KV_HEADS)[:, None]
    kv_offs = kh[:, None] * (2 * HALF) + j[None, :]  # (BLOCK_KV, HALF) within the Hkv * D of k (or v)
    k_src = row + NUM_HEADS * 2 * HALF + kv_offs
    k1, k2 = norm_rope_heads(k_src, kv_mask, k_w_ptr, cos, sin, eps, HALF, HAS_NORM, dtype)
    v1 = tl.load(k_src + NUM_KV_HEADS * 2 * HALF, mask=kv_mask, other=0.0)
    v2 = tl.load(k_src + NUM_KV_HEADS * 2 * HALF + HALF, mask=kv_mask, other=0.0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    dst = cache_row_offsets(slot, kh[:, None], NUM_KV_HEADS, 2 * HALF, BLOCK_SIZE, HEAD_MAJOR) + j[None, :]
    k1, k2 = k1.to(dtype), k2.to(dtype)  # rounded as the unfused path's k tensor is
    if KV_FP8:
        heads = kh[:, None] + 0 * j[None, :]  # (BLOCK_KV, HALF) head of each value
        tl.store(k_cache_ptr + dst, quantized_bits(k1, k_scale_ptr, heads, kv_mask), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, quantized_bits(k2, k_scale_ptr, heads, kv_mask), mask=kv_mask)
        tl.store(v_cache_ptr + dst, quantized_bits(v1, v_scale_ptr, heads, kv_mask), mask=kv_mask)
        tl.store(v_cache_ptr + dst + HALF, quantized_bits(v2, v_scale_ptr, heads, kv_mask), mask=kv_mask)
    else:
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, k1.to(cache_dtype), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(cache_dtype), mask=kv_mask)
        tl.store(v_cache_ptr + dst, v1.to(cache_dtype), mask=kv_mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(cache_dtype), mask=kv_mask)


@triton.jit
def _norm_rope_values(x1, x2, w_ptr, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr, dtype: tl.constexpr):
    """``fused_ops.norm_rope_heads`` on loaded float32 halves x1, x2 (R, HALF) of R head rows: the same arithmetic
    (so the same bits), rotated halves (R, HALF) float32."""
    if HAS_NORM:
        j = tl.arange(0, HALF)
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)  # (R,)
        w1 = tl.load(w_ptr + j)[None, :].to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j)[None, :].to(tl.float32)
        x1 = (w1 * (x1 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_cache_rows(cache_ptr, scale_ptr, slot_ptr, rows, row_ok, kv_head, x1, x2, NUM_KV_HEADS: tl.constexpr,
                      HALF: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HEAD_MAJOR: tl.constexpr):  # fmt: skip
    """Store halves x1, x2 (R, HALF) of KV head kv_head of tokens rows (R,) (where row_ok) at their slots (e4m3
    bits of x / scale[kv_head] when KV_FP8, else cast to the cache dtype)."""
    j = tl.arange(0, HALF)
    mask = row_ok[:, None]
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # (R,)
    dst = cache_ptr + cache_row_offsets(slot[:, None], kv_head, NUM_KV_HEADS, 2 * HALF, BLOCK_SIZE, HEAD_MAJOR)
    dst += j[None, :]
    if KV_FP8:
        heads = kv_head + 0 * j[None, :] + 0 * rows[:, None]  # (R, HALF) head of each value
        tl.store(dst, quantized_bits(x1, scale_ptr, heads, mask), mask=mask)
        tl.store(dst + HALF, quantized_bits(x2, scale_ptr, heads, mask), mask=mask)
    else:
        tl.store(dst, x1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_values(src, mask, slab, NUM_PARTS: tl.constexpr, dtype: tl.constexpr):
    """Float32 values of the qkv rows at src (0 where not mask): the 16-bit values, or with NUM_PARTS > 0 the sum
    of NUM_PARTS float32 partial slabs slab elements apart, in split order from 0 and rounded to dtype, which is the
    projection's own output (``skinny_gemm``'s in-kernel sum adds them to zeros in the same order)."""
    if NUM_PARTS > 0:
        acc = 0.0 + tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, NUM_PARTS):
            acc += tl.load(src + s * slab, mask=mask, other=0.0, cache_modifier=".cg")
        return acc.to(dtype).to(tl.float32)
    return tl.load(src, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def prologue_head_rows(
    qkv_ptr,
    stride_t,
    rows,  # (R,) token indices (int32)
    row_ok,  # (R,) which of them exist
    head,  # scalar: q heads 0 .. Hq - 1, then the Hkv k heads, then the Hkv v heads
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    stride_ct,
    stride_st,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
    slab,  # NUM_PARTS > 0: elements between two partial slabs (T x stride_t)
    NUM_PARTS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens a cache block
    HEAD_MAJOR: tl.constexpr,  # the caches' memory order is "HND" (else "NHD")
):
    """``norm_rope_store``'s work for one head of the qkv row layout and the tokens rows: a q head normed, rotated
    and written to q_out (T, Hq, D); a k head normed, rotated and stored at the tokens' slots; a v head stored.
    The rows are read with ".cg" (from L2: in the qkv GEMM's epilogue other programs wrote them). NUM_PARTS > 0:
    qkv_ptr holds the projection's float32 split partials (NUM_PARTS slabs), summed here (``_qkv_values``)."""
    j = tl.arange(0, HALF)
    mask = row_ok[:, None]
    src = qkv_ptr + rows[:, None].to(tl.int64) * stride_t + head * (2 * HALF) + j[None, :]  # (R, HALF)
    dtype = q_out_ptr.dtype.element_ty
    x1 = _qkv_values(src, mask, slab, NUM_PARTS, dtype)
    x2 = _qkv_values(src + HALF, mask, slab, NUM_PARTS, dtype)
    if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: norm and rotary
        cos = tl.load(cos_ptr + rows[:, None].to(tl.int64) * stride_ct + j[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + rows[:, None].to(tl.int64) * stride_st + j[None, :], mask=mask, other=0.0)
        if head < NUM_HEADS:
            r1, r2 = _norm_rope_values(x1, x2, q_w_ptr, cos.to(tl.float32), sin.to(tl.float32), eps, HALF,
                                       HAS_NORM, dtype)  # fmt: skip
            q_dst = q_out_ptr + rows[:, None].to(tl.int64) * (NUM_HEADS * 2 * HALF) + head * (2 * HALF) + j[None, :]
            tl.store(q_dst, r1.to(dtype), mask=mask)
            tl.store(q_dst + HALF, r2.to(dtype), mask=mask)
        else:
            r1, r2 = _norm_rope_values(x1, x2, k_w_ptr, cos.to(tl.float32), sin.to(tl.float32), eps, HALF,
                                       HAS_NORM, dtype)  # fmt: skip
            _store_cache_rows(k_cache_ptr, k_scale_ptr, slot_ptr, rows, row_ok, head - NUM_HEADS, r1.to(dtype),
                              r2.to(dtype), NUM_KV_HEADS, HALF, KV_FP8, BLOCK_SIZE, HEAD_MAJOR)  # fmt: skip
    else:  # v: stored as it is
        _store_cache_rows(v_cache_ptr, v_scale_ptr, slot_ptr, rows, row_ok, head - NUM_HEADS - NUM_KV_HEADS,
                          x1.to(dtype), x2.to(dtype), NUM_KV_HEADS, HALF, KV_FP8, BLOCK_SIZE, HEAD_MAJOR)  # fmt: skip


@triton.jit
def _norm_rope_store_heads_kernel(
    qkv_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    eps,
    num_tokens,
    stride_t,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,
    NUM_PARTS: tl.constexpr,  # > 0: qkv_ptr holds that many float32 partial slabs of num_tokens x stride_t
    BLOCK_SIZE: tl.constexpr,  # tokens a cache block
    HEAD_MAJOR: tl.constexpr,  # the caches' memory order is "HND" (else "NHD")
):
    """Program (token block program_id(0), head program_id(1) of Hq + 2 Hkv): ``prologue_head_rows`` for that
    head of BLOCK_T tokens (the "head" grid: more, shorter programs than one per token)."""
    wait_for_previous_kernel(USE_PDL, TRIGGER_FIRST)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    prologue_head_rows(
        qkv_ptr, stride_t, rows, rows < num_tokens, tl.program_id(1), q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        k_scale_ptr, v_scale_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, stride_ct, stride_st, eps, NUM_HEADS,
        NUM_KV_HEADS, HALF, HAS_NORM, KV_FP8, num_tokens * stride_t, NUM_PARTS, BLOCK_SIZE, HEAD_MAJOR,
    )  # fmt: skip


# The grid of ``norm_rope_store``: "token" (one program per token does all its heads) or "head" (one program per (block
# of up to HEAD_GRID_TOKENS tokens, head)); "auto" (the default) takes "head" at <= HEAD_GRID_MAX_TOKENS tokens, "token"
# above. First measured at <= 16 tokens, H200, Qwen3-0.6B, whole decode step (benchmarks/bench_qkv_epilogue.py,
# 2026-12-02 05:35): B = 1 768.6 us "token" against 750.6 "head"; B = 16 1144.5 against 1141.0; the layer's norm + qkv +
# prologue alone at 16 rows 8.12 against 7.58 us. Engine-level A/B (latency bench, one call, main 5d76b68, 2026-12-02
# 08:05): ms per decode step at 1 / 16 / 64 requests 0.825 / 1.175 / 1.701 with "token" (device 0.818 / 1.156 / 1.622)
# against 0.806 / 1.161 / 1.745 with "auto" (device 0.799 / 1.142 / 1.622; the 64-row step does not take it). Since
# extended to 17-64 tokens (HEAD_GRID_MAX_TOKENS): latency bench, one call, main 338e266, 2026-12-04, two alternated
# rounds, device ms per decode step at 32 / 64 requests 1.318-1.319 / 1.490 with "head" against 1.323 / 1.498-1.499 with
# "auto" as it was (BENCHMARKS.md, fourteenth session). The two grids do the same arithmetic, bit-equal under the
# interpreter and in the GPU tests' shapes, but not always at Qwen3-0.6B's (16 + 2 x 8 heads of 128) on the H200, where
# the compiled kernels round some float32 steps differently: greedy tokens of random weights over 48 steps, "token"
# against "head" at 32 / 64 requests, 1,501 of 1,536 / 3,017 of 3,072 equal. Above 64 tokens (prefill chunks, large
# decode batches) "token" stays (not measured against "head" there). FNVLLM_NORM_ROPE_GRID overrides.
NORM_ROPE_GRIDS = ("auto", "token", "head")
NORM_ROPE_GRID_ENV = "FNVLLM_NORM_ROPE_GRID"
HEAD_GRID_TOKENS = 16  # tokens per program of the "head" grid
HEAD_GRID_MAX_TOKENS = 64  # "auto" takes the "head" grid up to this many tokens


def default_grid() -> str:
    """The grid ``norm_rope_store`` launches when none is given: FNVLLM_NORM_ROPE_GRID, else "auto"."""
    return env_choice(NORM_ROPE_GRID_ENV, NORM_ROPE_GRIDS, "auto")


def resolve_grid(grid: str, num_tokens: int) -> str:
    """The concrete grid ("token" or "head") that ``grid`` means for num_tokens tokens ("auto": "head" at <=
    HEAD_GRID_MAX_TOKENS tokens, else "token")."""
    if grid not in NORM_ROPE_GRIDS:
        raise ValueError(f"grid must be one of {NORM_ROPE_GRIDS}, got {grid!r}")
    if grid == "auto":
        return "head" if num_tokens <= HEAD_GRID_MAX_TOKENS else "token"
    return grid


def norm_rope_store(
    qkv: torch.Tensor | SplitPartials,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    grid: str | None = None,
) -> torch.Tensor:
    """``norm_rope_store_ref`` in one kernel: returns the normed, rotated q (T, Hq, D) and stores k (normed,
    rotated) and v into the caches in place. qkv (T, (Hq + 2 Hkv) D) may have strided rows (a contiguous last
    dim); q_weight and k_weight are both (D,) or both None; cos/sin (T, D/2) float32; caches and scales as
    ``store_kv``'s. grid: "token" (one program per token), "head" (one per (token block, head)) or "auto"
    (``resolve_grid``); None: ``default_grid()``. All do the same arithmetic (bit-equal under the interpreter; on a GPU
    the compiled grids may round a float32 step differently, see NORM_ROPE_GRIDS). Reads no device values (CUDA-graph
    capturable). qkv may be the projection's K-split float32 partials (``SplitPartials`` of (S, T, N), from
    ``skinny_gemm.linear_partials``): the "head" grid sums them as it reads its rows, into the bits the projection
    would have written; the "token" grid takes them summed first (``fused_ops.sum_split_partials``)."""
    parts = None
    num_tokens = qkv.parts.shape[1] if isinstance(qkv, SplitPartials) else qkv.shape[0]
    use_heads = num_tokens > 0 and resolve_grid(default_grid() if grid is None else grid, num_tokens) == "head"
    if isinstance(qkv, SplitPartials):
        parts = qkv.parts.contiguous() if use_heads else None
        qkv = (  # the heads grid reads the partials; an unwritten stand-in of their sum's shape serves the checks
            parts.new_empty(parts.shape[1:], dtype=qkv.dtype) if parts is not None else sum_split_partials(qkv)
        )
    head_dim = k_cache.shape[-1]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)  # (T, Hq, D)
    check_prologue_args(qkv, num_heads, num_kv_heads, q_weight, k_weight, cos, sin, q, k_cache, v_cache,
                        slot_mapping, k_scale, v_scale)  # fmt: skip
    if num_tokens == 0:
        return q
    if use_heads:
        _launch_heads_grid(qkv if parts is None else parts, num_heads, num_kv_heads, q_weight, k_weight, eps, cos,
                           sin, q, k_cache, v_cache, slot_mapping, k_scale, v_scale)  # fmt: skip
        return q
    fp8 = is_fp8(k_cache)
    _norm_rope_store_kernel[(num_tokens,)](
        *_prologue_pointers(qkv, q_weight, k_weight, cos, sin, q, k_cache, v_cache, slot_mapping, k_scale, v_scale),
        eps,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HAS_NORM=q_weight is not None,
        KV_FP8=fp8,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_MAJOR=kv_layout(k_cache) == "HND",
        USE_PDL=use_pdl(qkv.device),
        TRIGGER_FIRST=triggers_first(qkv.device, num_tokens),
        num_warps=_row_warps(triton.next_power_of_2(num_heads) * head_dim),
        **pdl_launch(qkv.device),
    )
    return q


def _launch_heads_grid(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """``norm_rope_store``'s "head" grid: one program per (block of up to HEAD_GRID_TOKENS tokens, head of the
    Hq + 2 Hkv), writing q in place and the caches (arguments checked by the caller). qkv (T, N) 16-bit, or its
    float32 split partials (S, T, N), contiguous."""
    parts = qkv.shape[0] if qkv.dim() == 3 else 0
    num_tokens, head_dim = qkv.shape[-2], k_cache.shape[-1]
    block_t = min(HEAD_GRID_TOKENS, int(triton.next_power_of_2(num_tokens)))
    fp8 = is_fp8(k_cache)
    _norm_rope_store_heads_kernel[(triton.cdiv(num_tokens, block_t), num_heads + 2 * num_kv_heads)](
        *_prologue_pointers(qkv, q_weight, k_weight, cos, sin, q, k_cache, v_cache, slot_mapping, k_scale, v_scale),
        eps,
        num_tokens,
        qkv.stride(-2),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        BLOCK_T=block_t,
        HAS_NORM=q_weight is not None,
        KV_FP8=fp8,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_MAJOR=kv_layout(k_cache) == "HND",
        USE_PDL=use_pdl(qkv.device),
        TRIGGER_FIRST=triggers_first(qkv.device, num_tokens),
        NUM_PARTS=parts,
        num_warps=_row_warps(block_t * head_dim),
        **pdl_launch(qkv.device),
    )


def _prologue_pointers(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The tensor arguments both prologue kernels take first, in order: qkv, the q/k norm weights (cos where there
    is none: a pointer the kernel never reads), cos, sin, q out, the caches (bytes for FP8), the slots and the FP8
    scales (the slots where the cache is 16-bit: never read)."""
    fp8 = is_fp8(k_cache)
    return (
        qkv,
        q_weight if q_weight is not None else cos,
        k_weight if k_weight is not None else cos,
        cos,
        sin,
        q,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        slot_mapping if k_scale is None else k_scale,
        slot_mapping if v_scale is None else v_scale,
    )


def check_prologue_args(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument unless ``norm_rope_store``'s arguments fit together, with q its
    (T, Hq, D) output (contiguous, qkv's dtype)."""
    num_tokens = qkv.shape[0]
    head_dim = _check_fused_args(qkv, num_heads, num_kv_heads, q_weight, k_weight, k_cache)
    want = (num_tokens, num_heads, head_dim)
    if q.shape != want or not q.is_contiguous() or q.dtype != qkv.dtype:
        raise ValueError(f"q must be a contiguous {want} {qkv.dtype} tensor, got {tuple(q.shape)} {q.dtype}")
    _check_rotary_args(q, cos, sin)
    k_view = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    _check_store_args(k_view, k_view, k_cache, v_cache, slot_mapping)
    check_kv_scales(k_cache, k_scale, v_scale)


def _check_fused_args(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    k_cache: torch.Tensor,
) -> int:
    """Raise ValueError naming the argument unless qkv is (T, (Hq + 2 Hkv) D) for the caches' D and the norm
    weights are both (D,) or both None; returns D."""
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_heads and num_kv_heads must be >= 1, got {num_heads} and {num_kv_heads}")
    head_dim = k_cache.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be (T, {width}) = (T, (Hq + 2 Hkv) * D) with a contiguous last dim, got {tuple(qkv.shape)}"
        )
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (head_dim,) or not w.is_contiguous() or w.device != qkv.device):
            raise ValueError(f"{name} must be a contiguous ({head_dim},) tensor on {qkv.device}, got {tuple(w.shape)}")
    return head_dim

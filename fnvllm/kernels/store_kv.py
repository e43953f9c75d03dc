"""Store this step's keys and values into the paged KV cache: a Triton kernel beside its torch reference.

Algorithm: one program per fed token t. It reads the token's keys and values, (Hkv, D) each, as one flat
vector and writes them to row `slot_mapping[t]` of the flattened caches, viewed as (num_slots, Hkv, D) with
num_slots = num_blocks * block_size. Slots are always valid: the engine pads CUDA-graph batches with a real
scratch block, so there is no "skip this token" sentinel.

Worked example (block_size 4, Hkv 2, D 8): token t with slot_mapping[t] = 9 (block 2, offset 1) copies its 16
key values to k_cache.view(-1, 16)[9], i.e. k_cache[2, 1], and its 16 value values to v_cache[2, 1].

k and v may be strided views of a fused qkv projection ((T, Hkv, D) with any token and head stride); only the
last dim must be contiguous. The caches must be contiguous. Values are cast to the cache dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fnvllm.kernels.attention import write_kv


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference: write k, v (T, Hkv, D) into slots `slot_mapping` (T,) of the caches, in place."""
    write_kv(k, v, k_cache, v_cache, slot_mapping)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_DIM
):
    """Copy token program_id(0)'s (Hkv, D) keys and values to its cache slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # flat (head, dim) index
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    row = token.to(tl.int64)
    k = tl.load(k_ptr + row * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + dim, mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v (T, Hkv, D) into slots `slot_mapping` (T,) of the paged caches, in place (Triton).

    The caches are (num_blocks, block_size, Hkv, D) and contiguous; every slot must be in range (not checked on
    the device: the launcher reads no device values, so it can be captured in a CUDA graph).
    """
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
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

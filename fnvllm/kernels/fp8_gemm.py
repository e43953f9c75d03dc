"""FP8 weight GEMMs in Triton, beside the torch reference (``fp8_linear_ref``).

The weight format is the official block-quantized one (DeepSeek-V3, Qwen3-*-FP8): ``w`` (N, K) float8_e4m3fn and
``w_scale`` (ceil(N / 128), ceil(K / 128)) float32, one scale per 128 x 128 block, so that the real weight is
``w[n, k] * w_scale[n // 128, k // 128]`` (HF calls the scale ``weight_scale_inv``; it multiplies). Edge blocks
(N or K not a multiple of 128) are partial; their scale covers the rows and columns that exist.

Two kernels, picked by the number of tokens M (``fp8_linear``):

- ``fp8_gemm_small_m`` (M <= SMALL_M, decode): bandwidth-bound, so it only has to stream the weight bytes fast.
  Activations stay in their 16-bit dtype; each program loads a (BLOCK_N, 128) fp8 tile, widens it in registers,
  multiplies, and applies the block's one scale to the partial product. Split-K keeps all SMs busy when N is
  small (o_proj: 4096 rows = 64 tiles of 64 rows for 132 SMs): each of SPLIT_K programs of a row tile sums its
  K range into its own float32 slice, and the slices are summed in torch (deterministic, unlike atomic adds).
- ``fp8_gemm_blockwise`` (prefill): compute-bound, so both operands go to the fp8 tensor cores.
  ``quantize_activations`` scales each (token, 128-column group) of x by its own amax / 448 (one kernel), then
  the GEMM multiplies fp8 tiles with float32 accumulation and applies x_scale[m, kg] * w_scale[n_block, kg] to
  each 128-deep partial product (DeepSeek-V3's scheme; BLOCK_K = BLOCK_N = 128 so one weight scale per tile).

- ``fp8_scaled_mm`` (from SCALED_MM_MIN_ROWS tokens, where torch and the GPU have it): the same activation
  quantization, then cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1 x 128 activation and 128 x 128
  weight scales, sm_90, CUDA >= 12.9); measured faster than the Triton GEMMs from 16 tokens up (see
  ``fp8_linear``). The Triton GEMMs remain for decode-sized M and where cuBLAS lacks the recipe.

Under the Triton CPU interpreter fp8 pointers load and widen correctly (triton 3.9), so the kernels take the
float8 tensors themselves; 16-bit dot operands are widened to float32 there (``decode_attention.dot``). The
interpreter's float32 -> e4m3 conversion is wrong where rounding crosses a power of two (126.25 -> 64), so under
it ``quantize_activations`` rounds to the e4m3 grid in float32 first (half away from zero; the GPU rounds half to
even: ties differ, nothing else).
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fnvllm.kernels.decode_attention import dot, dot_precision, upcast_dot
from fnvllm.kernels.reference import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    SCALE_BLOCK,
    dequantize_fp8_blocks,
    expand_block_scales,
    fp8_linear_ref,
)

# The references live in fnvllm.kernels.reference (torch only: the model imports them without Triton); they are
# re-exported here beside the kernels tested against them.
__all__ = [
    "FP8_DTYPE",
    "SCALE_BLOCK",
    "SMALL_M",
    "dequantize_fp8_blocks",
    "expand_block_scales",
    "fp8_blockwise_ref",
    "fp8_gemm_blockwise",
    "fp8_gemm_small_m",
    "fp8_linear",
    "fp8_linear_ref",
    "fp8_scaled_mm",
    "quantize_activations",
    "quantize_activations_ref",
]

SMALL_M = 64  # up to this many tokens the bandwidth kernel runs, above it the fp8 tensor-core GEMM
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


# ---- torch reference (the weight's in fnvllm.kernels.reference) ----------------------------------------------


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q (M, K) fp8, x_scale (M, ceil(K / 128)) float32): each (token, 128-column group) scaled to amax 448."""
    m, k = x.shape
    groups = triton.cdiv(k, SCALE_BLOCK)
    padded = F.pad(x.float(), (0, groups * SCALE_BLOCK - k)).view(m, groups, SCALE_BLOCK)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # (M, groups)
    x_q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(m, groups * SCALE_BLOCK)[:, :k].contiguous(), scale


def fp8_blockwise_ref(
    x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """What ``fp8_gemm_blockwise`` computes from already quantized activations, in float32, cast to dtype."""
    k = x_q.shape[1]
    x = x_q.float() * x_scale.repeat_interleave(SCALE_BLOCK, dim=1)[:, :k]
    return (x @ dequantize_fp8_blocks(w, w_scale, torch.float32).T).to(dtype)


# ---- dispatch ---------------------------------------------------------------------------------------------------


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ dequantized(w).T (+ bias) in x's dtype. On CUDA with 16-bit activations: up to
    SCALED_MM_MIN_ROWS - 1 tokens ``fp8_gemm_small_m`` (streams the weight), above it cuBLAS's block-scaled GEMM
    (``fp8_scaled_mm``) where the weight is whole 128 x 128 blocks and torch has it, else ``fp8_gemm_blockwise``
    (Triton) up to SMALL_M tokens or above. Elsewhere the torch reference.

    Why: on the H200, for one Qwen3-8B layer's four GEMMs, cuBLAS's block-scaled GEMM is faster than the Triton
    kernels from 16 tokens up and about equal below (BENCHMARKS.md, "FP8 weight GEMMs")."""
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES:
        return fp8_linear_ref(x, w, w_scale, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    if m >= SCALED_MM_MIN_ROWS and _has_block_scaled_mm(x.device.index or 0) and scaled_mm_supported(*w.shape):
        return fp8_scaled_mm(x, w, w_scale, bias)
    if m <= SMALL_M:
        out = fp8_gemm_small_m(x, w, w_scale)
    else:
        out = fp8_gemm_blockwise(*quantize_activations(x), w, w_scale, x.dtype)
    return out if bias is None else out.add_(bias)


# From this many tokens up, cuBLAS's block-scaled GEMM beats the streaming kernel (measured above).
SCALED_MM_MIN_ROWS = 16


@functools.cache
def _has_block_scaled_mm(device_index: int) -> bool:
    """Whether torch._scaled_mm takes DeepSeek-style block scales on this GPU (sm_90 with CUDA >= 12.9): one small
    product is tried once per device. (torch tells the recipes apart by the scales' shapes: with one 128-column
    group a (M, 1) activation scale would read as row-wise, hence K = 512 here.)"""
    try:
        w = torch.zeros(384, 512, dtype=FP8_DTYPE, device=f"cuda:{device_index}")
        x = torch.zeros(8, 512, dtype=torch.bfloat16, device=w.device)
        fp8_scaled_mm(x, w, torch.ones(3, 4, device=w.device))
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


# ---- small M: stream the weight bytes ---------------------------------------------------------------------------


@triton.jit
def _small_m_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K, stride_xm, stride_sn, stride_os, stride_om,
    K_BLOCKS_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_N rows, K range) tile: out[split, :, rows] = sum over its 128-wide K blocks of
    (x block @ w block.T) * w_scale[row block, k block]."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    scale_row = s_ptr + (pid_n * BLOCK_N // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * K_BLOCKS_PER_SPLIT
    for kb in range(first, tl.minimum(first + K_BLOCKS_PER_SPLIT, tl.cdiv(K, 128))):
        k = kb * 128 + offs_k
        x_mask = (offs_m[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (k[None, :] < K)  # zeros past K: garbage e4m3 bytes may be NaN
        w = tl.load(w_ptr + offs_n[:, None] * K + k[None, :], mask=w_mask, other=0.0)
        part = dot(x, tl.trans(w.to(x.dtype)), PRECISION, UPCAST)  # (BLOCK_M, BLOCK_N)
        acc += part * tl.load(scale_row + kb)
    out = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@functools.cache
def _num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (queried once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@attrs.frozen
class SmallMConfig:
    """Launch shape of ``fp8_gemm_small_m``: rows per program (16, 32, 64 or 128: one scale row-block holds a
    whole number of tiles), K splits (each writes its own float32 partial sum), software pipeline stages."""

    block_n: int
    split_k: int
    num_stages: int = 4


def pick_small_m_config(n: int, k: int, device: torch.device) -> SmallMConfig:
    """Enough programs to keep every SM streaming (>= 1.5 per SM): the widest row tile that gives that, else
    16-row tiles split along K (powers of two, at most the K blocks). Qwen3-8B on 132 SMs: o 4096 rows -> 16-row
    tiles (256 programs), gate_up 24576 -> 64-row tiles (384), qkv 6144 -> 16 (384)."""
    target = 3 * (_num_sms(device.index or 0) if device.type == "cuda" else 132) // 2
    for block_n in (64, 32, 16):
        if triton.cdiv(n, block_n) >= target:
            return SmallMConfig(block_n, 1)
    split, tiles, k_blocks = 1, triton.cdiv(n, 16), triton.cdiv(k, 128)
    while tiles * split < target and split * 2 <= k_blocks:
        split *= 2
    return SmallMConfig(16, split)


def fp8_gemm_small_m(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: SmallMConfig | None = None
) -> torch.Tensor:
    """x (M, K) 16-bit, M <= 64 @ dequantized(w (N, K) fp8).T -> (M, N) in x's dtype (see the module docstring).

    config: tile and split choice (None = ``pick_small_m_config``)."""
    m, k, n = _check_gemm_args(x, w, w_scale)
    cfg = config or pick_small_m_config(n, k, x.device)
    if m > SMALL_M or cfg.block_n not in (16, 32, 64, 128) or cfg.split_k < 1:
        raise ValueError(f"fp8_gemm_small_m takes M <= {SMALL_M}, block_n in (16, 32, 64, 128), split_k >= 1; "
                         f"got M={m}, {cfg}")  # fmt: skip
    k_blocks, num_tiles = triton.cdiv(k, 128), triton.cdiv(n, cfg.block_n)
    per_split = triton.cdiv(k_blocks, cfg.split_k)
    split = triton.cdiv(k_blocks, per_split)  # no empty split
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    _small_m_kernel[(num_tiles, split)](
        x, w, w_scale, out,
        m, n, k, x.stride(0), w_scale.stride(0), out.stride(0), out.stride(1),
        per_split,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot(x.device), num_warps=4, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(dim=0).to(x.dtype)  # (M, N)


# ---- large M: fp8 tensor cores ----------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3(v):
    """v rounded (half away from zero) to the e4m3 grid: 3 mantissa bits, subnormal step 2**-9."""
    exponent = tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625)))  # 2**-6: the smallest normal
    step = tl.exp2(exponent - 3.0)
    return tl.where(v < 0, -1.0, 1.0) * tl.floor(tl.abs(v) / step + 0.5) * step


@triton.jit
def _quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr
):
    """One (token, 128-column group): scale = max(amax / 448, 1e-12); q = x / scale in e4m3. ROUND_FIRST (the
    interpreter only, whose float32 -> e4m3 conversion drops the carry of a rounding that crosses a power of two:
    126.25 -> 64) rounds to the e4m3 grid in float32 first, so the conversion is exact."""
    row, group = tl.program_id(0), tl.program_id(1)
    k = group * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)) / FP8_MAX, 1e-12)
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        q = _round_to_e4m3(q)
    tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel of ``quantize_activations_ref``: (x_q (M, K) fp8, x_scale (M, ceil(K / 128)) float32)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    groups = triton.cdiv(k, 128)
    x_q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_activations_kernel[(m, groups)](
            x, x_q, x_scale, k, x.stride(0), x_q.stride(0), x_scale.stride(0), FP8_MAX=FP8_MAX,
            ROUND_FIRST=upcast_dot(x.device),
        )  # fmt: skip
    return x_q, x_scale


@triton.jit
def _blockwise_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, stride_am, stride_asm, stride_wsn, stride_om,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, 128) output tile: sum over K blocks of (a block @ w block.T) * a_scale[m, kb] * w_scale[nb, kb],
    tiles walked in groups of GROUP_M row tiles so programs running together share weight tiles in L2."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, 128)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * 128 + tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        k = kb * 128 + offs_k
        a_mask = (offs_m[:, None] < M) & (k[None, :] < K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (k[None, :] < K)  # zeros past K: garbage e4m3 bytes may be NaN
        w = tl.load(w_ptr + offs_n[:, None] * K + k[None, :], mask=w_mask, other=0.0)
        a_scale = tl.load(as_ptr + offs_m * stride_asm + kb, mask=offs_m < M, other=0.0)
        w_scale = tl.load(ws_ptr + pid_n * stride_wsn + kb)
        if UPCAST:  # the interpreter: exact in float32
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # fp8 x fp8 on the tensor cores, float32 accumulation
            part = tl.dot(a, tl.trans(w))
        acc += part * (a_scale[:, None] * w_scale)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_gemm_blockwise(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
    block_m: int | None = None,
    group_m: int = 8,
) -> torch.Tensor:
    """Quantized activations (``quantize_activations``) @ dequantized(w).T -> (M, N) in ``dtype``, on the fp8
    tensor cores (see the module docstring); the kernel of ``fp8_blockwise_ref``. block_m: token rows per
    program (None: 64 up to 512 tokens, so that a few hundred tokens still fill the SMs, else 128)."""
    m, k, n = _check_gemm_args(x_q, w, w_scale)
    block_m = block_m or (64 if m <= 512 else 128)
    if tuple(x_scale.shape) != (m, triton.cdiv(k, 128)):
        raise ValueError(f"x_scale must be (M, ceil(K / 128)) = ({m}, {triton.cdiv(k, 128)}), got {x_scale.shape}")
    out = torch.empty((m, n), dtype=dtype, device=x_q.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, 128),)
    if m:
        _blockwise_kernel[grid](
            x_q, x_scale, w, w_scale, out,
            m, n, k, x_q.stride(0), x_scale.stride(0), w_scale.stride(0), out.stride(0),
            BLOCK_M=block_m, GROUP_M=group_m, UPCAST=upcast_dot(x_q.device), num_warps=8, num_stages=3,
        )  # fmt: skip
    return out


def _check_gemm_args(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[int, int, int]:
    """(M, K, N) after checking shapes, dtypes and the contiguity the kernels index by."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x (M, K) and w (N, K) must agree on K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.dtype != FP8_DTYPE or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"w must be contiguous {FP8_DTYPE} and x's rows contiguous, got {w.dtype}, {x.stride()}")
    n, k = w.shape
    blocks = (triton.cdiv(n, 128), triton.cdiv(k, 128))
    if tuple(w_scale.shape) != blocks or w_scale.dtype != torch.float32 or w_scale.stride(1) != 1:
        raise ValueError(f"w_scale must be float32 {blocks} with contiguous rows, got {w_scale.dtype} {w_scale.shape}")
    return x.shape[0], k, n


# ---- cuBLAS block-scaled GEMM (torch._scaled_mm) ---------------------------------------------------------------


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of ``multiple`` (cuBLASLt wants M in multiples of 4)."""
    extra = -x.shape[0] % multiple
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def cublas_scale_layouts(x_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors as cuBLAS's DeepSeek-style recipe (1 x 128 activations, 128 x 128 weights) reads them:
    activations (M, K/128) outer-dim-major (stride (1, M)); weights (N/128, K/128) with K/128 padded to a multiple of
    4, given as its transpose (K/128 padded, N/128) with stride (1, padded)."""
    a = x_scale.t().contiguous().t()
    k_blocks = w_scale.shape[1]
    b = F.pad(w_scale, (0, -k_blocks % 4)).t()
    return a, b


def scaled_mm_supported(n: int, k: int) -> bool:
    """Whether ``fp8_scaled_mm`` can take an (N, K) weight: whole 128 x 128 blocks (cuBLAS has no partial ones), and
    at least two 128-column groups (with one, torch reads the activation scale as a row-wise one)."""
    return n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0 and k >= 2 * SCALE_BLOCK


def fp8_scaled_mm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ dequantized(w).T with cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm``, sm_90 and
    CUDA >= 12.9): the activations quantized per (token, 128 columns) by ``quantize_activations``, the weight's
    128 x 128 block scales as stored (``weight_scale_inv`` multiplies). Same numerics as ``fp8_blockwise_ref``."""
    m = x.shape[0]
    x_q, x_scale = quantize_activations(x if x.stride(-1) == 1 else x.contiguous())
    x_q, x_scale = _pad_rows(x_q, 4), _pad_rows(x_scale, 4)
    scale_a, scale_b = cublas_scale_layouts(x_scale, w_scale)
    out = torch._scaled_mm(x_q, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    out = out[:m]
    return out if bias is None else out.add_(bias)

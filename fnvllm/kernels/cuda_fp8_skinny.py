"""Few-row FP8 projections in CUDA (compiled at run time by NVRTC, like ``cuda_skinny``'s bf16 ones): y (M <= 16,
N) in bf16 = x (M, K) @ dequantized(W (N, K) e4m3, 128 x 128 block scales)^T, for the products ``FP8_CONFIGS``
lists, beside their reference ``fp8_gemm.fp8_blockwise_ref``.

Why. ``fp8_gemm.fp8_linear`` runs a few-token product as up to three launches: the activations' quantization, the
swapped Triton kernel (split K) and the split sum. This kernel covers all of K in one block (no split, no sum
launch) and loads a thread's whole share of the weight into registers, 16 bytes a load, before the programmatic-
dependent-launch wait, so under PDL the weight read overlaps the kernel before it and only x is read after the
wait. Measured on the H200 (BENCHMARKS.md, eighteenth session, ``benchmarks/probe_cuda_skinny.cu``'s first form of
this kernel, Qwen3-8B o_proj 4096 x 4096 at 16 rows from ready fp8 activations, chains of launches over weight
copies past L2): 6.78 us a launch against 8.63 for the shipped swap kernel and its sum.

Algorithm. A block is 8 warps and 32 weight rows (four n8 tiles of ``mma.m16n8k32`` e4m3); warp w covers K columns
[w * 128P, (w + 1) * 128P), P 128-deep scale groups, so K = 8 * 128 * P and the grid is N / 32 blocks. Each group's
product is accumulated on its own and multiplied by x_scale[row, group] * w_scale[n / 128, group] before it joins
the warp's accumulator (the scales' 128 x 128 blocks and (token, 128) groups); the block adds its 8 warps' (16, 32)
tiles through shared memory in warp order and rounds each sum to bf16 once.

The k permutation (as in ``cuda_skinny``). ``mma.m16n8k32`` gives thread (g = lane / 4, t = lane % 4) the k slots
{4t .. 4t + 3, 4t + 16 .. 4t + 19} of its A rows g, g + 8 and of its B column g. A dot product does not care which
k meets which slot as long as x and W agree, so the thread loads the 16 contiguous bytes at k = base + 16t of weight
row n + g and of x rows g and g + 8, and gives words .x/.y to one MMA and .z/.w to the next: a 64-column half of a
group in two MMAs, 64 contiguous bytes of a row per 4 threads, no shared memory and no shuffles.

In-kernel quantization (the ``_q`` kernels, M <= 8). There x arrives in bf16 and each thread quantizes its own 32
values of a (row, group) after the wait: the group's largest magnitude is a max over the 4 threads that hold the
row's group (two shuffles), then scale = max(amax * (1 / 448), 1e-12) and q = clamp(x / scale, -448, 448) rounded
to e4m3 (``cvt.rn.satfinite.e4m3x2.f32``), the division being ``div.full.f32`` as Triton's float32 ``/`` is
(``fused_ops.quantize_groups``, the one definition), so the bytes and scales equal
``fp8_gemm.quantize_activations``' bit for bit and the result equals the quantization launch followed by the plain
kernel. Every block quantizes all of x for itself; at M <= 8 rows (so only A row g is loaded) that is at most 8 x K
bf16 from L2 a block, against the quantization launch it replaces.

Used by ``fp8_gemm.fp8_linear`` for few-token bf16 products of the weights ``FP8_CONFIGS`` lists, on sm_90+ GPUs
where NVRTC compiles the source; elsewhere, or with FNVLLM_CUDA_SKINNY=0 (``cuda_skinny.ENABLED``), the Triton
path stays. A failed compile warns once and falls back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fnvllm.kernels import cuda_skinny

SOURCE = (
    cuda_skinny.PRELUDE
    + r"""
typedef unsigned char u8;
typedef unsigned short u16;

MMA_SYNC(mma_e4m3, "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32")

__device__ __forceinline__ float div_full(float a, float b) {  // Triton's float32 division
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ u32 e4m3x4(float v0, float v1, float v2, float v3) {  // v0 in the lowest byte
  u16 lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  return (u32)lo | ((u32)hi << 16);
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Quantize 16 bf16 values (two uint4, memory order) by 1 / scale into 16 e4m3 bytes (one uint4, memory order).
__device__ __forceinline__ uint4 quantize16(uint4 a, uint4 b, float scale) {
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  u32 q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[4] = {bf16_lo(w[2 * i]), bf16_hi(w[2 * i]), bf16_lo(w[2 * i + 1]), bf16_hi(w[2 * i + 1])};
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = fminf(fmaxf(div_full(v[j], scale), -448.f), 448.f);
    q[i] = e4m3x4(v[0], v[1], v[2], v[3]);
  }
  return make_uint4(q[0], q[1], q[2], q[3]);
}

__device__ __forceinline__ float amax16(uint4 a, uint4 b) {
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fmaxf(fabsf(bf16_lo(w[i])), fabsf(bf16_hi(w[i]))));
  return m;
}

// QUANT: x is bf16 (M <= 8) and quantized here; else x is e4m3 with xs its (M, K / 128) float32 scales.
template <int P, bool QUANT>
__device__ __forceinline__ void fp8_skinny(const void* __restrict__ x, const float* __restrict__ xs,
                                           const u8* __restrict__ w, const float* __restrict__ ws, u16* __restrict__ y,
                                           int M, int N, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 32;
  const int k0 = warp * P * 128;
  const int groups = K / 128;
  uint4 wr[P][2][4];  // group p, 64-column half h, n8 tile j: read before the wait (no kernel writes weights)
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wr[p][h][j] = load_weight(w + (size_t)(n0 + 8 * j + g) * K + k0 + 128 * p + 64 * h + 16 * t);
  float wsc[P];
#pragma unroll
  for (int p = 0; p < P; ++p) wsc[p] = ws[(n0 / 128) * groups + k0 / 128 + p];
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  asm volatile("griddepcontrol.launch_dependents;");
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 xr[P][2][2];  // group p, half h, row g / g + 8
  float sx[P][2];
  if (QUANT) {
    const u16* xb = (const u16*)x;
    uint4 raw[P][2][2];  // group p, half h, first / second 8 values of the thread's 16
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const u16* at = xb + (size_t)g * K + k0 + 128 * p + 64 * h + 16 * t;
        raw[p][h][0] = g < M ? *(const uint4*)at : zero;
        raw[p][h][1] = g < M ? *(const uint4*)(at + 8) : zero;
      }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float m = fmaxf(amax16(raw[p][0][0], raw[p][0][1]), amax16(raw[p][1][0], raw[p][1][1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float scale = fmaxf(m * __int_as_float(0x3b124925), 1e-12f);  // amax * (1 / 448), as Triton's
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        xr[p][h][0] = quantize16(raw[p][h][0], raw[p][h][1], scale);
        xr[p][h][1] = zero;
      }
      sx[p][0] = g < M ? scale : 0.f;
      sx[p][1] = 0.f;
    }
  } else {
    const u8* xq = (const u8*)x;
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = k0 + 128 * p + 64 * h + 16 * t;
        xr[p][h][0] = g < M ? *(const uint4*)(xq + (size_t)g * K + k) : zero;
        xr[p][h][1] = g + 8 < M ? *(const uint4*)(xq + (size_t)(g + 8) * K + k) : zero;
      }
      sx[p][0] = g < M ? xs[g * groups + k0 / 128 + p] : 0.f;
      sx[p][1] = g + 8 < M ? xs[(g + 8) * groups + k0 / 128 + p] : 0.f;
    }
  }
  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const float s0 = sx[p][0] * wsc[p], s1 = sx[p][1] * wsc[p];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 a = xr[p][h][0], b = xr[p][h][1], v = wr[p][h][j];
        mma_e4m3(c, a.x, b.x, a.y, b.y, v.x, v.y);
        mma_e4m3(c, a.z, b.z, a.w, b.w, v.z, v.w);
      }
      acc[j][0] += c[0] * s0;
      acc[j][1] += c[1] * s0;
      acc[j][2] += c[2] * s1;
      acc[j][3] += c[3] * s1;
    }
  }
  __shared__ float red[8][16][33];  // (K warp, row, column), padded against bank conflicts
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    red[warp][g][8 * j + 2 * t] = acc[j][0];
    red[warp][g][8 * j + 2 * t + 1] = acc[j][1];
    red[warp][g + 8][8 * j + 2 * t] = acc[j][2];
    red[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  const int row = threadIdx.x >> 4, col = (threadIdx.x & 15) * 2;  // thread -> (row, two columns)
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    s0 += red[v][row][col];
    s1 += red[v][row][col + 1];
  }
  if (row < M) {
    u32 out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(s1), "f"(s0));
    *(u32*)(y + (size_t)row * N + n0 + col) = out;
  }
}

#define FP8_SKINNY(P, QUANT, NAME)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) NAME(const void* x, const float* xs, const u8* w,            \
                                                         const float* ws, u16* y, int M, int N, int K) {          \
    fp8_skinny<P, QUANT>(x, xs, w, ws, y, M, N, K);                                                               \
  }
FP8_SKINNY(1, false, fp8_skinny_p1)
FP8_SKINNY(2, false, fp8_skinny_p2)
FP8_SKINNY(4, false, fp8_skinny_p4)
FP8_SKINNY(1, true, fp8_skinny_q_p1)
FP8_SKINNY(2, true, fp8_skinny_q_p2)
FP8_SKINNY(4, true, fp8_skinny_q_p4)
"""
)

MAX_ROWS = 16  # rows g and g + 8 of one m16 tile
QUANT_MAX_ROWS = 8  # the in-kernel quantization loads row g only
GROUP = 128  # columns a scale covers (activations and weight blocks)
PER_GROUP_DEPTH = cuda_skinny.WARPS * GROUP  # K a block covers per unit of P
PS = (1, 2, 4)  # the kernels' scale groups a warp


class Fp8Config(NamedTuple):
    """A product's launch shape: p 128-column scale groups a warp (K = 8 * 128 * p), and up to quant_rows rows
    (at most QUANT_MAX_ROWS) quantized in the kernel (bf16 activations, one launch) rather than by
    ``fp8_gemm.quantize_activations`` before it (0: never)."""

    p: int
    quant_rows: int = 0


# (N, K) -> launch shape, for 1-16 rows. H200 (BENCHMARKS.md, twenty-sixth session): o_proj 7.98 / 8.55 / 9.48 us at
# 1 / 8 / 16 bf16 rows against the Triton path's 8.37 / 9.16 / 9.25, 7.17-7.73 against 7.82-8.69 from ready e4m3;
# 8B FP8 decode 3.069 -> 3.010 ms a step at one request, 16 unchanged. Qwen3-8B's qkv and gate_up lose by 20-30 %
# (not listed), and the in-kernel quantization loses at every M (quant_rows stays 0).
FP8_CONFIGS: dict[tuple[int, int], Fp8Config] = {
    (4096, 4096): Fp8Config(4),  # Qwen3-8B o_proj
}


def kernel_name(p: int, quant: bool) -> str:
    """The SOURCE entry point for p scale groups a warp, quantizing in the kernel or not: fp8_skinny_q_p4, ..."""
    return f"fp8_skinny{'_q' if quant else ''}_p{p}"


def fp8_config(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> Fp8Config | None:
    """The launch shape for x (M, K) @ w (N, K)^T when this module should take it: ``cuda_skinny.ENABLED``, 1-16
    rows of contiguous 16-byte aligned bf16 or e4m3 activations, a contiguous e4m3 weight with an entry on the same
    CUDA device, its (N / 128, K / 128) float32 block scales contiguous, and the kernels compiled; else None."""
    if not cuda_skinny.ENABLED or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or not x.is_cuda:
        return None
    entry = FP8_CONFIGS.get(tuple(w.shape))  # type: ignore[arg-type]
    fits = (
        entry is not None
        and x.device == w.device
        and x.dtype in (torch.bfloat16, torch.float8_e4m3fn)
        and w.dtype == torch.float8_e4m3fn
        and x.shape[1] == w.shape[1]
        and x.is_contiguous()
        and w.is_contiguous()
        and w_scale.is_contiguous()
        and w_scale.dtype == torch.float32
        and tuple(w_scale.shape) == (w.shape[0] // GROUP, w.shape[1] // GROUP)
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
    )
    if not fits or _kernel(x.device.index or 0, kernel_name(entry.p, False)) is None:  # type: ignore[union-attr]
        return None
    return entry


def takes_quantization(config: Fp8Config, num_rows: int) -> bool:
    """Whether a product of num_rows bf16 rows quantizes its activations in the kernel under config."""
    return num_rows <= min(config.quant_rows, QUANT_MAX_ROWS)


def fp8_skinny(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: Fp8Config, x_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """y (M, N) bf16 = x (M, K) @ dequantized(w (N, K) e4m3, block scales w_scale)^T. x is either e4m3 with its
    (M, K / 128) float32 ``x_scale`` (``fp8_gemm.quantize_activations``' layout) or bf16 with x_scale None, then
    quantized in the kernel (at most QUANT_MAX_ROWS rows). ValueError saying what fits otherwise."""
    (m, k), n = x.shape, w.shape[0]
    quant = x_scale is None
    _check_shapes(m, n, k, config, quant, x)
    if not quant and (x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (m, k // GROUP)
                      or not x_scale.is_contiguous()):  # fmt: skip
        raise ValueError(f"x_scale must be contiguous float32 ({m}, {k // GROUP}), got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)}")  # fmt: skip
    name = kernel_name(config.p, quant)
    kernel = _kernel(x.device.index or 0, name)
    if kernel is None:
        raise RuntimeError(f"cuda_fp8_skinny kernel {name} is not available on this device (see fp8_config)")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    scales = x_scale if x_scale is not None else w_scale  # (an unread pointer when quantizing here)
    cuda_skinny.launch(kernel, name, (n // 32, 1), 0, (x, scales, w, w_scale, out), (m, n, k))
    return out


def _check_shapes(m: int, n: int, k: int, config: Fp8Config, quant: bool, x: torch.Tensor) -> None:
    """ValueError unless the kernel for config covers (M, K) x (N, K) exactly."""
    max_rows = QUANT_MAX_ROWS if quant else MAX_ROWS
    want = torch.bfloat16 if quant else torch.float8_e4m3fn
    if config.p not in PS or k != PER_GROUP_DEPTH * config.p or n % 32 or not 1 <= m <= max_rows or x.dtype != want:
        raise ValueError(f"cuda_fp8_skinny takes p in {PS}, K = {PER_GROUP_DEPTH} * p, N a multiple of 32 and "
                         f"1-{max_rows} rows of {want} ({'bf16 quantized here' if quant else 'with x_scale'}); got "
                         f"x {tuple(x.shape)} {x.dtype}, N {n}, {config}")  # fmt: skip


_BUILT: dict[int, dict[str, Any] | None] = {}  # device index -> its compiled kernels by name (None: not available)


def _kernel(device_index: int, name: str) -> Any | None:
    """Kernel ``name`` of SOURCE compiled for a device (``cuda_skinny.compiled_kernel``): a device's first use
    compiles both kernels of every ``FP8_CONFIGS`` entry, so a later capture finds them; others (a benchmark's)
    compile when first asked for."""
    return cuda_skinny.compiled_kernel(_BUILT, device_index, name, SOURCE, _table_kernels, lambda _: 0,
                                       "cuda_fp8_skinny")  # fmt: skip


def _table_kernels() -> set[str]:
    """Both kernels (quantizing or not) of every FP8_CONFIGS entry's p."""
    return {kernel_name(cfg.p, quant) for cfg in FP8_CONFIGS.values() for quant in (False, True)}

"""Few-row bf16 projections in CUDA (compiled at run time by NVRTC): the decode GEMMs that ``CUDA_CONFIGS`` lists
(today at 2-16 rows, where they measured faster than the Triton skinny kernel, ``skinny_gemm``), beside their
reference ``F.linear``.

Why CUDA here. At 16 rows a projection is a read of its weight, and in a decode step's chain of launches what it
costs is how early the read starts and how soon the next launch can start behind it. This kernel loads a thread's
whole share of the weight into registers, 16 bytes a load, before the programmatic-dependent-launch wait, feeds
those registers to ``mma.sync`` as they are (no shared-memory staging, no layout conversion: see the k
permutation below) and needs 62-106 registers a thread, so two to four 8-warp blocks fit on an SM (our reading,
not profiled: the next projection's blocks are placed, and its weights requested, while this one runs). The
register count is what decided it: the same kernels at 58-210 registers (one to three blocks an SM) were no
faster than Triton's (``benchmarks/probe_cuda_skinny.py``). Measured on the H200 (BENCHMARKS.md,
eighteenth session; chains of launches over weight copies past L2, us per launch, Triton's path first): qkv
3.68 -> 3.29, gate/up 5.91 -> 4.65 (both without the SiLU-and-mul epilogue), down 3.67 -> 3.34; the Qwen3-0.6B
decode step at 16 requests 1.069-1.081 -> 1.058-1.060 device ms (four alternated rounds, this module off and on),
where the small kernels between the projections hold back part of that lookahead.

Algorithm. A block is 8 warps and 32 weight rows (four n8 tiles; NW = 1, see Rows for NW = 2); warp w covers its own
KB x 32 columns of K and the block adds the 8 warps' (16, 32) tiles through shared memory. Grid (N / 32, S): split s
covers K columns [s * 256 * KB, (s + 1) * 256 * KB) and stores its float32 partial (S, M, N) for the consumer to sum
in split order (``SplitPartials``). GLU: the weight is [gate | up] (2I rows) and block c takes gate rows 16c..16c+15
and the same up rows, S = 1; the epilogue rounds each sum to bf16 and writes silu(gate) * up in bf16 (I columns).

Rows. A kernel holds MT m16 tiles of x (``TILE_ROWS``: 16, 32 or 64 rows; 2-16 rows take the one-tile kernels, 17-32
two tiles, 33-64 four): the weight registers are loaded once and meet each tile's rows in turn, tiles past M are
skipped, and the (tile, K warp, 16, 32 * NW + 1) sums past one tile live in dynamic shared memory (67.6 KiB at four
tiles, allowed per kernel with ``cuFuncSetAttribute``). At 17-64 rows every block reads its K range of all M rows of
x from L2, at 64 rows twice the weight's bytes with 32 weight rows a block; the NW = 2 kernels (partials at 17-64
rows) split a block's 8 warps into 2 groups of 4 side by side along N, 64 weight rows a block, so x is read once for
twice the rows (at twice the K splits). ptxas (nvcc 13.0, sm_90a) gives the tile kernels 56 (kb 1), 76-80 (kb 2) and
128 (gate/up, kb 4) registers, without spills. One-tile kb 1 and kb 4 partials (42 and 102 registers) exist for the
benchmark's other launch shapes at 2-16 rows (o_proj's, for one). The one-tile kernels the table lists compile to
the same PTX as before tiles and groups were added (modulo labels; checked with nvcc 13.0), and every kernel's
machine code (the sm_90a cubin's .text) is byte-identical since the template was split into the pieces of
``DEVICE_SOURCE`` (thirty-fifth session; ``benchmarks/probe_cluster_skinny.py`` builds from them). Whether any of the
others beat cuBLAS and the Triton kernel is a measurement (``benchmarks/bench_cuda_skinny.py``); until one is made
the table lists no 17-64-row entry and those kernels are only compiled when asked for.

The k permutation. A dot product does not care which k meets which MMA slot as long as x and W agree. In
``mma.m16n8k16`` thread (g = lane / 4, t = lane % 4) holds the k slots {2t, 2t + 1, 2t + 8, 2t + 9}; here it
loads the 8 contiguous bf16 at k = base + 8t of weight row n + g and of x rows g and g + 8 (one 16-byte load
each) and gives words .x/.y (k = 8t .. 8t + 3) to one MMA and .z/.w (8t + 4 .. 8t + 7) to the next: 64
contiguous bytes of a row per 4 threads. Rows past M read as zeros and are not stored.

Used by ``skinny_gemm.linear_partials`` and ``skinny_gemm.norm_mlp`` for the products ``CUDA_CONFIGS`` lists (on
the GPU models ``DEVICE_CONFIGS`` names, with its launch shapes in place of those listed), on sm_90+ GPUs where
NVRTC (``torch.cuda._compile_kernel``) compiles the source (a device's first use compiles the kernels its table
launches); anywhere else, or with FNVLLM_CUDA_SKINNY=0 (read at import), those products stay on the Triton kernel.
A failed compile warns once and falls back.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fnvllm.env import env_switch
from fnvllm.kernels.fused_ops import gpu_model, use_pdl

# What both sources of few-row kernels (this module's and ``cuda_fp8_skinny``'s) start with: the weight load and a
# wrapper for one ``mma.sync`` of four A, two B and four float32 C registers (NAME, its PTX instruction).
PRELUDE = r"""
typedef unsigned int u32;

__device__ __forceinline__ uint4 load_weight(const void* p) {  // weights: read-only, streamed past L1
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

#define MMA_SYNC(NAME, INSTRUCTION)                                                                    \
  __device__ __forceinline__ void NAME(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {     \
    asm volatile(INSTRUCTION " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                  \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                      \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                              \
  }
"""

# The few-row kernels' device code: the prelude, bf16 rounding, and the pieces every such kernel is built from (a
# thread's weight share, one m16 tile's products, the block's sums and their store), then the kernel template that
# reads x from L2 (``benchmarks/probe_cluster_skinny.py`` builds other kernels from the same pieces).
DEVICE_SOURCE = (
    PRELUDE
    + r"""
MMA_SYNC(mma_bf16, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")

__device__ __forceinline__ unsigned short to_bf16(float v) {  // round to nearest even
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

__device__ __forceinline__ float bf16_value(unsigned short h) { return __uint_as_float(((u32)h) << 16); }

// A thread's weight share: n8 tile j, 32-deep block b (rows n0 + 8j + g; GLU: tiles 2-3 are the up rows N / 2 on)
template <int KB, bool GLU>
__device__ __forceinline__ void load_weights(uint4 (&wr)[4][KB], const unsigned short* __restrict__ w, int n0, int N,
                                             int K, int k0, int g, int t) {
#pragma unroll
  for (int b = 0; b < KB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = GLU ? (j < 2 ? n0 + 8 * j + g : N / 2 + n0 + 8 * (j - 2) + g) : n0 + 8 * j + g;
      wr[j][b] = load_weight(w + (size_t)row * K + k0 + 32 * b + 8 * t);
    }
}

// One m16 tile's (16, 32) products: rows r0, r0 + 8 of x (xr) by the thread's weight share (wr)
template <int KB>
__device__ __forceinline__ void tile_products(float (&acc)[4][4], const uint4 (&xr)[2][KB], const uint4 (&wr)[4][KB]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
#pragma unroll
  for (int b = 0; b < KB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mma_bf16(acc[j], xr[0][b].x, xr[1][b].x, xr[0][b].y, xr[1][b].y, wr[j][b].x, wr[j][b].y);
      mma_bf16(acc[j], xr[0][b].z, xr[1][b].z, xr[0][b].w, xr[1][b].w, wr[j][b].z, wr[j][b].w);
    }
}

// One m16 tile's (16, 32) products, stored in the block's sums at (tile, K warp)
template <int COLS>
__device__ __forceinline__ void stash_tile(float (*red)[COLS], const float (&acc)[4][4], int nw, int g, int t) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = 32 * nw + 8 * j + 2 * t;
    red[g][c] = acc[j][0];
    red[g][c + 1] = acc[j][1];
    red[g + 8][c] = acc[j][2];
    red[g + 8][c + 1] = acc[j][3];
  }
}

// The block's outputs from its (tile, K warp, 16, COLS) sums: GLU, silu(gate) * up in bf16; else this split's
// float32 partial
template <bool GLU, int MT, int NW, int KW, int COLS>
__device__ __forceinline__ void store_sums(float (*red)[KW][16][COLS], void* __restrict__ y, int M, int N) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (MT > 1 && 16 * mt >= M) break;
#pragma unroll
    for (int q = 0; q < NW; ++q) {  // the block's q-th 32 weight rows (GLU: 16 output columns)
      if (GLU) {  // thread -> (row, output column): silu(gate) * up of the bf16-rounded sums
        const int row = threadIdx.x >> 4, col = threadIdx.x & 15, m = 16 * mt + row;
        float gate = 0.f, up = 0.f;
#pragma unroll
        for (int v = 0; v < KW; ++v) {
          gate += red[mt][v][row][32 * q + col];
          up += red[mt][v][row][32 * q + 16 + col];
        }
        if (m < M) {
          const float gf = bf16_value(to_bf16(gate)), uf = bf16_value(to_bf16(up));
          const int out0 = (blockIdx.x * NW + q) * 16;
          ((unsigned short*)y)[(size_t)m * (N / 2) + out0 + col] = to_bf16(gf / (1.f + expf(-gf)) * uf);
        }
      } else {  // thread -> (row, two columns) of this split's float32 partial
        const int row = threadIdx.x >> 4, col = 32 * q + (threadIdx.x & 15) * 2, m = 16 * mt + row;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int v = 0; v < KW; ++v) {
          s0 += red[mt][v][row][col];
          s1 += red[mt][v][row][col + 1];
        }
        const int out0 = blockIdx.x * 32 * NW;  // (ints, and float2 units past one group: 8-byte stores)
        if (m < M && NW == 1)
          *(float2*)((float*)y + ((size_t)blockIdx.y * M + m) * N + out0 + col) = make_float2(s0, s1);
        if (m < M && NW > 1)
          ((float2*)y)[((size_t)blockIdx.y * M + m) * (N / 2) + (out0 + col) / 2] = make_float2(s0, s1);
      }
    }
  }
}

template <int KB, bool GLU, int MT, int NW>
__device__ __forceinline__ void skinny_mma(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                           void* __restrict__ y, int M, int N, int K) {
  constexpr int KW = 8 / NW;  // warps along K; NW groups of them side by side along N
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kw = NW == 1 ? warp : warp % KW, nw = NW == 1 ? 0 : warp / KW;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = GLU ? (blockIdx.x * NW + nw) * 16 : (blockIdx.x * NW + nw) * 32;  // GLU: output column; else row
  const int k0 = (blockIdx.y * KW + kw) * KB * 32;
  uint4 wr[4][KB];
  load_weights<KB, GLU>(wr, w, n0, N, K, k0, g, t);  // before the wait (no kernel writes weights)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
  asm volatile("griddepcontrol.launch_dependents;");
  // (m16 tile, K warp, row, column) sums, padded against bank conflicts; past one tile in dynamic shared memory
  constexpr int COLS = 32 * NW + 1;
  __shared__ float red_one[MT == 1 ? KW * 16 * COLS : 1];
  extern __shared__ float red_dynamic[];
  float(*red)[KW][16][COLS] = (float(*)[KW][16][COLS])(MT == 1 ? red_one : red_dynamic);
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (MT > 1 && 16 * mt >= M) break;  // (one tile: M >= 1 rows always)
    const int r0 = 16 * mt + g, r1 = r0 + 8;
    uint4 xr[2][KB];  // rows r0 and r1
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      xr[0][b] = r0 < M ? *(const uint4*)(x + (size_t)r0 * K + k0 + 32 * b + 8 * t) : zero;
      xr[1][b] = r1 < M ? *(const uint4*)(x + (size_t)r1 * K + k0 + 32 * b + 8 * t) : zero;
    }
    float acc[4][4];
    tile_products<KB>(acc, xr, wr);
    stash_tile<COLS>(red[mt][kw], acc, nw, g, t);
  }
  __syncthreads();
  store_sums<GLU, MT, NW, KW, COLS>(red, y, M, N);
}
"""
)

SOURCE = (
    DEVICE_SOURCE
    + r"""
#define PARTIALS(KB, MT, NW, NAME)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) NAME(const unsigned short* x, const unsigned short* w, void* y, \
                                                         int M, int N, int K) {                                     \
    skinny_mma<KB, false, MT, NW>(x, w, y, M, N, K);                                                                \
  }
#define GLU_OUT(KB, MT, NW, NAME)                                                                                   \
  extern "C" __global__ void __launch_bounds__(256) NAME(const unsigned short* x, const unsigned short* w, void* y, \
                                                         int M, int N, int K) {                                     \
    skinny_mma<KB, true, MT, NW>(x, w, y, M, N, K);                                                                 \
  }
PARTIALS(1, 1, 1, skinny_mma_kb1)
PARTIALS(2, 1, 1, skinny_mma_kb2)
PARTIALS(4, 1, 1, skinny_mma_kb4)
PARTIALS(1, 2, 1, skinny_mma_kb1_mt2)
PARTIALS(2, 2, 1, skinny_mma_kb2_mt2)
PARTIALS(1, 4, 1, skinny_mma_kb1_mt4)
PARTIALS(2, 4, 1, skinny_mma_kb2_mt4)
PARTIALS(1, 2, 2, skinny_mma_kb1_mt2_nw2)
PARTIALS(2, 2, 2, skinny_mma_kb2_mt2_nw2)
PARTIALS(1, 4, 2, skinny_mma_kb1_mt4_nw2)
PARTIALS(2, 4, 2, skinny_mma_kb2_mt4_nw2)
GLU_OUT(4, 1, 1, skinny_mma_glu_kb4)
GLU_OUT(4, 2, 1, skinny_mma_glu_kb4_mt2)
GLU_OUT(4, 4, 1, skinny_mma_glu_kb4_mt4)
"""
)

WARPS = 8
COLUMNS = 32  # weight rows a group of warps covers (GLU: 16 gate + 16 up); a block has nw groups
TILE_ROWS = (16, 32, 64)  # the kernels' row capacities: one, two or four m16 tiles (MT)
MAX_ROWS = TILE_ROWS[-1]


class CudaConfig(NamedTuple):
    """A product's launch shape: kb 32-deep K blocks a warp, split K splits, nw groups of 8 / nw warps side by
    side along N (each group 32 weight rows, so a block reads x once for 32 * nw rows; K = split * (8 / nw) * 32 *
    kb)."""

    kb: int
    split: int
    nw: int = 1


# (kind, N, K, tile rows) -> config, bf16: measured faster than the path it replaces on the H200 (BENCHMARKS.md,
# eighteenth session for 2-16 rows; down_proj's kb 4 / 3 splits in the twenty-second: 8 / 16-request steps 0.918-0.920
# / 1.020-1.022 device ms against 0.959-0.961 / 1.060-1.061 with kb 2 / 6, and the same gain on the H100).
# "partials": the product's float32 split partials (qkv, down_proj); "glu": a gate/up projection with SiLU-and-mul
# in its epilogue. Tile rows 16 covers 2-16 rows, 32 covers 17-32, 64 33-64.
CUDA_CONFIGS: dict[tuple[str, int, int, int], CudaConfig] = {
    ("partials", 4096, 1024, 16): CudaConfig(2, 2),  # Qwen3-0.6B qkv
    ("partials", 1024, 3072, 16): CudaConfig(4, 3),  # Qwen3-0.6B down_proj (kb 2 / 6 splits until the 22nd session)
    ("glu", 6144, 1024, 16): CudaConfig(4, 1),  # Qwen3-0.6B gate/up
}
# GPU model (``torch.cuda.get_device_name``, exactly) -> entries that take the place of CUDA_CONFIGS' on that model,
# each measured there in the whole decode step against the entry it replaces (as vLLM keeps tuned kernel configs
# per device). A model not named here takes CUDA_CONFIGS as they are.
# None today: the H100's own down_proj entry (twenty-second session) won on the H200 too and moved to CUDA_CONFIGS.
DEVICE_CONFIGS: dict[str, dict[tuple[str, int, int, int], CudaConfig]] = {}


def kernel_name(kind: str, kb: int, tile: int, nw: int = 1) -> str:
    """The SOURCE entry point for a kind ("partials" or "glu"), kb, tile rows and warp groups along N, e.g.
    skinny_mma_glu_kb4_mt2 or skinny_mma_kb2_mt4_nw2."""
    tiles = "" if tile == 16 else f"_mt{tile // 16}"
    return f"skinny_mma{'_glu' if kind == 'glu' else ''}_kb{kb}{tiles}{'' if nw == 1 else f'_nw{nw}'}"


# (kind, kb, tile rows, nw) of the kernels SOURCE defines
_KERNELS = {
    key: kernel_name(*key)
    for key in [("partials", 1, 16, 1), ("partials", 2, 16, 1), ("partials", 4, 16, 1), ("partials", 1, 32, 1),
                ("partials", 2, 32, 1), ("partials", 1, 64, 1), ("partials", 2, 64, 1), ("partials", 1, 32, 2),
                ("partials", 2, 32, 2), ("partials", 1, 64, 2), ("partials", 2, 64, 2), ("glu", 4, 16, 1),
                ("glu", 4, 32, 1), ("glu", 4, 64, 1)]
}  # fmt: skip
_SHAPES = {name: (tile, nw) for (_, _, tile, nw), name in _KERNELS.items()}  # name -> (tile rows, nw)
ENV = "FNVLLM_CUDA_SKINNY"


def enabled_from_env() -> bool:
    """ENV's value as a switch ("1" or unset: on, "0": off); ValueError naming it otherwise."""
    return env_switch(ENV, True)


ENABLED = enabled_from_env()


def tile_rows(num_rows: int) -> int | None:
    """The smallest kernel row capacity (TILE_ROWS) holding num_rows rows, or None above MAX_ROWS."""
    return next((tile for tile in TILE_ROWS if tile >= num_rows), None)


def shared_bytes(tile: int, nw: int = 1) -> int:
    """Dynamic shared memory of a launch with this many tile rows and warp groups: the (tile, K warp, 16,
    32 * nw + 1) float32 sums past one tile (a one-tile kernel keeps its 16.5 KiB static)."""
    return 0 if tile == 16 else (tile // 16) * (WARPS // nw) * 16 * (COLUMNS * nw + 1) * 4


def table_config(kind: str, num_rows: int, weight: torch.Tensor, dtype: torch.dtype) -> CudaConfig | None:
    """The ``CUDA_CONFIGS`` entry for a ``kind`` product of num_rows rows of ``dtype`` by weight (N, K) when this
    module is on, the rows are 2-64, both are bf16, the weight is a contiguous CUDA tensor and the kernels compiled
    for its device; else None. (``cuda_config`` also checks the activation itself.)"""
    if not ENABLED or not 2 <= num_rows <= MAX_ROWS or weight.device.type != "cuda" or weight.dim() != 2:
        return None
    tile = tile_rows(num_rows) or 0
    entry = listed_config((kind, *weight.shape, tile), weight.device)
    if entry is None or dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        return None
    name = _KERNELS.get((kind, entry.kb, tile, entry.nw))
    if name is None or weight.data_ptr() % 16:
        return None
    return entry if _kernel(weight.device.index or 0, name) is not None else None


def listed_config(key: tuple[str, int, int, int], device: torch.device) -> CudaConfig | None:
    """The entry for (kind, N, K, tile rows) on a device: on a CUDA device its model's ``DEVICE_CONFIGS`` entry,
    else ``CUDA_CONFIGS``' (on any device), else None."""
    if DEVICE_CONFIGS and device.type == "cuda":  # (no name asked while no model has entries of its own)
        own = DEVICE_CONFIGS.get(_device_name(device.index or 0), {}).get(key)
        if own is not None:
            return own
    return CUDA_CONFIGS.get(key)


def device_table(device_name: str) -> dict[tuple[str, int, int, int], CudaConfig]:
    """Every entry a GPU model of this name takes: ``CUDA_CONFIGS`` with its ``DEVICE_CONFIGS`` entries in place."""
    return {**CUDA_CONFIGS, **DEVICE_CONFIGS.get(device_name, {})}


def _device_name(device_index: int) -> str:
    """The GPU model of a device (``fused_ops.gpu_model``, asked once a device; tests replace this name)."""
    return gpu_model(device_index)


def cuda_config(kind: str, x: torch.Tensor, weight: torch.Tensor) -> CudaConfig | None:
    """The launch shape for x (M, K) @ weight (N, K)^T as ``kind`` ("partials" or "glu") when this module should
    take it: ``table_config``'s entry for M rows, with x a contiguous, 16-byte aligned (M, K) tensor on the
    weight's device; else None."""
    if x.dim() != 2 or x.shape[1] != weight.shape[-1] or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    return table_config(kind, x.shape[0], weight, x.dtype) if x.device == weight.device else None


def skinny_partials(x: torch.Tensor, weight: torch.Tensor, config: CudaConfig) -> torch.Tensor:
    """The float32 split partials (S, M, N) of x (M, K) @ weight (N, K)^T: their sum in split order is the product."""
    name = _kernel_for("partials", x, weight, config)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((config.split, m, n), dtype=torch.float32, device=x.device)
    grid = (n // (COLUMNS * config.nw), config.split)
    _launch(name, grid, x, weight, out, m, n, k)
    return out


def glu_out(x: torch.Tensor, weight: torch.Tensor, config: CudaConfig) -> torch.Tensor:
    """silu(gate) * up (M, I) in bf16 for [gate | up] = x (M, K) @ weight (2I, K)^T, each product rounded to bf16
    first (as ``skinny_gemm.skinny_linear(..., glu_out=True)`` rounds)."""
    if config.split != 1:
        raise ValueError(f"glu_out takes one K split, got {config}")
    name = _kernel_for("glu", x, weight, config)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
    _launch(name, (n // (COLUMNS * config.nw), 1), x, weight, out, m, n, k)
    return out


def glu_out_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``glu_out``'s torch reference: the float32 product rounded to bf16, then silu(gate) * up in float32, rounded.
    The kernel sums in another order, so a gate or up value can round one bf16 step away from this one, which moves
    its output by up to two steps (``glu_out_matches``)."""
    gate, up = F.linear(x.float(), weight.float()).to(x.dtype).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def glu_out_matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``glu_out``'s result got is ``glu_out_ref``'s want up to the rounding the kernel's sum order allows:
    each element within two bf16 steps of the larger of the two (plus 1e-3 near zero), and at least 98 % equal."""
    if got.shape != want.shape:
        return False
    a, b = got.float(), want.float()
    # a bf16 step at |v| in [2^e, 2^(e+1)) is 2^(e-7): 8 significant bits
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp(min=2**-126))) - 7)
    return bool(((a - b).abs() <= 2 * step + 1e-3).all()) and (got == want).float().mean().item() >= 0.98


def _kernel_for(kind: str, x: torch.Tensor, weight: torch.Tensor, config: CudaConfig) -> str:
    """The kernel that covers x (M, K) @ weight (N, K)^T exactly under config; ValueError saying what fits
    otherwise."""
    (m, k), (n, weight_k) = x.shape, weight.shape
    tile = tile_rows(m) if m >= 1 else None
    name = _KERNELS.get((kind, config.kb, tile or 0, config.nw))
    per_split = WARPS // config.nw * 32 * config.kb
    if name is None or n % (COLUMNS * config.nw) or k != weight_k or k != config.split * per_split:
        raise ValueError(f"cuda_skinny takes M in [1, {MAX_ROWS}], N a multiple of {COLUMNS} * nw, K = split * "
                         f"{WARPS} / nw * 32 * kb (x's and the weight's) and a kernel for (kind, kb, tile rows, nw) "
                         f"among {sorted(_KERNELS)}; got {kind} x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                         f"with {config}")  # fmt: skip
    return name


_BUILT: dict[int, dict[str, Any] | None] = {}  # device index -> its compiled kernels by name (None: not available)


def _table_kernels(device_index: int) -> set[str]:
    """The kernels the device's entries (``device_table``) launch."""
    table = device_table(_device_name(device_index))
    return {_KERNELS[(kind, cfg.kb, tile, cfg.nw)] for (kind, _, _, tile), cfg in table.items()}


def _kernel(device_index: int, name: str) -> Any | None:
    """Kernel ``name`` of SOURCE compiled for a device (``compiled_kernel``): a device's first use compiles every
    kernel its entries (``device_table``) launch, so a later capture of any listed shape finds its kernel; other
    kernels (a benchmark's variants) compile when first asked for."""
    return compiled_kernel(_BUILT, device_index, name, SOURCE, lambda: _table_kernels(device_index),
                           lambda n: shared_bytes(*_SHAPES[n]), "cuda_skinny")  # fmt: skip


def compiled_kernel(
    built: dict[int, dict[str, Any] | None],
    device_index: int,
    name: str,
    source: str,
    first_use: Callable[[], set[str]],
    shared: Callable[[str], int],
    module: str,
) -> Any | None:
    """Kernel ``name`` of ``source`` compiled for a device (sm_90+: griddepcontrol), cached in ``built``, or None
    where the kernels cannot be made (older GPU, no NVRTC in this torch, a compile error: warned once, and the
    device keeps the Triton path) or where it is first asked for inside a CUDA-graph capture (loading a module
    while a stream captures is not allowed: that capture keeps the Triton path). A device's first use also compiles
    ``first_use()``'s kernels; ``shared(name)`` is a kernel's dynamic shared memory (past 48 KiB it is allowed
    once, at compile time); ``module`` names the caller in the warning."""
    kernels = built.get(device_index, {})
    if kernels is not None and name not in kernels:
        if torch.cuda.is_current_stream_capturing():
            return None
        wanted = {name} | (set() if device_index in built else first_use())
        kernels = built[device_index] = _build(device_index, wanted, kernels, source, shared, module)
    return None if kernels is None else kernels[name]


def _build(
    device_index: int,
    names: set[str],
    kernels: dict[str, Any],
    source: str,
    shared: Callable[[str], int],
    module: str,
) -> dict[str, Any] | None:
    """kernels with ``names`` of ``source`` compiled for the device added, or None (warned) where they cannot be
    made."""
    if torch.cuda.get_device_capability(device_index)[0] < 9 or not hasattr(torch.cuda, "_compile_kernel"):
        return None
    made = dict(kernels)
    try:
        _libcuda()  # the launch needs cuLaunchKernelEx (CUDA 12+ drivers)
        with torch.cuda.device(device_index):
            for name in sorted(names - made.keys()):
                made[name] = torch.cuda._compile_kernel(source, name)
                dynamic = shared(name)
                if dynamic > 48 << 10:  # past 48 KiB a launch must be allowed its dynamic shared memory
                    result = _libcuda().cuFuncSetAttribute(made[name].func, _MAX_DYNAMIC_SHARED, dynamic)
                    _check(result, f"cuFuncSetAttribute of {name}")
    except Exception as e:  # the Triton path stays: same results up to rounding
        warnings.warn(f"{module}: NVRTC could not build the kernels ({type(e).__name__}: {e}); those few-row "
                      "projections stay on the Triton kernels", RuntimeWarning, stacklevel=3)  # fmt: skip
        return None
    return made


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization", ctypes.c_int),
                ("cluster_dim", _Dim3)]  # fmt: skip


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttr)),
        ("num_attrs", ctypes.c_uint),
    ]


_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PDL_ATTR = ctypes.pointer(_LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION))  # made once: every launch passes it
_PDL_ATTR.contents.value.programmatic_stream_serialization = 1


@functools.cache
def _libcuda() -> ctypes.CDLL:
    """The CUDA driver library (cuLaunchKernelEx: a launch with attributes, which torch's wrapper does not take)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuFuncSetAttribute.restype = ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    """RuntimeError naming the driver call unless it returned CUDA_SUCCESS (0)."""
    if result:
        raise RuntimeError(f"cuda_skinny: {what} failed with CUresult {result}")


def _launch(name: str, grid: tuple[int, int], x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *ints: int) -> None:
    """Launch kernel ``name`` on the current stream, 256 threads a block with its tiles' dynamic shared memory
    (``shared_bytes``), under programmatic dependent launch when ``fused_ops.use_pdl`` says so (the kernel's
    griddepcontrol instructions are no-ops otherwise)."""
    kernel = _kernel(x.device.index or 0, name)
    if kernel is None:
        raise RuntimeError(f"cuda_skinny kernel {name} is not available on this device (see cuda_config)")
    launch(kernel, name, grid, shared_bytes(*_SHAPES[name]), (x, w, out), ints)


def launch(kernel: Any, name: str, grid: tuple[int, int], shared: int, tensors: tuple[torch.Tensor, ...],
           ints: tuple[int, ...], cluster: int = 1) -> None:  # fmt: skip
    """Launch a compiled kernel (``torch.cuda._compile_kernel``'s) on the current stream with ``cuLaunchKernelEx``:
    its arguments the tensors' pointers, then the ints (as C ints), 256 threads a block, ``shared`` bytes of
    dynamic shared memory, under programmatic dependent launch when ``fused_ops.use_pdl`` says so; cluster > 1
    groups that many consecutive blocks along x into a cluster (grid[0] a multiple of it;
    ``benchmarks/probe_cluster_skinny.py``'s kernels)."""
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
    values = [ctypes.c_int(v) for v in ints]
    params = (ctypes.c_void_p * (len(ptrs) + len(values)))(
        *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in (*ptrs, *values)]
    )
    device = tensors[0].device
    attrs, num_attrs = _PDL_ATTR, 1 if use_pdl(device) else 0
    if cluster > 1:  # the PDL attribute (when taken), then the cluster's
        clustered = (_LaunchAttr * 2)(*([_PDL_ATTR.contents] if num_attrs else []), _LaunchAttr(id=_CLUSTER_DIMENSION))
        clustered[num_attrs].value.cluster_dim = _Dim3(cluster, 1, 1)
        attrs, num_attrs = ctypes.cast(clustered, ctypes.POINTER(_LaunchAttr)), num_attrs + 1
    config = _LaunchConfig(
        (grid[0], grid[1], 1), (WARPS * 32, 1, 1), shared,
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), attrs, num_attrs,
    )  # fmt: skip
    _check(_libcuda().cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None),
           f"cuLaunchKernelEx of {name}")  # fmt: skip

// Hand-written skinny GEMMs for benchmarks/probe_cuda_skinny.py (a probe, not part of the engine): y (M <= 16, N)
// = x (M, K) @ W (N, K)^T on mma.sync, each thread's whole share of the weight loaded into registers before
// griddepcontrol.wait, so under programmatic dependent launch a block's entire weight read overlaps the kernel
// before it and only x is read after the wait.
//
// Layout. A block is 8 warps and 32 output columns (four n8 tiles); warp w takes its own K range and the block sums
// the warps' partial tiles through shared memory. Grid (N / 32, S): split s takes the s-th 8-warp K range, and with
// S > 1 the block writes float32 partials (S, M, N) for a consumer to sum; with S == 1 it writes y in bf16.
//
// The k permutation. A dot product does not care which k goes to which MMA slot as long as x and W agree, so each
// thread loads 16 contiguous bytes of a W row and of the x rows g and g + 8 (g = lane / 4, t = lane % 4) at
// k = base + t * (16 bytes) and feeds their 32-bit words to the slots the MMA fragment gives that thread: 64 bytes
// of a row per 4 threads in one coalesced instruction, no shared memory and no shuffles.
//   bf16 (m16n8k16): words .x/.y (k = 8t + 0..3) make one MMA, .z/.w (8t + 4..7) the next.
//   e4m3 (m16n8k32): words .x/.y (16t + 0..7) make one MMA, .z/.w (16t + 8..15) the next; each 128-deep K step is
//   accumulated on its own and scaled by x_scale[row, kb] * w_scale[n / 128, kb] (128 x 128 weight blocks,
//   (token, 128) activation groups) before it joins the accumulator.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint4 ldg_w(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int KB>
__global__ void __launch_bounds__(256, 1)
    skinny16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, void* __restrict__ y, int M,
             int N, int K, int pdl) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 32;
  const int k0 = (blockIdx.y * 8 + warp) * KB * 32;
  uint4 wr[4][KB];
#pragma unroll
  for (int b = 0; b < KB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j) wr[j][b] = ldg_w(w + (size_t)(n0 + 8 * j + g) * K + k0 + 32 * b + 8 * t);
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  uint4 xr[2][KB];
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int b = 0; b < KB; ++b) {
    xr[0][b] = g < M ? *(const uint4*)(x + (size_t)g * K + k0 + 32 * b + 8 * t) : zero;
    xr[1][b] = g + 8 < M ? *(const uint4*)(x + (size_t)(g + 8) * K + k0 + 32 * b + 8 * t) : zero;
  }
  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
#pragma unroll
  for (int b = 0; b < KB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mma(acc[j], xr[0][b].x, xr[1][b].x, xr[0][b].y, xr[1][b].y, wr[j][b].x, wr[j][b].y);
      mma(acc[j], xr[0][b].z, xr[1][b].z, xr[0][b].w, xr[1][b].w, wr[j][b].z, wr[j][b].w);
    }
  __shared__ float red[8][16][33];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    red[warp][g][8 * j + 2 * t] = acc[j][0];
    red[warp][g][8 * j + 2 * t + 1] = acc[j][1];
    red[warp][g + 8][8 * j + 2 * t] = acc[j][2];
    red[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  const int row = threadIdx.x >> 4, col = (threadIdx.x & 15) * 2;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    s0 += red[v][row][col];
    s1 += red[v][row][col + 1];
  }
  if (row < M) {
    if (gridDim.y == 1) {
      __nv_bfloat162 o = __floats2bfloat162_rn(s0, s1);
      *(__nv_bfloat162*)((__nv_bfloat16*)y + (size_t)row * N + n0 + col) = o;
    } else {
      float* p = (float*)y + ((size_t)blockIdx.y * M + row) * N + n0 + col;
      *(float2*)p = make_float2(s0, s1);
    }
  }
}

extern "C" int launch_skinny16(const void* x, const void* w, void* y, int M, int N, int K, int split, int kb,
                               int pdl, void* stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(N / 32, split);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const __nv_bfloat16* xx = (const __nv_bfloat16*)x;
  const __nv_bfloat16* ww = (const __nv_bfloat16*)w;
  cudaError_t e;
  if (kb == 1) e = cudaLaunchKernelEx(&cfg, skinny16<1>, xx, ww, y, M, N, K, pdl);
  else if (kb == 2) e = cudaLaunchKernelEx(&cfg, skinny16<2>, xx, ww, y, M, N, K, pdl);
  else if (kb == 4) e = cudaLaunchKernelEx(&cfg, skinny16<4>, xx, ww, y, M, N, K, pdl);
  else if (kb == 8) e = cudaLaunchKernelEx(&cfg, skinny16<8>, xx, ww, y, M, N, K, pdl);
  else return -1;
  return (int)e;
}

__device__ __forceinline__ void mma8(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                     uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int P>
__global__ void __launch_bounds__(256)
    fp8_skinny16(const uint8_t* __restrict__ x, const float* __restrict__ xs, const uint8_t* __restrict__ w,
                 const float* __restrict__ ws, void* __restrict__ y, int M, int N, int K, int ws_stride, int pdl) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 32;
  const int k0 = (blockIdx.y * 8 + warp) * P * 128;
  const int kgroups = K / 128;
  uint4 wr[P][2][4];
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wr[p][h][j] = ldg_w(w + (size_t)(n0 + 8 * j + g) * K + k0 + 128 * p + 64 * h + 16 * t);
  float wsc[P];
#pragma unroll
  for (int p = 0; p < P; ++p) wsc[p] = ws[(n0 / 128) * ws_stride + k0 / 128 + p];
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 xr[P][2][2];
  float sx[P][2];
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      xr[p][h][0] = g < M ? *(const uint4*)(x + (size_t)g * K + k0 + 128 * p + 64 * h + 16 * t) : zero;
      xr[p][h][1] = g + 8 < M ? *(const uint4*)(x + (size_t)(g + 8) * K + k0 + 128 * p + 64 * h + 16 * t) : zero;
    }
    sx[p][0] = g < M ? xs[g * kgroups + k0 / 128 + p] : 0.f;
    sx[p][1] = g + 8 < M ? xs[(g + 8) * kgroups + k0 / 128 + p] : 0.f;
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
        mma8(c, a.x, b.x, a.y, b.y, v.x, v.y);
        mma8(c, a.z, b.z, a.w, b.w, v.z, v.w);
      }
      acc[j][0] += c[0] * s0;
      acc[j][1] += c[1] * s0;
      acc[j][2] += c[2] * s1;
      acc[j][3] += c[3] * s1;
    }
  }
  __shared__ float red[8][16][33];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    red[warp][g][8 * j + 2 * t] = acc[j][0];
    red[warp][g][8 * j + 2 * t + 1] = acc[j][1];
    red[warp][g + 8][8 * j + 2 * t] = acc[j][2];
    red[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  const int row = threadIdx.x >> 4, col = (threadIdx.x & 15) * 2;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    s0 += red[v][row][col];
    s1 += red[v][row][col + 1];
  }
  if (row < M) {
    if (gridDim.y == 1) {
      *(__nv_bfloat162*)((__nv_bfloat16*)y + (size_t)row * N + n0 + col) = __floats2bfloat162_rn(s0, s1);
    } else {
      *(float2*)((float*)y + ((size_t)blockIdx.y * M + row) * N + n0 + col) = make_float2(s0, s1);
    }
  }
}

extern "C" int launch_fp8_skinny16(const void* x, const void* xs, const void* w, const void* ws, void* y, int M,
                                   int N, int K, int ws_stride, int split, int p, int pdl, void* stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(N / 32, split);
  cfg.blockDim = dim3(256);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const uint8_t* xx = (const uint8_t*)x;
  const uint8_t* ww = (const uint8_t*)w;
  const float* xsf = (const float*)xs;
  const float* wsf = (const float*)ws;
  cudaError_t e;
  if (p == 1) e = cudaLaunchKernelEx(&cfg, fp8_skinny16<1>, xx, xsf, ww, wsf, y, M, N, K, ws_stride, pdl);
  else if (p == 2) e = cudaLaunchKernelEx(&cfg, fp8_skinny16<2>, xx, xsf, ww, wsf, y, M, N, K, ws_stride, pdl);
  else if (p == 4) e = cudaLaunchKernelEx(&cfg, fp8_skinny16<4>, xx, xsf, ww, wsf, y, M, N, K, ws_stride, pdl);
  else return -1;
  return (int)e;
}

"""Probe (sm_90): the few-row CUDA tile kernels at 33-64 rows with x staged in shared memory, once a cluster.

    PYTHONPATH=$PWD python3 benchmarks/probe_cluster_skinny.py [--rows 64,48] [--clusters 1,2,4]

``cuda_skinny``'s tile kernels (four m16 tiles of x at 33-64 rows) load each tile's x fragments from L2 after the
programmatic-dependent-launch wait, one tile after another (the PTX issues a tile's loads only after the previous
tile's products), and every block reads its K range of all M rows, at 64 rows twice the weight's bytes with 32
weight rows a block. The variants here stage the block's x slice in shared memory with ``cp.async`` (every load in
flight at once, one wait), and in a cluster of CL blocks along N (the same K range, so the same x slice) each block
stages only MT / CL of the tiles and reads the others from its peers' shared memory (``ld.shared::cluster``): x read
from L2 once a cluster. CL = 1 is the staging alone. Every variant is checked against the float32 product (partials:
sum within 1e-4; gate/up: ``cuda_skinny.glu_out_matches``), then timed as a chain (one launch per weight copy past
L2, one CUDA graph, best of five; ``probe_cuda_skinny.chain_us``) beside cuBLAS, the shipped path and the shipped tile
kernel of the same launch shape. The kernels are built from ``cuda_skinny.DEVICE_SOURCE``'s pieces (the weight
share, a tile's products, the sums and their store), as the tile kernels are.

Measured 2026-12-07 on an H100 (BENCHMARKS.md, "Thirty-fifth session"): every variant passed its check, none beat the
shipped path or cuBLAS, and every cluster was slower than the same shape staged alone (1.03-1.32x at CL 2,
1.34-2.87x at CL 4), so reading x from L2 is not what holds the tile kernels back at 64 rows. (That call ran the same
algorithm written inline rather than from ``DEVICE_SOURCE``'s pieces; its machine code differs from this file's, whose
kernels have not been timed.)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_cuda_skinny import SHAPES, result_error  # Qwen3-0.6B products; the kernels' result check
from benchmarks.probe_cuda_skinny import chain_us  # CUDA-graph chains, best of five rounds
from fnvllm.kernels import cuda_skinny, skinny_gemm
from fnvllm.kernels.fused_ops import silu_and_mul

BODY = r"""
__device__ __forceinline__ u32 smem_addr(const void* p) {  // a shared-memory pointer's 32-bit window address
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ u32 map_rank(u32 local, u32 rank) {  // the same offset in block `rank`'s shared memory
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ uint4 ld_cluster(u32 addr) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_local(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// cuda_skinny's skinny_mma with x staged: block rank r of a cluster of CL stages x tiles r, r + CL, ... of its K range
// ([OWN * 16][XS] bf16 after the sums), and each m16 tile's fragments come from its owner's shared memory
template <int KB, bool GLU, int MT, int NW, int CL>
__device__ __forceinline__ void skinny_staged(const unsigned short* __restrict__ x,
                                              const unsigned short* __restrict__ w, void* __restrict__ y, int M, int N,
                                              int K) {
  constexpr int KW = 8 / NW;
  constexpr int KR = KW * KB * 32;  // the block's K columns
  constexpr int XS = KR + 32;       // a staged row, padded by 64 bytes: rows g, g + 1 on disjoint banks
  constexpr int OWN = MT / CL;      // m16 tiles of x this block stages: rank, rank + CL, ...
  constexpr int COLS = 32 * NW + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kw = NW == 1 ? warp : warp % KW, nw = NW == 1 ? 0 : warp / KW;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = GLU ? (blockIdx.x * NW + nw) * 16 : (blockIdx.x * NW + nw) * 32;
  const int kblock = blockIdx.y * KR, kwarp = kw * KB * 32;
  uint4 wr[4][KB];
  load_weights<KB, GLU>(wr, w, n0, N, K, kblock + kwarp, g, t);
  extern __shared__ float dyn[];
  float(*red)[KW][16][COLS] = (float(*)[KW][16][COLS])dyn;
  unsigned short* xs = (unsigned short*)(dyn + MT * KW * 16 * COLS);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  const u32 rank = CL > 1 ? cluster_rank() : 0;
  constexpr int CHUNKS = KR / 8;  // 16-byte pieces of a staged row
#pragma unroll
  for (int i = threadIdx.x; i < OWN * 16 * CHUNKS; i += 256) {
    const int c = i % CHUNKS, r = i / CHUNKS;
    const int m = (rank + CL * (r / 16)) * 16 + r % 16;
    const bool ok = m < M;  // rows past M are zero-filled (source size 0)
    const unsigned short* src = x + (size_t)(ok ? m : 0) * K + kblock + 8 * c;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(xs + r * XS + 8 * c)), "l"(src),
                 "r"(ok ? 16 : 0));
  }
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
  if (CL > 1)
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  else
    __syncthreads();
  const u32 xs0 = smem_addr(xs);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (16 * mt >= M) break;
    const u32 owner = mt % CL;
    const u32 base = xs0 + 2 * ((mt / CL) * 16 * XS + kwarp + 8 * t);
    const u32 a0 = CL > 1 ? map_rank(base + 2 * g * XS, owner) : base + 2 * g * XS;
    const u32 a1 = CL > 1 ? map_rank(base + 2 * (g + 8) * XS, owner) : base + 2 * (g + 8) * XS;
    uint4 xr[2][KB];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      xr[0][b] = CL > 1 ? ld_cluster(a0 + 64 * b) : ld_local(a0 + 64 * b);
      xr[1][b] = CL > 1 ? ld_cluster(a1 + 64 * b) : ld_local(a1 + 64 * b);
    }
    float acc[4][4];
    tile_products<KB>(acc, xr, wr);
    stash_tile<COLS>(red[mt][kw], acc, nw, g, t);
  }
  if (CL > 1) asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");  // done reading peers
  __syncthreads();
  store_sums<GLU, MT, NW, KW, COLS>(red, y, M, N);
  if (CL > 1) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");  // peers done with my tiles
}
"""


MT = 4  # m16 tiles of x: the 33-64-row kernels

# the (kb, split, nw) launch shapes tried with each cluster size
CONFIGS = {"qkv": [(2, 2, 1), (1, 4, 1), (4, 1, 1), (2, 4, 2)], "o": [(1, 8, 1), (2, 4, 1), (2, 8, 2)],
           "gate_up": [(4, 1, 1)], "down": [(4, 3, 1), (2, 6, 1), (2, 12, 2)]}  # fmt: skip


def entry_point(kb: int, glu: bool, nw: int, cl: int) -> tuple[str, str]:
    """(name, source) of the extern "C" entry point of one staged kernel: kb 32-deep K blocks a warp, gate/up with
    SiLU-and-mul or float32 partials, nw warp groups along N, cl blocks a cluster."""
    name = f"skinny_staged_{'glu_' if glu else ''}kb{kb}_nw{nw}_cl{cl}"
    wrapper = (
        f'extern "C" __global__ void __launch_bounds__(256) {name}(const unsigned short* x, const unsigned short* w, '
        f"void* y, int M, int N, int K) {{ skinny_staged<{kb}, {'true' if glu else 'false'}, {MT}, {nw}, {cl}>"
        "(x, w, y, M, N, K); }\n"
    )
    return name, wrapper


def kernel_source(kb: int, glu: bool, nw: int, cl: int) -> tuple[str, str]:
    """(CUDA source, entry point name) of one staged kernel (``entry_point``)."""
    name, wrapper = entry_point(kb, glu, nw, cl)
    return cuda_skinny.DEVICE_SOURCE + BODY + wrapper, name


def shared_bytes(kb: int, nw: int, cl: int) -> int:
    """Dynamic shared memory of a launch: the (tile, K warp, 16, 32 * nw + 1) float32 sums, then the block's
    MT / cl staged tiles of 16 x rows, each row its K range plus 32 bf16 of padding."""
    kw = cuda_skinny.WARPS // nw
    sums = MT * kw * 16 * (cuda_skinny.COLUMNS * nw + 1) * 4
    return sums + (MT // cl) * 16 * (kw * kb * 32 + 32) * 2


_BUILT: dict[tuple[int, bool, int, int], tuple[Any, str]] = {}


def build(kb: int, glu: bool, nw: int, cl: int) -> tuple[Any, str]:
    """The staged kernel compiled by NVRTC (once a shape), with its dynamic shared memory allowed."""
    key = (kb, glu, nw, cl)
    if key not in _BUILT:
        source, name = kernel_source(*key)
        kernel = torch.cuda._compile_kernel(source, name)
        dynamic = shared_bytes(kb, nw, cl)
        if dynamic > 48 << 10:
            result = cuda_skinny._libcuda().cuFuncSetAttribute(kernel.func, cuda_skinny._MAX_DYNAMIC_SHARED, dynamic)
            cuda_skinny._check(result, f"cuFuncSetAttribute of {name}")
        _BUILT[key] = (kernel, name)
    return _BUILT[key]


def staged_product(kind: str, kb: int, split: int, nw: int, cl: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M <= 64, K) @ w (N, K)^T by the staged kernel: float32 split partials (split, M, N), or for "glu"
    silu(gate) * up (M, N / 2) in bf16; launched by ``cuda_skinny.launch`` (programmatic dependent launch as the
    engine's kernels take it) with, for cl > 1, clusters of cl blocks along N (N / (32 * nw) a multiple of cl)."""
    kernel, name = build(kb, kind == "glu", nw, cl)
    (m, k), n = x.shape, w.shape[0]
    shape, dtype = ((m, n // 2), x.dtype) if kind == "glu" else ((split, m, n), torch.float32)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    grid = (n // (cuda_skinny.COLUMNS * nw), split)
    cuda_skinny.launch(kernel, name, grid, shared_bytes(kb, nw, cl), (x, w, out), (m, n, k), cluster=cl)
    return out


def _timed(
    label: str, product: Callable[[torch.Tensor], object], weights: list[torch.Tensor], reps: int
) -> tuple[str, float]:
    return label, chain_us([functools.partial(product, w) for w in weights], reps)


def product_rows(
    name: str, m: int, weights: list[torch.Tensor], clusters: list[int], reps: int
) -> list[tuple[str, float]]:
    """(label, us per launch) of every path for one product at m rows; variants that fail their check are printed
    and left out."""
    kind, _, k = SHAPES[name]
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    if kind == "glu":
        rows = [_timed("cuBLAS + silu_and_mul", lambda w: silu_and_mul(F.linear(x, w)), weights, reps)]
    else:
        rows = [_timed("cuBLAS", lambda w: F.linear(x, w), weights, reps)]
        rows.append(_timed("linear_partials shipped", lambda w: skinny_gemm.linear_partials(x, w), weights, reps))
    tile = cuda_skinny.glu_out if kind == "glu" else cuda_skinny.skinny_partials
    for kb, split, nw in CONFIGS[name]:
        config = cuda_skinny.CudaConfig(kb, split, nw)
        variants: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = []
        if (kind, kb, MT * 16, nw) in cuda_skinny._KERNELS:
            variants.append((f"tile kernel kb{kb} S{split} nw{nw}", lambda w, c=config: tile(x, w, c)))
        for cl in clusters:
            if (weights[0].shape[0] // (cuda_skinny.COLUMNS * nw)) % cl == 0:
                staged = functools.partial(staged_product, kind, kb, split, nw, cl, x)
                variants.append((f"staged kb{kb} S{split} nw{nw} CL{cl}", staged))
        for label, run in variants:
            problem = result_error(kind, x, weights[0], run(weights[0]))
            if problem is None:
                rows.append(_timed(label, run, weights, reps))
            else:
                print(f"   {label} FAILED the check, not timed: {problem}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,48", help="comma-separated row counts, each 33-64 (default 64,48)")
    parser.add_argument("--products", default="qkv,o,gate_up,down", help=f"among {', '.join(SHAPES)}")
    parser.add_argument("--clusters", default="1,2,4", help="cluster sizes (1: staging alone; default 1,2,4)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays a timed round (default 20)")
    args = parser.parse_args()
    rows, clusters = [int(r) for r in args.rows.split(",")], [int(c) for c in args.clusters.split(",")]
    if not all(33 <= r <= 64 for r in rows) or not all(c in (1, 2, 4) for c in clusters):
        parser.error(f"--rows must each be 33-64 and --clusters among 1, 2, 4; got {args.rows} / {args.clusters}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("probe_cluster_skinny.py needs a CUDA GPU of sm_90 or later (clusters, griddepcontrol, NVRTC)")
    start = time.time()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    for name in args.products.split(","):
        _, n, k = SHAPES[name]
        copies = max(2, (512 << 20) // (2 * n * k))  # past L2
        weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
        for m in rows:
            timed = product_rows(name, m, weights, clusters, args.reps)
            mbytes = 2 * n * k / 1e6
            print(f"== {name} N={n} K={k} M={m} ({mbytes:.1f} MB of weights)", flush=True)
            for label, us in sorted(timed, key=lambda row: row[1]):
                print(f"   {us:7.2f} us  {mbytes / us:5.2f} TB/s  {label}", flush=True)
    print(f"done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

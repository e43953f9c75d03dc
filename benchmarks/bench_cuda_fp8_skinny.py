"""The CUDA few-row FP8 projections (``fnvllm.kernels.cuda_fp8_skinny``) against the Triton path they replace, at
Qwen3-8B's shapes (issue 20's small-M GEMM).

    PYTHONPATH=$PWD python3 benchmarks/bench_cuda_fp8_skinny.py [--rows 1,4,8,16] [--gemms o,qkv,gate_up] [--reps 20]

For each projection whose K the kernels cover (K = 1024 p: o, qkv, gate_up; not down, K = 12288) and each row
count: the CUDA kernel is first checked against ``fp8_gemm.fp8_blockwise_ref`` (relative error < 1e-2) and, at
rows <= 8, its in-kernel quantization against the quantization launch (equal bits); then each path is timed as a
chain in one CUDA graph, one call per weight copy (copies past L2), best of five replays, us per call (TB/s of
e4m3 weight bytes):
  triton          ``fp8_linear`` with the CUDA kernels off: quantization + ``fp8_gemm_swap`` (+ its split sum);
  cuda            ``fp8_linear`` as shipped for a listed weight (an unlisted one: quantization + this kernel);
  cuda quant      this kernel quantizing its bf16 activations itself (rows <= 8), one launch;
  triton ready    ``fp8_gemm.fp8_linear_prepared`` (ready fp8 activations) with the CUDA kernels off;
  cuda ready      this kernel from ready fp8 activations.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchmarks.probe_cuda_skinny import chain_us
from fnvllm.kernels import cuda_fp8_skinny as c
from fnvllm.kernels import cuda_skinny
from fnvllm.kernels import fp8_gemm as g
from fnvllm.kernels.fused_ops import Fp8Activations
from fnvllm.model.quant import quantize_fp8_blocks

GEMMS = {"o": (4096, 4096), "qkv": (6144, 4096), "gate_up": (24576, 4096)}  # name: (N, K)
WEIGHT_BYTES = 256 << 20  # the weight copies a chain cycles through (well past the 50 MB L2)
READ_TBPS = 4.16  # the H200's read ceiling (../shared/GPU.md), for the floor column


@contextmanager
def cuda_kernels(on: bool) -> Iterator[None]:
    """cuda_skinny.ENABLED (which this module's dispatch reads at each call) set to on inside the block."""
    before = cuda_skinny.ENABLED
    cuda_skinny.ENABLED = on
    try:
        yield
    finally:
        cuda_skinny.ENABLED = before


def weight_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(e4m3 weight, block scales) copies of one random N(0, 1/K) weight, WEIGHT_BYTES in all."""
    w, scale = quantize_fp8_blocks(torch.randn(n, k, device="cuda") / k**0.5)
    return [(w.clone(), scale.clone()) for _ in range(max(2, WEIGHT_BYTES // (n * k)))]


def check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, cfg: c.Fp8Config) -> str:
    """'' when the kernel matches the reference (and its in-kernel quantization the launch), else what failed."""
    x_q, x_scale = g.quantize_activations(x)
    out = c.fp8_skinny(x_q, w, scale, cfg, x_scale=x_scale)
    ref = g.fp8_blockwise_ref(x_q, x_scale, w, scale, torch.float32)
    err = float((out.float() - ref).norm() / ref.norm())
    if err >= 1e-2:
        return f"relative error {err:.2e}"
    if x.shape[0] <= c.QUANT_MAX_ROWS and not torch.equal(c.fp8_skinny(x, w, scale, cfg), out):
        return "in-kernel quantization differs from the launch"
    return ""


def paths(x: torch.Tensor, cfg: c.Fp8Config) -> dict[str, tuple[bool, Callable[..., torch.Tensor]]]:
    """label -> (CUDA kernels on, call(w, scale)) for x's rows."""
    ready = Fp8Activations(*g.quantize_activations(x), torch.bfloat16)
    out: dict[str, tuple[bool, Callable[..., torch.Tensor]]] = {
        "triton": (False, lambda w, s: g.fp8_linear(x, w, s)),
        "cuda": (True, lambda w, s: g._cuda_fp8_linear(x, w, s, cfg)),
        "triton ready": (False, lambda w, s: g.fp8_linear_prepared(ready, w, s)),
        "cuda ready": (True, lambda w, s: c.fp8_skinny(ready.x_q, w, s, cfg, x_scale=ready.x_scale)),
    }
    if x.shape[0] <= c.QUANT_MAX_ROWS:
        out["cuda quant"] = (True, lambda w, s: c.fp8_skinny(x, w, s, cfg))
    return out


def bench(name: str, rows: list[int], reps: int) -> None:
    """Check, then time every path of one projection at each row count, printing a table."""
    n, k = GEMMS[name]
    if k % c.PER_GROUP_DEPTH or k // c.PER_GROUP_DEPTH not in c.PS:
        print(f"== {name}: K {k} is not 1024 p for p in {c.PS}; skipped")
        return
    cfg = c.FP8_CONFIGS.get((n, k), c.Fp8Config(k // c.PER_GROUP_DEPTH))
    copies = weight_copies(n, k)
    mbytes = (n * k + 4 * (n // 128) * (k // 128)) / 1e6
    print(f"== {name} {n} x {k}, {cfg} ({mbytes:.1f} MB of e4m3 weight, floor {mbytes / READ_TBPS:.2f} us)")
    for m in rows:
        x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
        problem = check(x, *copies[0], cfg)
        if problem:
            print(f"   M={m:2}: check failed ({problem}); not timed")
            continue
        cells = []
        for label, (on, call) in paths(x, cfg).items():
            with cuda_kernels(on):
                us = chain_us([lambda w=w, s=s, call=call: call(w, s) for w, s in copies], reps)
            cells.append(f"{label} {us:6.2f} ({mbytes / us:4.2f})")
        print(f"   M={m:2}: " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16", help="row counts M, comma-separated (1-16)")
    parser.add_argument("--gemms", default="o,qkv,gate_up", help=f"projections among {', '.join(GEMMS)}")
    parser.add_argument("--reps", type=int, default=20, help="graph replays a timed round")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda_fp8_skinny.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"GPU: {torch.cuda.get_device_name()}")
    for name in args.gemms.split(","):
        bench(name, [int(r) for r in args.rows.split(",")], args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

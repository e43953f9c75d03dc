"""Host time of launching bf16 GEMMs on the GPU for a new M each call vs a repeated M (does cuBLAS's per-shape
setup show up on the host?). Prints mean host microseconds per launch for both.

    PYTHONPATH=$PWD python3 benchmarks/gemm_shapes.py
"""

from __future__ import annotations

import argparse
import time

import torch


def host_us(ms: list[int], weight: torch.Tensor) -> float:
    """Mean host time of ``x @ weight.T`` launches, one per M in ``ms`` (the device runs them meanwhile)."""
    xs = [torch.randn(m, weight.shape[1], device="cuda", dtype=torch.bfloat16) for m in ms]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x in xs:
        torch.nn.functional.linear(x, weight)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / len(ms) * 1e6


def main() -> None:
    """Print host microseconds per launch for repeated, new and rounded M (needs a CUDA GPU)."""
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py times cuBLAS launches: it needs a CUDA GPU")
    weight = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16)  # Qwen3-0.6B gate/up-like
    host_us([16384] * 8, weight)  # warm-up
    print(f"repeated M=16384: {host_us([16384] * 64, weight):.1f} us/launch")
    print(f"new M each call:  {host_us([16000 + 3 * i for i in range(64)], weight):.1f} us/launch")
    print(f"repeated again:   {host_us([16384] * 64, weight):.1f} us/launch")
    print(f"M rounded to 256: {host_us([(16000 + 3 * i + 255) // 256 * 256 for i in range(64)], weight):.1f} us/launch")


if __name__ == "__main__":
    main()

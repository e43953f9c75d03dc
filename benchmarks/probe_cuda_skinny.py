"""Probe (H200): is the few-row decode GEMM bound by Triton's code or by the launch chain?

    PYTHONPATH=$PWD python3 benchmarks/probe_cuda_skinny.py [--kinds bf16,fp8] [--reps 20]

Hand-written CUDA skinny GEMMs (``probe_cuda_skinny.cu``, built with nvcc for sm_90a; mma.sync, each thread's
whole share of the weight loaded into registers before the programmatic-dependent-launch wait) against the shipped
Triton kernels, at 16 rows:

- ``bf16``: the Qwen3-0.6B projections (qkv, gate/up, o, down) against cuBLAS, ``skinny_gemm.linear`` and
  ``skinny_gemm.linear_partials``; ours with kb 32-deep K blocks a warp and S K splits (S > 1: float32 partials
  left unsummed, as ``linear_partials`` leaves them), launched with and without PDL.
- ``fp8``: the Qwen3-8B projections with block-quantized e4m3 weights and activations quantized per (token, 128)
  against ``fp8_gemm.fp8_gemm_swap`` (summed) and ``fp8_gemm_swap_partials`` with the ready-activation config;
  ours with P 128-deep K steps a warp, alone and followed by the split sum.

Every product is first checked against a float32 reference. Times are us per launch in a CUDA graph of one launch
per weight copy (copies past L2), best of five replays of the graph, weight TB/s = weight bytes / time. Measured
2026-12-04 (BENCHMARKS.md, "Eighteenth session"): as written here (``__launch_bounds__(256, 1)``, 58-255 registers
a thread) no faster than the shipped kernels; the bf16 kernels with fewer registers beat them and ship as
``fnvllm/kernels/cuda_skinny.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_suffix(".cu")
BF16_SHAPES = {"qkv": (4096, 1024), "gate_up": (6144, 1024), "o": (1024, 2048), "down": (1024, 3072)}
BF16_VARIANTS = {"qkv": [(4, 1), (2, 2), (1, 4)], "gate_up": [(4, 1), (2, 2)], "o": [(4, 2), (2, 4), (1, 8)],
                 "down": [(4, 3), (2, 6), (1, 12)]}  # fmt: skip
FP8_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
READ_TBPS = 4.16  # the H200's pure read ceiling (GPU.md)


def build(folder: Path) -> ctypes.CDLL:
    """Compile probe_cuda_skinny.cu into a shared library and load it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("probe_cuda_skinny.py needs nvcc on PATH")
    lib = folder / "probe_cuda_skinny.so"
    cmd = [nvcc, "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib), str(SOURCE)]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _output(m: int, n: int, split: int) -> torch.Tensor:
    """bf16 (M, N) for one split, float32 partials (S, M, N) for more."""
    if split == 1:
        return torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    return torch.empty((split, m, n), dtype=torch.float32, device="cuda")


def bf16_product(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, kb: int, split: int, pdl: bool) -> torch.Tensor:
    """Ours, bf16: x (M, K) @ w (N, K)^T with kb 32-deep blocks a warp and split K splits."""
    (m, k), n = x.shape, w.shape[0]
    out = _output(m, n, split)
    err = lib.launch_skinny16(_ptr(x), _ptr(w), _ptr(out), m, n, k, split, kb, int(pdl), _stream())
    if err:
        raise RuntimeError(f"launch_skinny16 failed with CUDA error {err}")
    return out


def fp8_product(
    lib: ctypes.CDLL, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, p: int, summed: bool
) -> torch.Tensor:
    """Ours, e4m3: dequantized x (M, K) @ dequantized w (N, K)^T with p 128-deep steps a warp (K / (1024 p) splits),
    the split partials summed by the shipped sum kernel when summed."""
    from fnvllm.kernels.fp8_gemm import _sum_splits

    (m, k), n = xq.shape, w.shape[0]
    split = k // (1024 * p)
    out = _output(m, n, split)
    err = lib.launch_fp8_skinny16(
        _ptr(xq), _ptr(xs), _ptr(w), _ptr(ws), _ptr(out), m, n, k, ws.stride(0), split, p, 1, _stream()
    )
    if err:
        raise RuntimeError(f"launch_fp8_skinny16 failed with CUDA error {err}")
    if summed and split > 1:
        y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        _sum_splits(out, y)
        return y
    return out


def as_product(out: torch.Tensor) -> torch.Tensor:
    """A float32 (M, N) product from a bf16 output or unsummed float32 partials."""
    return out.float() if out.dim() == 2 else out.sum(0)


def check(label: str, got: torch.Tensor, exact: torch.Tensor) -> None:
    """Raise unless got is within bf16 output rounding of the float32 reference."""
    err = (as_product(got) - exact).abs().max().item()
    if err > 6e-3 * exact.abs().max().item():  # bf16 output: half an ulp is up to 2**-8 of the value
        raise SystemExit(f"{label}: max error {err:.4g} against a largest value of {exact.abs().max().item():.4g}")


def chain_us(calls: list[Callable[[], object]], reps: int) -> float:
    """us per launch of the calls captured back to back in one CUDA graph, best of five timed rounds of reps."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    return best


def print_rows(title: str, mbytes: float, rows: list[tuple[str, float]]) -> None:
    print(f"== {title} ({mbytes:.1f} MB of weights, floor {mbytes / READ_TBPS:.2f} us at {READ_TBPS} TB/s)")
    for label, us in rows:
        print(f"   {us:7.2f} us  {mbytes / us:5.2f} TB/s  {label}")


def _bf16_rows(
    lib: ctypes.CDLL, x: torch.Tensor, weights: list[torch.Tensor], variants: list[tuple[int, int]], reps: int
) -> list[tuple[str, float]]:
    """(label, us per launch) of cuBLAS, the shipped skinny kernel (summed, partials) and ours over the weights."""
    from fnvllm.kernels import skinny_gemm

    rows = [
        ("cuBLAS", chain_us([lambda w=w: F.linear(x, w) for w in weights], reps)),
        ("shipped skinny_gemm.linear", chain_us([lambda w=w: skinny_gemm.linear(x, w) for w in weights], reps)),
        ("shipped linear_partials", chain_us([lambda w=w: skinny_gemm.linear_partials(x, w) for w in weights], reps)),
    ]
    for kb, split in variants:
        for pdl in (True, False):
            calls = [lambda w=w, kb=kb, s=split, p=pdl: bf16_product(lib, x, w, kb, s, p) for w in weights]
            rows.append((f"ours kb={kb} S={split}{'' if pdl else ' without PDL'}", chain_us(calls, reps)))
    return rows


def probe_bf16(lib: ctypes.CDLL, reps: int) -> None:
    """The Qwen3-0.6B projections at 16 rows: cuBLAS, the shipped skinny kernel, ours."""
    for name, (n, k) in BF16_SHAPES.items():
        copies = (512 << 20) // (2 * n * k)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(copies)]
        for m in (16, 5):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            exact = F.linear(x.float(), weights[1].float())
            for kb, split in BF16_VARIANTS[name]:
                check(f"bf16 {name} M={m} kb={kb} S={split}", bf16_product(lib, x, weights[1], kb, split, True), exact)
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        rows = _bf16_rows(lib, x, weights, BF16_VARIANTS[name], reps)
        print_rows(f"bf16 {name} N={n} K={k} M=16", 2 * n * k / 1e6, rows)


def fp8_weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random e4m3 weights with random 128 x 128 block scales."""
    return [
        (
            (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
            torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda") / 64 + 1e-3,
        )
        for _ in range(copies)
    ]


def fp8_reference(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The float32 product of the dequantized operands."""
    (m, k), n = xq.shape, w.shape[0]
    deq_w = (w.float().reshape(n // 128, 128, k // 128, 128) * ws[:, None, :, None]).reshape(n, k)
    deq_x = (xq.float().reshape(m, k // 128, 128) * xs[:, :, None]).reshape(m, k)
    return deq_x @ deq_w.T


def _fp8_rows(
    lib: ctypes.CDLL,
    xq: torch.Tensor,
    xs: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    ready: object,
    reps: int,
) -> list[tuple[str, float]]:
    """(label, us per launch) of the shipped swap kernel (summed, partials) and ours over the weights: the shipped
    rows first."""
    from fnvllm.kernels import fp8_gemm

    k = xq.shape[1]
    swap = [lambda w=w: fp8_gemm.fp8_gemm_swap(xq, xs, w[0], w[1], torch.bfloat16, ready) for w in weights]
    parts = [lambda w=w: fp8_gemm.fp8_gemm_swap_partials(xq, xs, w[0], w[1], ready) for w in weights]
    rows = [("shipped fp8_gemm_swap (summed)", chain_us(swap, reps)), ("shipped partials", chain_us(parts, reps))]
    for p in (1, 2, 4):
        for summed in (False, True) if k // (1024 * p) > 1 else (False,):
            calls = [lambda w=w, p=p, s=summed: fp8_product(lib, xq, xs, w[0], w[1], p, s) for w in weights]
            rows.append((f"ours P={p} S={k // (1024 * p)}{' + sum' if summed else ''}", chain_us(calls, reps)))
    return rows


def probe_fp8(lib: ctypes.CDLL, reps: int) -> None:
    """The Qwen3-8B projections at 16 tokens, FP8: the shipped swap kernel (summed, partials) and ours."""
    from fnvllm.kernels import fp8_gemm

    layer: dict[str, list[float]] = {}
    total_mb = 0.0
    for name, (n, k) in FP8_SHAPES.items():
        weights = fp8_weights(n, k, max(3, (768 << 20) // (n * k)))
        for m in (16, 5, 1):
            xq, xs = fp8_gemm.quantize_activations(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            w, ws = weights[1]
            for p in (1, 2, 4):
                got = fp8_product(lib, xq, xs, w, ws, p, summed=False)
                check(f"fp8 {name} M={m} P={p}", got, fp8_reference(xq, xs, w, ws))
        xq, xs = fp8_gemm.quantize_activations(torch.randn(16, k, device="cuda", dtype=torch.bfloat16))
        ready = fp8_gemm.pick_ready_swap_config(16, n, k, xq.device)
        rows = _fp8_rows(lib, xq, xs, weights, ready, reps)
        mbytes = n * k / 1e6
        total_mb += mbytes
        print_rows(f"fp8 {name} N={n} K={k} M=16, ready config {ready}", mbytes, rows)
        layer.setdefault("shipped, summed", []).append(rows[0][1])
        layer.setdefault("shipped, partials", []).append(rows[1][1])
        layer.setdefault("ours, the best variant", []).append(min(us for _, us in rows[2:]))
    for label, times in layer.items():
        print(f"layer, {label}: {sum(times):.2f} us = {total_mb / sum(times):.2f} TB/s of weight bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="bf16,fp8", help="comma-separated: bf16 (Qwen3-0.6B), fp8 (Qwen3-8B)")
    parser.add_argument("--reps", type=int, default=20, help="graph replays per timed round")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - {"bf16", "fp8"}:
        parser.error(f"--kinds takes bf16 and fp8, got {sorted(unknown)}")
    if not torch.cuda.is_available():
        raise SystemExit("probe_cuda_skinny.py needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("probe_cuda_skinny.py needs an sm_90 GPU (griddepcontrol, e4m3 mma.sync)")
    with tempfile.TemporaryDirectory() as folder:
        lib = build(Path(folder))
        if "bf16" in kinds:
            probe_bf16(lib, args.reps)
        if "fp8" in kinds:
            probe_fp8(lib, args.reps)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()

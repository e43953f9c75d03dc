"""Row-group FP8 weights and the row-wise GEMM at Qwen3-8B sizes on one GPU: correctness, then time per layer.

    PYTHONPATH=$PWD python3 benchmarks/bench_fp8_rowwise.py [--ms 32 64 96 128 256 512 2048 8192] [--json PATH]

The four GEMMs of one Qwen3-8B layer (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 24576, down 12288 ->
4096), weights N(0, 1/K) quantized at load in 128-row groups (``quant.quantize_fp8_row_groups``) with their (1, N)
row scale (``quant.row_scales``).

(a) correctness at each M: ``quantize_per_token`` against its torch reference (scales equal, e4m3 values equal
    but for rounding ties); ``fp8_rowwise_mm`` against the float32 product of the same quantized operands
    (``fp8_rowwise_ref``; tolerance 1e-2); ``fp8_linear`` with the row scale against bf16 F.linear of the
    dequantized weight (FP8 activation error: tolerance 5e-2);
(b) us per layer (the four GEMMs summed) at each M for: ``bf16`` (F.linear, cuBLAS), ``blocks`` (``fp8_linear``
    without the row scale: today's dispatch, cuBLAS's block-scaled GEMM above 64 tokens), ``rowwise``
    (``fp8_rowwise_mm``: per-token quantization + torch's row-wise ``_scaled_mm``), ``rowwise_fast`` (the same with
    use_fast_accum), ``quant`` (``quantize_per_token`` alone) and ``shipped`` (``fp8_linear`` with the row scale,
    i.e. what the engine runs; it equals ``blocks`` up to ``rowwise_min_m`` tokens). Each timing replays a CUDA graph
    of calls on enough weight copies to exceed the 50 MB L2 (weights come from HBM), under CUDA events. A variant
    that fails prints its error and is left out.
The summary table (us per layer, and the speedup of ``shipped`` over ``blocks`` and over bf16) is printed right
after the checks and again at the end, after the per-GEMM times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_fp8_gemm import rel_error, time_us
from fnvllm.kernels import fp8_gemm as g
from fnvllm.model.quant import quantize_fp8_row_groups, row_scales

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # name: (N, K)
MS = (32, 64, 96, 128, 256, 512, 2048, 8192)
VARIANTS = ("bf16", "blocks", "rowwise", "rowwise_fast", "quant", "shipped")
L2_BYTES = 256 << 20  # weight bytes one timing cycles through (well above the 50 MB L2)
GEMM_TOLERANCE = 1e-2
LINEAR_TOLERANCE = 5e-2
DEVICE = "cuda"  # a dry run of the script's logic may set "cpu" (with the Triton interpreter and a stub timer)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=list(MS), help="token counts M")
    parser.add_argument("--json", help="write every number to this file")
    return parser.parse_args()


class Gemm:
    """One layer GEMM: ``copies`` bf16 weights and their row-group fp8 quantizations with row scales."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name, self.n, self.k = name, n, k
        self.copies = max(1, math.ceil(L2_BYTES / (n * k)))
        torch.manual_seed(0)
        self.bf16 = [(torch.randn(n, k, device=DEVICE) / math.sqrt(k)).bfloat16() for _ in range(self.copies)]
        self.fp8 = [self._quantize(w) for w in self.bf16]

    @staticmethod
    def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(e4m3 weight, block scales with equal columns, (1, N) row scale)."""
        q, scale = quantize_fp8_row_groups(w)
        return q, scale, row_scales(scale, w.shape[0])

    def x(self, m: int) -> torch.Tensor:
        """Activations (m, K) bf16, the same for a given m."""
        torch.manual_seed(m)
        return torch.randn(m, self.k, device=DEVICE).bfloat16()

    def call(self, variant: str, x: torch.Tensor, fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> object:
        """One product by ``variant`` (see (b) in the module docstring)."""
        w, s, rs = fp8
        if variant == "blocks":
            return g.fp8_linear(x, w, s)
        if variant == "rowwise":
            return g.fp8_rowwise_mm(x, w, rs, fast_accum=False)
        if variant == "rowwise_fast":
            return g.fp8_rowwise_mm(x, w, rs, fast_accum=True)
        if variant == "quant":
            return g.quantize_per_token(x, pad_rows=g.ROWWISE_PAD_M)
        return g.fp8_linear(x, w, s, row_scale=rs)

    def checks(self, m: int) -> dict[str, float]:
        """(a) at M = m: the errors named in the module docstring (a failing call raises)."""
        x = self.x(m)
        w, s, rs = self.fp8[0]
        x_q, x_scale = g.quantize_per_token(x, pad_rows=g.ROWWISE_PAD_M)
        ref_q, ref_scale = g.quantize_per_token_ref(x)
        out = {
            "quant_scale_err": float((x_scale[:m] - ref_scale).abs().max() / ref_scale.abs().max()),
            "quant_same": float((x_q[:m].float() == ref_q.float()).float().mean()),
            "pad_zero": float(x_q[m:].float().abs().sum()),
        }
        exact = g.fp8_rowwise_ref(x_q[:m], x_scale[:m], w, rs, torch.float32)
        out["rowwise"] = rel_error(g.fp8_rowwise_mm(x, w, rs, fast_accum=False), exact)
        out["rowwise_fast"] = rel_error(g.fp8_rowwise_mm(x, w, rs, fast_accum=True), exact)
        bf16 = F.linear(x, g.dequantize_fp8_blocks(w, s, torch.bfloat16))
        out["shipped_vs_bf16"] = rel_error(g.fp8_linear(x, w, s, row_scale=rs), bf16)
        out["blocks_vs_bf16"] = rel_error(g.fp8_linear(x, w, s), bf16)
        return out

    def time(self, variant: str, m: int) -> float:
        """us per call of ``variant`` at M = m."""
        x = self.x(m)
        reps = 3 if m >= 4096 else 20
        if variant == "bf16":
            return time_us([lambda w=w: F.linear(x, w) for w in self.bf16], reps)
        return time_us([lambda fp8=fp8: self.call(variant, x, fp8) for fp8 in self.fp8], reps)


def check_ok(errors: dict[str, float]) -> bool:
    """Whether one GEMM's checks at one M pass (see (a))."""
    return (
        errors["quant_scale_err"] < 1e-6
        and errors["quant_same"] > 0.99
        and errors["pad_zero"] == 0.0
        and errors["rowwise"] < GEMM_TOLERANCE
        and errors["rowwise_fast"] < GEMM_TOLERANCE
        and errors["shipped_vs_bf16"] < LINEAR_TOLERANCE
    )


def run_checks(gemms: list[Gemm], ms: list[int], record: dict) -> bool:
    """(a) for every GEMM and M, one line each; True when all pass."""
    print(
        "(a) correctness (rowwise: vs float32 of the same fp8 operands; *_vs_bf16: vs bf16 of the dequantized weight)"
    )
    ok = True
    for gemm in gemms:
        for m in ms:
            try:
                errors = gemm.checks(m)
            except Exception as e:  # reported, counted as a failure
                print(f"  {gemm.name:8s} M={m:5d} ERROR {(str(e).splitlines() or [type(e).__name__])[0][:150]}")
                ok = False
                continue
            record["checks"][f"{gemm.name} M={m}"] = errors
            passed = check_ok(errors)
            ok &= passed
            line = " ".join(f"{key}={value:.2e}" for key, value in errors.items())
            print(f"  {gemm.name:8s} M={m:5d} {'ok  ' if passed else 'FAIL'} {line}")
    thresholds = f"ROWWISE_MIN_M={g.ROWWISE_MIN_M}, by shape {g.ROWWISE_MIN_M_BY_SHAPE}"
    print(f"checks: {'all passed' if ok else 'SOME FAILED'}  (ROWWISE={g.ROWWISE}, {thresholds})")
    return ok


def run_times(gemms: list[Gemm], ms: list[int], record: dict) -> dict[str, dict[int, float]]:
    """(b): us per GEMM for every variant and M; returns us per layer (variant -> M -> sum over the GEMMs)."""
    layer: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
    for m in ms:
        for variant in VARIANTS:
            total = 0.0
            for gemm in gemms:
                try:
                    us = gemm.time(variant, m)
                except Exception as e:  # a variant that cannot run is left out
                    print(f"  {gemm.name} M={m} {variant}: ERROR {(str(e).splitlines() or ['?'])[0][:120]}")
                    total = math.nan
                    break
                record["times"][f"{gemm.name} M={m} {variant}"] = us
                total += us
            layer[variant][m] = total
        row = "  ".join(f"{v} {layer[v][m]:8.1f}" for v in VARIANTS)
        print(f"  M={m:5d} us per layer: {row}", flush=True)
    return layer


def summary(layer: dict[str, dict[int, float]], ms: list[int]) -> str:
    """us per layer per variant and M, with shipped's speedup over blocks and over bf16."""
    head = f"{'M':>6s} " + " ".join(f"{v:>12s}" for v in VARIANTS) + f" {'ship/blocks':>12s} {'ship/bf16':>10s}"
    lines = ["us per Qwen3-8B layer (qkv + o + gate_up + down)", head]
    for m in ms:
        cells = " ".join(f"{layer[v].get(m, math.nan):12.1f}" for v in VARIANTS)
        ship = layer["shipped"].get(m, math.nan)
        over_blocks, over_bf16 = layer["blocks"].get(m, math.nan) / ship, layer["bf16"].get(m, math.nan) / ship
        lines.append(f"{m:6d} {cells} {over_blocks:11.2f}x {over_bf16:9.2f}x")
    return "\n".join(lines)


def main() -> int:
    """Checks, then times; exit status 1 when a check fails."""
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]  # a kill at the budget keeps the lines
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    record: dict = {"checks": {}, "times": {}, "device": device, "torch": torch.__version__}
    gemms = [Gemm(name, n, k) for name, (n, k) in GEMMS.items()]
    recipe = g._has_rowwise_scaled_mm(0) if DEVICE == "cuda" else "n/a"
    print(f"{device}, torch {torch.__version__}, row-wise recipe: {recipe}, fast accum default {g.ROWWISE_FAST_ACCUM}")
    ok = run_checks(gemms, args.ms, record)
    print("(b) times", flush=True)
    layer = run_times(gemms, args.ms, record)
    table = summary(layer, args.ms)
    print(table)
    print("per GEMM (us):")
    for gemm in gemms:
        for m in args.ms:
            cells = " ".join(f"{v} {record['times'].get(f'{gemm.name} M={m} {v}', math.nan):8.1f}" for v in VARIANTS)
            print(f"  {gemm.name:8s} M={m:5d} {cells}")
    print(table)
    print(f"checks: {'all passed' if ok else 'SOME FAILED'}; wall {time.perf_counter() - started:.0f} s")
    if args.json:
        record["per_layer"] = {v: {str(m): t for m, t in layer[v].items()} for v in VARIANTS}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

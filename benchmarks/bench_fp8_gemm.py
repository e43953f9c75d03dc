"""The FP8 weight GEMMs at Qwen3-8B sizes on one GPU: correctness, then time against bf16 and cuBLAS fp8.

    PYTHONPATH=$PWD python3 benchmarks/bench_fp8_gemm.py [--json PATH] [--sweep]

The four GEMMs of one Qwen3-8B layer (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 24576, down 12288 ->
4096), weights N(0, 1/K) quantized to e4m3 with 128 x 128 block scales (``quant.quantize_fp8_blocks``).

(a) correctness of ``fp8_linear`` (the shipped dispatch: ``fp8_gemm_small_m`` up to 64 tokens, activation
    quantization + ``fp8_gemm_blockwise`` above) at M = 1, 16, 64, 256, 8192: relative error (Frobenius) against
    the float32 reference on the same quantized operands (tolerance 1e-2), and, for information, against the
    dequantize-to-bf16 reference (what the CPU runs; the gap is the activations' e4m3 rounding above 64 tokens);
(b) time per GEMM at each M for bf16 (F.linear, cuBLAS), fp8 ours (``fp8_linear``, activation quantization
    included) and cuBLAS fp8 (``torch._scaled_mm``, per-tensor scales, activations quantized beforehand: a lower
    bound, not the same numerics). Each timing replays a CUDA graph of calls on enough weight copies to exceed
    the 50 MB L2 (so weights come from HBM), timed with CUDA events. Reported: µs, TB/s of weight bytes (fp8: 1
    byte per weight + 4 per 128 x 128 block; bf16: 2 bytes) and TFLOP/s (2 M N K). Targets: fp8 ours >= 3.5 TB/s
    at M <= 16; above ~256 tokens faster than bf16;
(c) --sweep: tile choices of both kernels (small M: block_n x split_k x stages at M = 1 and 16, to compare with
    ``pick_small_m_config``'s choice; large M: block_m x group_m at 8192).
The last table is the summary: the layer's four GEMMs summed per M (the issue's table), and the speedups.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fnvllm.kernels import fp8_gemm as g
from fnvllm.model.quant import quantize_fp8_blocks

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # name: (N, K)
MS = (1, 16, 64, 256, 8192)
L2_BYTES = 256 << 20  # weight bytes one timing cycles through (well above the 50 MB L2)
TOLERANCE = 1e-2


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--sweep", action="store_true", help="also time a few tile choices of both kernels")
    parser.add_argument("--ms", type=int, nargs="+", default=list(MS), help="token counts M")
    return parser.parse_args()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32."""
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def time_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Mean µs of one call: a CUDA graph of all ``calls`` in order, replayed ``reps`` times under CUDA events."""
    for call in calls:  # compile and warm outside the graph
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


class Gemm:
    """One layer GEMM's weights: ``copies`` bf16 weights and their fp8 quantizations (copies: enough for L2)."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name, self.n, self.k = name, n, k
        self.copies = max(1, math.ceil(L2_BYTES / (n * k)))
        torch.manual_seed(0)
        self.bf16 = [(torch.randn(n, k, device="cuda") / math.sqrt(k)).bfloat16() for _ in range(self.copies)]
        self.fp8 = [quantize_fp8_blocks(w) for w in self.bf16]

    @property
    def fp8_bytes(self) -> int:
        """Bytes of one fp8 weight with its scales."""
        return self.n * self.k + 4 * math.ceil(self.n / 128) * math.ceil(self.k / 128)

    def check(self, m: int) -> dict[str, float]:
        """Relative errors of fp8_linear at M = m (see (a) in the module docstring)."""
        x = torch.randn(m, self.k, device="cuda").bfloat16()
        w, s = self.fp8[0]
        out = g.fp8_linear(x, w, s)
        if m <= g.SMALL_M:
            exact = g.fp8_linear_ref(x.float(), w, s)
        else:
            exact = g.fp8_blockwise_ref(*g.quantize_activations(x), w, s, torch.float32)
        return {
            "vs_same_operands": rel_error(out, exact),
            "vs_bf16_dequantized": rel_error(out, g.fp8_linear_ref(x, w, s)),
        }

    def timings(self, m: int) -> dict[str, float | None]:
        """µs per call of bf16, fp8 ours and cuBLAS fp8 at M = m."""
        x = torch.randn(m, self.k, device="cuda").bfloat16()
        reps = 3 if m >= 4096 else 20
        out = {
            "bf16": time_us([lambda w=w: F.linear(x, w) for w in self.bf16], reps),
            "fp8_ours": time_us([lambda w=w, s=s: g.fp8_linear(x, w, s) for w, s in self.fp8], reps),
        }
        out["cublas_fp8"] = self._scaled_mm_us(x, reps)
        return out

    def _scaled_mm_us(self, x: torch.Tensor, reps: int) -> float | None:
        """µs of torch._scaled_mm with per-tensor scales on pre-quantized activations, M padded to a multiple of
        16 as cuBLAS requires (None if unsupported)."""
        x8 = F.pad(x, (0, 0, 0, -x.shape[0] % 16)).to(g.FP8_DTYPE)
        one = torch.ones((), device="cuda")
        try:
            calls = [lambda w=w: torch._scaled_mm(x8, w.t(), one, one, out_dtype=torch.bfloat16) for w, _ in self.fp8]
            return time_us(calls, reps)
        except (RuntimeError, TypeError) as e:
            print(f"  _scaled_mm unavailable at M={x.shape[0]}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            return None

    def sweep(self, m: int) -> dict[str, float]:
        """µs of the kernel tile choices at M = m (small-M kernel up to 64 tokens, blockwise above)."""
        x = torch.randn(m, self.k, device="cuda").bfloat16()
        results: dict[str, float] = {}
        if m <= g.SMALL_M:
            for block_n in (16, 32, 64):
                for split in (1, 2, 4):
                    for stages in (4, 6):
                        cfg = g.SmallMConfig(block_n, split, stages)
                        calls = [lambda w=w, s=s, c=cfg: g.fp8_gemm_small_m(x, w, s, c) for w, s in self.fp8]
                        results[f"SmallMConfig({block_n}, {split}, {stages})"] = time_us(calls, 20)
        else:
            x_q, x_s = g.quantize_activations(x)
            for block_m in (64, 128):
                for group_m in (8, 16):
                    calls = [
                        lambda w=w, s=s, bm=block_m, gm=group_m: g.fp8_gemm_blockwise(x_q, x_s, w, s, x.dtype, bm, gm)
                        for w, s in self.fp8
                    ]
                    results[f"block_m={block_m} group_m={group_m}"] = time_us(calls, 3)
        return results


def main() -> int:
    """Check, time, print the tables; exit 1 when a correctness check fails."""
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm.py times Triton and cuBLAS GEMMs: it needs a CUDA GPU")
    gemms = [Gemm(name, n, k) for name, (n, k) in GEMMS.items()]
    record: dict[str, object] = {"device": torch.cuda.get_device_name(), "checks": {}, "times_us": {}, "sweep": {}}
    failed = False
    print("(a) correctness: relative error of fp8_linear (same operands | vs bf16-dequantized reference)")
    for gemm in gemms:
        for m in args.ms:
            errors = gemm.check(m)
            ok = errors["vs_same_operands"] < TOLERANCE
            failed |= not ok
            record["checks"][f"{gemm.name} M={m}"] = errors  # type: ignore[index]
            print(f"  {gemm.name:8} M={m:5}: {errors['vs_same_operands']:.2e} | {errors['vs_bf16_dequantized']:.2e}"
                  f"  {'PASS' if ok else 'FAIL'}")  # fmt: skip
    print("(b) time per GEMM")
    times: dict[tuple[str, int], dict[str, float | None]] = {}
    for gemm in gemms:
        for m in args.ms:
            t = times[gemm.name, m] = gemm.timings(m)
            record["times_us"][f"{gemm.name} M={m}"] = t  # type: ignore[index]
            fp8_tb = gemm.fp8_bytes / t["fp8_ours"] / 1e6
            tflops = 2 * m * gemm.n * gemm.k / t["fp8_ours"] / 1e6
            cublas = "n/a" if t["cublas_fp8"] is None else f"{t['cublas_fp8']:.1f}"
            print(f"  {gemm.name:8} M={m:5}: bf16 {t['bf16']:8.1f} µs  fp8 ours {t['fp8_ours']:8.1f} µs "
                  f"({fp8_tb:.2f} TB/s, {tflops:.0f} TFLOP/s)  cuBLAS fp8 {cublas} µs")  # fmt: skip
    if args.sweep:
        print("(c) tile sweep (µs per call)")
        for gemm in gemms:
            for m in (m for m in args.ms if m in (1, 16, 8192)):
                results = gemm.sweep(m)
                record["sweep"][f"{gemm.name} M={m}"] = results  # type: ignore[index]
                best = min(results, key=results.__getitem__)
                print(f"  {gemm.name:8} M={m:5}: best {best} {results[best]:.1f} µs; " + ", ".join(
                    f"{k} {v:.1f}" for k, v in results.items()))  # fmt: skip
    print_summary(gemms, args.ms, times)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 1 if failed else 0


def print_summary(gemms: list[Gemm], ms: list[int], times: dict[tuple[str, int], dict[str, float | None]]) -> None:
    """The layer's four GEMMs summed per M: µs, TB/s of weight bytes, TFLOP/s, and fp8 ours vs bf16 / cuBLAS."""
    fp8_bytes, bf16_bytes = sum(gm.fp8_bytes for gm in gemms), sum(2 * gm.n * gm.k for gm in gemms)
    flops_per_token = sum(2 * gm.n * gm.k for gm in gemms)
    print("\nsummary: one Qwen3-8B layer's four GEMMs (qkv, o, gate_up, down)")
    print(f"{'M':>6} | {'bf16 µs':>9} {'TB/s':>5} | {'fp8 ours µs':>11} {'TB/s':>5} {'TFLOP/s':>7} | "
          f"{'cuBLAS fp8 µs':>13} | {'vs bf16':>7} {'vs cuBLAS':>9}")  # fmt: skip
    for m in ms:
        bf16 = sum(times[gm.name, m]["bf16"] or 0.0 for gm in gemms)
        ours = sum(times[gm.name, m]["fp8_ours"] or 0.0 for gm in gemms)
        cublas_parts = [times[gm.name, m]["cublas_fp8"] for gm in gemms]
        cublas = None if None in cublas_parts else sum(p or 0.0 for p in cublas_parts)
        cublas_text = "n/a" if cublas is None else f"{cublas:.1f}"
        ratio = "n/a" if cublas is None else f"{cublas / ours:.2f}x"
        tflops = m * flops_per_token / ours / 1e6
        print(f"{m:>6} | {bf16:>9.1f} {bf16_bytes / bf16 / 1e6:>5.2f} | {ours:>11.1f} {fp8_bytes / ours / 1e6:>5.2f} "
              f"{tflops:>7.0f} | {cublas_text:>13} | {bf16 / ours:>6.2f}x {ratio:>9}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

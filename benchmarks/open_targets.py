"""The open issues' target figures on this GPU, the rarest first, and a table of each target against its measurement.

    PYTHONPATH=$PWD python3 benchmarks/open_targets.py [OUT] [--parts attention latency gemm] [--rounds 2]
        [--any-gpu]

Issue 20 (FP8): decode attention over an FP8 cache >= 3.9 TB/s of K/V bytes read and >= 1.85x the bf16 kernel's
tokens per second (``bench_fp8_kv.py --quick --no-sweep``: B 256, contexts U(100, 2048), the engine's launch order
and cache layout); one Qwen3-8B layer's four small-M FP8 GEMMs >= 3.5 TB/s of weight bytes at M = 1 and 16
(``bench_fp8_gemm.py --ms 1 16 --variants swap_ready shipped --ceiling``: from activations quantized by their
producer, as a decode step runs them, and with their quantization launches). Issue 19 (small batches): device ms
per decode step of the Qwen3-0.6B shape at 1 / 16 / 64 requests <= 0.8 / 1.0 / 1.3 (``fnvllm bench --latency
1,16,64 --profile`` on a random checkpoint, one process a round; the table gives the rounds' mean and range).

The targets are H200 numbers, so on another GPU the script says so and stops, unless --any-gpu. Then the table
judges only what carries across cards: the attention's ratio to bf16, and the bandwidth figures as fractions of this
card's read ceiling (``bench_fp8_gemm.py --ceiling`` measures it) against the H200 targets' fractions of its 4.16
TB/s. Each part runs as its own process under a time limit, attention first (the figure measured least often);
logs and JSON go to OUT (default: $OUT, else ./open_targets_out), and a part that fails is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from benchmarks.bench_fp8_gemm import GEMMS as LAYER_GEMMS  # (N, K) of one Qwen3-8B layer's projections
from benchmarks.bench_fp8_gemm import SMALL_M_TARGET_TB_S as GEMM_TB_S
from benchmarks.bench_fp8_gemm import fp8_weight_bytes
from fnvllm.bench import H200_READ_TB_S, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ATTENTION_TB_S, ATTENTION_RATIO = 3.9, 1.85
LATENCY_MS = {1: 0.8, 16: 1.0, 64: 1.3}
GEMM_MS = (1, 16)
PARTS = ("attention", "latency", "gemm")
TIME_LIMIT_S = {"attention": 240, "latency": 180, "gemm": 180}


class Row(NamedTuple):
    """One line of the table: the issue, what it asks, what was measured, and whether that meets it (None: not
    judged on this card)."""

    issue: int
    target: str
    measured: str
    met: bool | None


def layer_fp8_bytes() -> int:
    """Bytes of one Qwen3-8B layer's four e4m3 weights with their 128 x 128 block scales (float32)."""
    return sum(fp8_weight_bytes(n, k) for n, k in LAYER_GEMMS.values())


def attention_rows(kv: dict, h200: bool, ceiling_tb_s: float | None) -> list[Row]:
    """Issue 20's attention targets from ``bench_fp8_kv.py --json``'s decode record: the FP8 kernel as the engine
    launches it (longest first, its cache layout) against the bf16 kernel."""
    decode = kv["decode"]
    fp8, bf16 = decode["fp8_default_ordered"], decode["bf16"]
    ratio = bf16["us"] / fp8["us"]
    ratio_target = f"FP8 decode attention >= {ATTENTION_RATIO}x bf16 tokens/s"
    rows = [Row(20, ratio_target, f"{ratio:.2f}x", ratio >= ATTENTION_RATIO)]
    target = f"FP8 decode attention >= {ATTENTION_TB_S} TB/s read"
    measured = f"{fp8['tb_s']:.2f} TB/s ({fp8['us']:.1f} us, {decode['layout']} caches)"
    if h200:
        rows.append(Row(20, target, measured, fp8["tb_s"] >= ATTENTION_TB_S))
    else:
        rows.append(_fraction_row(target, measured, fp8["tb_s"], ATTENTION_TB_S, ceiling_tb_s))
    return rows


def gemm_rows(gemm: dict, h200: bool) -> list[Row]:
    """Issue 20's small-M layer target from ``bench_fp8_gemm.py --json``: per M and variant, the four GEMMs'
    summed us as TB/s of the layer's weight bytes (a variant missing a GEMM is left out)."""
    times, ceiling = gemm["times_us"], gemm.get("read_ceiling_tb_s")
    rows = []
    for m in GEMM_MS:
        for variant, how in (("swap_ready", "from ready activations"), ("shipped", "with quantization launches")):
            parts = [times.get(f"{name} M={m} {variant}") for name in LAYER_GEMMS]
            if any(us is None for us in parts):
                continue
            us = sum(parts)  # type: ignore[arg-type]
            tb_s = layer_fp8_bytes() / us / 1e6
            target, measured = f"FP8 layer >= {GEMM_TB_S} TB/s at M = {m}, {how}", f"{tb_s:.2f} TB/s ({us:.1f} us)"
            if h200:
                rows.append(Row(20, target, measured, tb_s >= GEMM_TB_S))
            else:
                rows.append(_fraction_row(target, measured, tb_s, GEMM_TB_S, ceiling))
    return rows


def _fraction_row(target: str, measured: str, tb_s: float, target_tb_s: float, ceiling: float | None) -> Row:
    """A bandwidth target judged off the H200: this card's fraction of its own read ceiling against the target's
    fraction of the H200's (not judged without a ceiling)."""
    want = target_tb_s / H200_READ_TB_S
    if ceiling is None:
        return Row(20, f"{target} (H200)", f"{measured}; no read ceiling measured", None)
    have = tb_s / ceiling
    judged = f"{target} (H200: {want:.3f} of its ceiling)"
    return Row(20, judged, f"{measured} = {have:.3f} of {ceiling:.3f}", have >= want)


def latency_rows(reports: Sequence[dict], h200: bool) -> list[Row]:
    """Issue 19's targets from ``fnvllm bench --latency ... --profile --json`` reports (one a round): per batch,
    the rounds' mean device ms per decode step and their range."""
    by_batch: dict[int, list[float]] = {}
    for report in reports:
        for row in report.get("latency", []):
            device_ms = (row.get("decode_timeline") or {}).get("mean_gpu_ms")
            if device_ms is not None:
                by_batch.setdefault(row["requests"], []).append(device_ms)
    rows = []
    for batch, target in LATENCY_MS.items():
        values = by_batch.get(batch)
        if not values:
            continue
        mean = sum(values) / len(values)
        spread = f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""
        rows.append(Row(19, f"{batch} request(s) <= {target} device ms a step", f"{mean:.3f}{spread}",
                        mean <= target if h200 else None))  # fmt: skip
    return rows


def print_table(rows: Sequence[Row], device: str) -> None:
    """The markdown table printed last."""
    print(f"\n== open targets on {device} ==")
    print("| issue | target | measured | met |")
    print("|---|---|---|---|")
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "no")
        print(f"| {row.issue} | {row.target} | {row.measured} | {met} |")


def last_json_line(text: str) -> dict:
    """The last line of ``text`` that parses as a JSON object (the bench's report follows its progress lines)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError("no JSON report in the output")


def run_part(name: str, args: list[str], out: Path, log: str) -> subprocess.CompletedProcess[str] | None:
    """Run one part's command from the repository root under its time limit, its output into OUT/log; None when
    it fails (reported)."""
    try:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        result = subprocess.run(
            args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=TIME_LIMIT_S[name], check=False
        )
    except subprocess.TimeoutExpired:
        print(f"{name}: stopped after {TIME_LIMIT_S[name]} s")
        return None
    (out / log).write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        print(f"{name}: rc {result.returncode}, see {out / log}: {result.stderr.strip()[-300:]}")
        return None
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the parts asked for, then print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ.get("OUT", "open_targets_out"))
    parser.add_argument("out", type=Path, nargs="?", default=default_out, help="folder for the logs and JSON")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure, in order")
    parser.add_argument("--rounds", type=int, default=2, help="latency processes (each times 1, 16 and 64 requests)")
    parser.add_argument("--any-gpu", action="store_true", help="run on a GPU other than an H200 too")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("open_targets.py measures H200 targets: it needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    h200 = "H200" in device
    if not h200 and not args.any_gpu:
        print(f"{device} is not an H200: the targets are H200 numbers (--any-gpu runs anyway)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    kv, gemm, reports = None, None, []
    for part in args.parts:
        if part == "attention":
            kv_json = args.out / "attention.json"
            bench = [py, "benchmarks/bench_fp8_kv.py", "--quick", "--no-sweep", "--json", str(kv_json)]
            if run_part(part, bench, args.out, "attention.log"):
                kv = json.loads(kv_json.read_text())
        elif part == "gemm":
            gemm_json = args.out / "gemm.json"
            bench = [py, "benchmarks/bench_fp8_gemm.py", "--ms", *map(str, GEMM_MS), "--variants", "swap_ready",
                     "shipped", "--ceiling", "--json", str(gemm_json)]  # fmt: skip
            if run_part(part, bench, args.out, "gemm.log"):
                gemm = json.loads(gemm_json.read_text())
        else:
            reports = latency_reports(args.out, args.rounds, py)
    rows = []
    ceiling = gemm.get("read_ceiling_tb_s") if gemm else None
    if kv:
        rows += attention_rows(kv, h200, ceiling)
    if gemm:
        rows += gemm_rows(gemm, h200)
    rows += latency_rows(reports, h200)
    print_table(rows, device)
    return 0


def latency_reports(out: Path, rounds: int, py: str) -> list[dict]:
    """``rounds`` latency benches on one random Qwen3-0.6B checkpoint (written once, outside OUT: it is 1.2 GB),
    one process each; their JSON reports."""
    reports = []
    with tempfile.TemporaryDirectory(prefix="open_targets_") as folder:
        checkpoint = write_checkpoint("qwen3-0.6b", Path(folder))
        for r in range(rounds):
            bench = [py, "-m", "fnvllm.cli", "bench", "--model", str(checkpoint), "--model-shape", "qwen3-0.6b",
                     "--latency", ",".join(map(str, LATENCY_MS)), "--profile", "--json"]  # fmt: skip
            result = run_part("latency", bench, out, f"latency{r + 1}.log")
            if result:
                try:
                    reports.append(last_json_line(result.stdout))
                except ValueError as e:
                    print(f"latency round {r + 1}: {e}")
    return reports


if __name__ == "__main__":
    sys.exit(main())

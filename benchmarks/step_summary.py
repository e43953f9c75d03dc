"""The latency rows of ``fnvllm bench --latency ... --json`` runs, one line per (run, batch): for the device-call
scripts (``cuda_rows_check.sh``, ``step_variants.sh``).

    python3 benchmarks/step_summary.py OUT NAME... [--winners FILE --variants TSV]

Reads OUT/NAME.log (the report is its last line) and prints ms per step, device and host ms per decode step.
With --winners: the variants (named ``VARIANT_SUFFIX``, TSV mapping each VARIANT to the variant string it ran)
whose device ms per step beat the mean of the ``base`` runs by MIN_GAIN at some batch, best first, space-separated
into FILE (the CPU's timeline has no device time, so there its step time stands in).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MIN_GAIN = 0.01  # a winner's device time a step is at least 1 % below base's mean at some batch


def latency_rows(out: Path, names: list[str]) -> list[tuple[str, int, float]]:
    """Print each run's latency rows; return (run name, requests, device ms per step) where the timeline has one."""
    rows = []
    print("run                       requests  ms/step  device ms/step  host ms/step")
    for name in names:
        try:
            report = json.loads((out / f"{name}.log").read_text().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError) as e:
            print(f"{name:25s} no report ({type(e).__name__})")
            continue
        for row in report.get("latency", []):
            timeline = row.get("decode_timeline") or {}
            device_ms = timeline.get("mean_gpu_ms", timeline.get("mean_step_ms"))
            print(f"{name:25s} {row['requests']:8d}  {row['ms_per_step']:7.3f}  {device_ms!s:>14}  "
                  f"{timeline.get('mean_cpu_ms')!s:>12}")  # fmt: skip
            if device_ms is not None:
                rows.append((name, row["requests"], device_ms))
    return rows


def winners(rows: list[tuple[str, int, float]], variants: dict[str, str]) -> list[str]:
    """The variant strings of the runs (name VARIANT_SUFFIX) at least MIN_GAIN faster than base's mean at some
    batch, best first."""
    base: dict[int, list[float]] = {}
    for name, requests, ms in rows:
        if name.rsplit("_", 1)[0] == "base":
            base.setdefault(requests, []).append(ms)
    gain: dict[str, float] = {}
    for name, requests, ms in rows:
        variant = name.rsplit("_", 1)[0]
        if variant != "base" and requests in base:
            mean = sum(base[requests]) / len(base[requests])
            gain[variant] = max(gain.get(variant, 0.0), 1 - ms / mean)
    ranked = sorted(gain.items(), key=lambda kv: -kv[1])
    return [variants.get(v, v) for v, g in ranked if g > MIN_GAIN]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder of the runs' logs")
    parser.add_argument("names", nargs="+", help="run names (OUT/NAME.log)")
    parser.add_argument("--winners", type=Path, help="write the winning variants here")
    parser.add_argument("--variants", type=Path, help="TSV: a run's variant name, then the variant string it ran")
    args = parser.parse_args(argv)
    rows = latency_rows(args.out, args.names)
    if args.winners is not None:
        lines = args.variants.read_text().splitlines() if args.variants and args.variants.exists() else []
        variants = dict(line.split("\t", 1) for line in lines if "\t" in line)
        args.winners.write_text(" ".join(winners(rows, variants)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

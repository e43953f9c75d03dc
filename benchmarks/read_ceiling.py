"""This device's read ceiling: how fast a plain reduction reads one large tensor, the rate the floors divide by.

    PYTHONPATH=$PWD python3 benchmarks/read_ceiling.py [--gib 2] [--repeats 20]

GPU.md's 4.16 TB/s for the H200 is this measurement: ``sum`` over a 2 GiB bf16 tensor, the best of the repeats
(CUDA events around each call). A target stated in TB/s for one card carries to another as a fraction of its
ceiling: issue 20's small-M FP8 layer asks 3.5 TB/s on the H200, 3.5 / 4.16 = 0.841 of that card's ceiling
(``bench_fp8_gemm.py --ceiling`` prints the layer's fraction beside it). A kernel bound by launch latency rather
than bytes is held to less on a faster card, so the fraction is a stand-in, not the H200's figure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

H200_READ_TB_S = 4.16  # this measurement on the lent H200 (GPU.md)


def best_seconds(call: Callable[[], object], repeats: int, clock: Callable[[Callable[[], object]], float]) -> float:
    """The shortest of ``repeats`` timings of ``call`` by ``clock`` (seconds one call took)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return min(clock(call) for _ in range(repeats))


def cuda_clock(call: Callable[[], object]) -> float:
    """Seconds ``call`` took on the current CUDA stream (events around it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def wall_clock(call: Callable[[], object]) -> float:
    """Seconds ``call`` took on the host (for a CPU tensor)."""
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def read_ceiling_tb_s(device: torch.device | str, gib: float = 2.0, repeats: int = 20) -> float:
    """TB/s at which ``sum`` reads a ``gib`` GiB bf16 tensor on ``device`` (the best of ``repeats`` calls; the
    first call is a warm-up, untimed)."""
    if not 0 < gib <= 64:
        raise ValueError(f"gib must be in (0, 64], got {gib}")
    device = torch.device(device)
    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    clock = cuda_clock if device.type == "cuda" else wall_clock
    return x.numel() * x.element_size() / best_seconds(x.sum, repeats, clock) / 1e12


def main() -> None:
    """Print this device's read ceiling."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the bf16 tensor read, GiB")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls; the best counts")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    rate = read_ceiling_tb_s(device, args.gib, args.repeats)
    print(f"{name}: read ceiling {rate:.3f} TB/s (sum over {args.gib:g} GiB bf16, best of {args.repeats})")


if __name__ == "__main__":
    main()

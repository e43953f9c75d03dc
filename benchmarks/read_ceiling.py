"""This device's read ceiling: how fast a plain reduction reads one large tensor, the rate the floors divide by.

    PYTHONPATH=$PWD python3 benchmarks/read_ceiling.py [--gib 2] [--repeats 20] [--sizes-mb 16.8 25.2 50.3 100.7]

GPU.md's 4.16 TB/s for the H200 is this measurement: ``sum`` over a 2 GiB bf16 tensor, the best of the repeats
(CUDA events around each call). A target stated in TB/s for one card carries to another as a fraction of its
ceiling: issue 20's small-M FP8 layer asks 3.5 TB/s on the H200, 3.5 / 4.16 = 0.841 of that card's ceiling
(``bench_fp8_gemm.py --ceiling`` prints the layer's fraction beside it). A kernel bound by launch latency rather
than bytes is held to less on a faster card, so the fraction is a stand-in, not the H200's figure.

--sizes-mb: what one launch that only reads costs at each size, the least any kernel reading that many bytes
could take in a chain of launches (GPU only). ``_fold_kernel`` XOR-folds its share of the words and writes one word
a program; each size is read from enough copies to exceed L2, one launch a copy, in a CUDA graph, at several grid
sizes (the best counts). A line fitted through the sizes gives the fixed cost of a launch (its intercept) and the
streaming rate (its slope). The defaults are one Qwen3-8B layer's FP8 weights (o, qkv, down, gate_up), so the
small-M FP8 GEMMs (``bench_fp8_gemm.py``) can be read against a plain read of the same bytes. On sm_90+ the sizes
are timed twice: plain launches, then each launch under programmatic dependent launch with its reads before the
wait for the launch before it (as the engine's projections read their weights before theirs), which tells how much
of the fixed cost a chain of dependent launches can hide.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from fnvllm.kernels.fused_ops import wait_for_previous_kernel

# One Qwen3-8B layer's FP8 weights, MB: o 4096 x 4096, qkv 6144 x 4096, down 4096 x 12288, gate_up 24576 x 4096
LAYER_FP8_MB = (16.8, 25.2, 50.3, 100.7)
L2_BYTES = 256 << 20  # bytes one timing cycles through (well above the H100's and H200's 50 MB L2)
# int32 words a program loads per step, tried at each size: 8 per thread at 8 warps (two 16-byte loads in flight
# a thread) or 32 (eight). On an H100 the longer step did not raise the rate (2.72 TB/s against 2.71, the ceiling
# 3.12: BENCHMARKS.md, thirty-third session): this loop of plain loads is no floor for the largest sizes.
FOLD_BLOCKS = (2048, 8192)
GRID_WAVES = (1, 2, 4, 8)  # programs per SM tried at each size


@triton.jit
def _fold_kernel(x_ptr, out_ptr, n_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[pid] = the XOR of int32 words [pid * CHUNK, (pid + 1) * CHUNK) of x below n_words: a read and a store.

    USE_PDL: launched with programmatic dependent launch, the program reads its words first, then waits for the
    kernel before it (``wait_for_previous_kernel``, after which the next kernel may start) and stores: a kernel
    whose bytes do not depend on its predecessor's output (as a projection's weights do not), all of them asked
    for before its wait."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        idx = pid * CHUNK + i + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + idx, mask=idx < n_words, other=0)
    wait_for_previous_kernel(USE_PDL)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def fold_chunk(words: int, programs: int, block: int = FOLD_BLOCKS[0]) -> int:
    """Words each of ``programs`` programs folds: an equal share of ``words``, rounded up to whole blocks."""
    return math.ceil(words / programs / block) * block


def fold(x: torch.Tensor, out: torch.Tensor, programs: int, pdl: bool = False, block: int = FOLD_BLOCKS[0]) -> None:
    """XOR-fold int32 ``x`` into ``out[:programs]`` (one word a program; ``programs`` <= out's length), ``block``
    words a program per step; ``pdl`` launches it with programmatic dependent launch (CUDA, sm_90+), reads before
    the wait."""
    chunk = fold_chunk(x.numel(), programs, block)
    launch = {"launch_pdl": True} if pdl else {}
    _fold_kernel[(programs,)](x, out, x.numel(), CHUNK=chunk, BLOCK=block, USE_PDL=pdl, num_warps=8, **launch)


def fold_reference(x: torch.Tensor, programs: int, block: int = FOLD_BLOCKS[0]) -> torch.Tensor:
    """``fold``'s result from numpy: each program's share of the words, XOR-reduced (int32, one a program, on x's
    device)."""
    chunk = fold_chunk(x.numel(), programs, block)
    padded = np.zeros(programs * chunk, dtype=np.int32)
    padded[: x.numel()] = x.cpu().numpy()
    return torch.from_numpy(np.bitwise_xor.reduce(padded.reshape(programs, chunk), axis=1)).to(x.device)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs (at least two distinct xs)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"fit_line needs as many ys as xs and two distinct xs, got {list(xs)} / {list(ys)}")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def read_cost_us(size_mb: float, sms: int, pdl: bool = False) -> tuple[float, int, int]:
    """(µs, programs, block) of the fastest plain read of ``size_mb`` MB over the grid sizes GRID_WAVES x ``sms``
    and the steps FOLD_BLOCKS: the mean launch in a CUDA graph of one launch a copy, copies past L2
    (``bench_attention.graph_seconds``); ``pdl``: each launch under programmatic dependent launch (``fold``)."""
    from benchmarks.bench_attention import graph_seconds  # GPU-only path: keep the module light to import

    words = int(size_mb * 1e6) // 4
    copies = max(2, math.ceil(L2_BYTES / (4 * words)))
    xs = [torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    out = torch.empty(max(GRID_WAVES) * sms, dtype=torch.int32, device="cuda")
    for block in FOLD_BLOCKS:  # each step checked once against the numpy fold
        fold(xs[0], out, sms, pdl, block)
        if not torch.equal(out[:sms], fold_reference(xs[0], sms, block)):
            raise RuntimeError(f"_fold_kernel disagrees with fold_reference (block {block})")
    return min(
        (graph_seconds(lambda p=p, b=b: [fold(x, out, p, pdl, b) for x in xs]) * 1e6 / copies, p, b)
        for p in (waves * sms for waves in GRID_WAVES)
        for b in FOLD_BLOCKS
    )


def print_read_costs(sizes_mb: Sequence[float]) -> None:
    """The plain read's µs per launch at each size, and the line through them (fixed µs, TB/s): launched plainly,
    then under programmatic dependent launch (sm_90+), each read then waiting for the launch before it."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    modes = [False, True] if torch.cuda.get_device_capability(0)[0] >= 9 else [False]
    for pdl in modes:
        costs = [read_cost_us(size, sms, pdl) for size in sizes_mb]
        how = "under PDL (reads before the wait)" if pdl else "plain launches"
        print(f"plain read, one launch a copy in a CUDA graph (copies past L2), best grid, {how}:")
        for size, (us, programs, block) in zip(sizes_mb, costs, strict=True):
            print(f"  {size:7.1f} MB: {us:7.2f} us ({size / us:.2f} TB/s), {programs} programs of {block}-word steps")
        if len(set(sizes_mb)) >= 2:
            fixed, slope = fit_line(list(sizes_mb), [us for us, _, _ in costs])
            print(f"  line: {fixed:.2f} us fixed + bytes at {1 / slope:.2f} TB/s")


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
    parser.add_argument(
        "--sizes-mb", type=float, nargs="*", help=f"also time plain reads of these sizes (GPU; {LAYER_FP8_MB} if empty)"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.sizes_mb is not None and device != "cuda":
        raise SystemExit("read_ceiling.py --sizes-mb times CUDA-graph launches: it needs a CUDA GPU")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    rate = read_ceiling_tb_s(device, args.gib, args.repeats)
    print(f"{name}: read ceiling {rate:.3f} TB/s (sum over {args.gib:g} GiB bf16, best of {args.repeats})")
    if args.sizes_mb is not None:
        print_read_costs(args.sizes_mb or LAYER_FP8_MB)


if __name__ == "__main__":
    main()

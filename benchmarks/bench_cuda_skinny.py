"""The CUDA few-row projections (``fnvllm.kernels.cuda_skinny``) at any row count: their kernels against the path each
product takes without them, and the engine with table entries not yet in the code.

    PYTHONPATH=$PWD python3 benchmarks/bench_cuda_skinny.py kernels [--rows 32,64] [--reps 20]
    PYTHONPATH=$PWD python3 benchmarks/bench_cuda_skinny.py run --entries gate_up=4x1@64,qkv=2x2@64 \\
        bench --model CK --model-shape qwen3-0.6b --latency 32,64 --profile

``kernels`` (an sm_90+ GPU): for each Qwen3-0.6B projection (qkv, o and down as float32 split partials; gate/up with
the SiLU-and-mul epilogue) and each row count, every launch shape the source has a kernel for (kb 32-deep K blocks a
warp, S K splits, nw warp groups along N, the row count's tile) is first checked against a float32 product
(partials: sum within 1e-4; gate/up: within two bf16 steps of ``cuda_skinny.glu_out_ref``), then timed as a chain in one
CUDA graph, one launch per weight copy (copies past L2), best of five replays, against the path without an entry
(cuBLAS, and ``skinny_gemm.linear_partials`` with this module's table as shipped; gate/up: cuBLAS then
``silu_and_mul``, and the listed entry where there is one). A variant whose check fails is reported and skipped. The
last line is an ``--entries`` value listing the shapes at least 0.1 us faster than that path: a candidate, which the
whole decode step has to confirm (a chain alone has misled before: BENCHMARKS.md, tenth and fourteenth sessions).

``run``: adds ``--entries`` (NAME=KBxS[xNW]@TILE, NAME one of qkv, o, gate_up, down, or KIND:NxK for another shape, NW 1
when left out, TILE 16, 32 or 64) to ``cuda_skinny.CUDA_CONFIGS`` in this process, in place of any ``DEVICE_CONFIGS``
entry for the same product, and runs the ``fnvllm`` command after it, so the engine's CUDA graphs capture them.
``--early-trigger-rows LO-HI`` also replaces ``fused_ops.EARLY_TRIGGER_ROWS`` (the rows at which the small kernels
between projections let the next launch start before their own wait; shipped 17-64): with the lighter CUDA projections
at 2-16 rows that range is worth measuring again (the thirteenth session measured 1-64 against 17-64 with the Triton
projections: no gain at 16 rows)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.probe_cuda_skinny import chain_us  # CUDA-graph chains, best of five rounds (its calls 1-4's timer)

if TYPE_CHECKING:
    import torch

# Qwen3-0.6B's projections: name -> (kind, N, K)
SHAPES = {"qkv": ("partials", 4096, 1024), "o": ("partials", 1024, 2048), "gate_up": ("glu", 6144, 1024),
          "down": ("partials", 1024, 3072)}  # fmt: skip
MIN_GAIN_US = 0.1  # a variant must beat the path without it by this much to be proposed


def parse_entries(spec: str) -> dict[tuple[str, int, int, int], tuple[int, int, int]]:
    """NAME=KBxS[xNW]@TILE,... -> {(kind, N, K, tile): (kb, split, nw)}; ValueError naming the bad item."""
    entries = {}
    for item in filter(None, spec.split(",")):
        try:
            name, value = item.split("=")
            shape, tile = value.split("@")[0], int(value.split("@")[1])
            numbers = [int(v) for v in shape.split("x")]
            if len(numbers) not in (2, 3):
                raise ValueError("the shape is KBxS or KBxSxNW")
            kb, split, nw = (*numbers, 1)[:3]
            if name in SHAPES:
                kind, n, k = SHAPES[name]
            else:
                kind, dims = name.split(":")
                n, k = (int(v) for v in dims.split("x"))
        except (ValueError, IndexError, KeyError) as e:
            raise ValueError(f"--entries item {item!r} is not NAME=KBxS[xNW]@TILE (NAME in {sorted(SHAPES)} or "
                             f"KIND:NxK): {e}") from None  # fmt: skip
        entries[(kind, n, k, tile)] = (kb, split, nw)
    return entries


def parse_rows(spec: str) -> tuple[int, int]:
    """LO-HI -> (lo, hi) with 0 <= lo <= hi; ValueError naming the value otherwise."""
    try:
        lo, hi = (int(v) for v in spec.split("-"))
    except ValueError:
        raise ValueError(f"--early-trigger-rows must be LO-HI (e.g. 2-64), got {spec!r}") from None
    if not 0 <= lo <= hi:
        raise ValueError(f"--early-trigger-rows needs 0 <= LO <= HI, got {spec!r}")
    return lo, hi


def variants(kind: str, n: int, k: int, rows: int) -> list[tuple[int, int, int]]:
    """(kb, split, nw) launch shapes the source has a kernel for at these rows that span K and N (glu: one
    split)."""
    from fnvllm.kernels import cuda_skinny

    tile = cuda_skinny.tile_rows(rows)
    found = []
    for kind_, kb, tile_, nw in cuda_skinny._KERNELS:
        per_split = cuda_skinny.WARPS // nw * 32 * kb
        fits = k % per_split == 0 and n % (cuda_skinny.COLUMNS * nw) == 0 and (kind == "partials" or k == per_split)
        if kind_ == kind and tile_ == tile and fits:
            found.append((kb, k // per_split, nw))
    return sorted(found)


def per_weight(
    product: Callable[..., object], x: torch.Tensor, weights: list[torch.Tensor], *extra: Any
) -> list[Callable[[], object]]:
    """One call of product(x, w, *extra) for each weight copy (the chain ``chain_us`` times)."""
    return [lambda w=w: product(x, w, *extra) for w in weights]


def check(name: str, kind: str, x: torch.Tensor, w: torch.Tensor, config: Any) -> str | None:
    """None when the kernel's result matches the float32 product (see the module docstring), else what is wrong."""
    from fnvllm.kernels import cuda_skinny

    run = cuda_skinny.glu_out if kind == "glu" else cuda_skinny.skinny_partials
    wrong = result_error(kind, x, w, run(x, w, config))
    return None if wrong is None else f"{name} M={x.shape[0]} {config}: {wrong}"


def result_error(kind: str, x: torch.Tensor, w: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when got is x @ w^T as a ``kind`` product gives it (partials: their sum within 1e-4 of the float32
    product; glu: ``cuda_skinny.glu_out_matches``), else its max error."""
    import torch.nn.functional as F

    from fnvllm.kernels import cuda_skinny

    if kind == "glu":
        ref = cuda_skinny.glu_out_ref(x, w)
        ok, err = cuda_skinny.glu_out_matches(got, ref), (got.float() - ref.float()).abs().max().item()
    else:
        err = (got.sum(0) - F.linear(x.float(), w.float())).abs().max().item()
        ok = err < 1e-4
    return None if ok else f"max error {err:.3g}"


def bench_kernels(rows: list[int], reps: int, device: str = "cuda", weight_mib: int = 512) -> list[str]:
    """Check, then time, every variant of every product at each row count on ``device``, over weight copies of
    about ``weight_mib`` MiB a product; print the table and the proposed entries, and return those."""
    import torch
    import torch.nn.functional as F

    from fnvllm.kernels import cuda_skinny, skinny_gemm
    from fnvllm.kernels.fused_ops import silu_and_mul

    proposed = []
    for name, (kind, n, k) in SHAPES.items():
        copies = max(2, (weight_mib << 20) // (2 * n * k))
        weights = [(torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            if kind == "glu":
                base = [("cuBLAS + silu_and_mul", per_weight(lambda a, w: silu_and_mul(F.linear(a, w)), x, weights))]
            else:
                base = [
                    ("cuBLAS", per_weight(F.linear, x, weights)),
                    ("linear_partials as shipped", per_weight(skinny_gemm.linear_partials, x, weights)),
                ]
            run = cuda_skinny.glu_out if kind == "glu" else cuda_skinny.skinny_partials
            listed = cuda_skinny.listed_config((kind, n, k, cuda_skinny.tile_rows(m) or 0), x.device)
            if listed is not None and kind == "glu":  # (linear_partials already takes a listed partials entry)
                base.append((f"the listed {listed}", per_weight(run, x, weights, listed)))
            timed = [(label, chain_us(calls, reps)) for label, calls in base]
            best_base = min(us for _, us in timed)
            best: tuple[float, str] | None = None
            for kb, split, nw in variants(kind, n, k, m):
                config = cuda_skinny.CudaConfig(kb, split, nw)
                if config == listed:
                    continue  # timed as the shipped path
                wrong = check(name, kind, x, weights[0], config)
                if wrong is not None:
                    print(f"   FAILED the check, not timed: {wrong}", flush=True)
                    continue
                us = chain_us(per_weight(run, x, weights, config), reps)
                timed.append((f"cuda_skinny kb={kb} S={split} nw={nw}", us))
                if us < best_base - MIN_GAIN_US and (best is None or us < best[0]):
                    best = (us, f"{name}={kb}x{split}x{nw}@{cuda_skinny.tile_rows(m)}")
            mbytes = 2 * n * k / 1e6
            print(f"== {name} N={n} K={k} M={m}: {mbytes:.1f} MB of weights")
            for label, us in timed:
                print(f"   {us:7.2f} us  {mbytes / us:5.2f} TB/s  {label}", flush=True)
            if best is not None:
                proposed.append(best[1])
    print("proposed --entries " + (",".join(proposed) or "(none)"))
    return proposed


def apply_entries(entries: dict[tuple[str, int, int, int], tuple[int, int, int]]) -> None:
    """Put ``parse_entries``' entries in ``cuda_skinny.CUDA_CONFIGS`` for this process, each in place of any
    ``DEVICE_CONFIGS`` entry for its product: an entry asked for holds on every GPU model."""
    from fnvllm.kernels import cuda_skinny

    for key, (kb, split, nw) in entries.items():
        cuda_skinny.CUDA_CONFIGS[key] = cuda_skinny.CudaConfig(kb, split, nw)
        for table in cuda_skinny.DEVICE_CONFIGS.values():
            table.pop(key, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    kernels = sub.add_parser("kernels", help="check and time every variant against the path without it (GPU)")
    kernels.add_argument("--rows", default="32,64", help="comma-separated row counts, each 1-64 (default 32,64)")
    kernels.add_argument("--reps", type=int, default=20, help="graph replays a timed round (default 20)")
    run = sub.add_parser("run", help="run an fnvllm command with --entries added to CUDA_CONFIGS")
    run.add_argument("--entries", required=True, help="NAME=KBxS[xNW]@TILE,... (see the module docstring)")
    run.add_argument("--early-trigger-rows", help="LO-HI: fused_ops.EARLY_TRIGGER_ROWS for this run (shipped 17-64)")
    args, rest = parser.parse_known_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from fnvllm.kernels import cuda_skinny

    if args.mode == "run":
        apply_entries(parse_entries(args.entries))
        if args.early_trigger_rows:
            from fnvllm.kernels import fused_ops

            fused_ops.EARLY_TRIGGER_ROWS = parse_rows(args.early_trigger_rows)
        print(f"CUDA_CONFIGS: {sorted(cuda_skinny.CUDA_CONFIGS)}", flush=True)
        from fnvllm.cli import main as cli_main

        return cli_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_cuda_skinny.py kernels needs an sm_90+ CUDA GPU (griddepcontrol, NVRTC)")
    rows = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= cuda_skinny.MAX_ROWS for r in rows):
        parser.error(f"--rows must each be 1-{cuda_skinny.MAX_ROWS}, got {args.rows}")
    bench_kernels(rows, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

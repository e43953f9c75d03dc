"""Decode attention at mid-size batches (5-256 sequences, the bench's decode steps as its requests finish): the
launcher's own knobs against a grid of partition sizes, tiles, stages and merges, on the H200.

    PYTHONPATH=$PWD python3 benchmarks/sweep_decode_mid.py [--kv fp8|bf16] [--hq 16] [--batches 16,32,64,96,128,192,256]

Each batch B draws contexts U(300, 2000) (seed B), caches of 256-token blocks in random order, tables 16 blocks
wide (``max_model_len`` 4096, as the bench's graphs capture them), Hkv 8, D 128, bf16 queries, FP8 caches with
per-head scales. Every knob set is checked against the torch reference (relative error <= 1e-2, else a WRONG
line), then timed as the median CUDA-graph replay (triton.testing.do_bench, L2 flushed). One line per batch: the
fastest knobs, the launcher default's us, the fastest us, their ratio, and the next two. The FP8 lines back
``decode_attention.SMALL_BATCH_DECODE_FP8``.
"""

from __future__ import annotations

import argparse
import random

import torch
import triton

from benchmarks.bench_attention import DEV, HEAD_DIM, HKV, make_paged, rel_err
from benchmarks.bench_fp8_kv import scales, to_fp8
from fnvllm.kernels import decode_attention as dec

TABLE_BLOCKS, BLOCK = 16, 256


def candidates() -> list[dict[str, object]]:
    """The launcher default ({}) first, then the grid."""
    grid: list[dict[str, object]] = [{}]
    for partition in (512, 1024, 2048, 4096):
        for tile in (64, 128):
            for stages in (2, 3):
                for fused in (True, False):
                    grid.append({"partition_size": partition, "tile_size": tile, "num_stages": stages,
                                 "fused_reduce": fused})  # fmt: skip
    grid += [{"partition_size": p, "tile_size": 128, "num_warps": 8, "fused_reduce": True} for p in (1024, 4096)]
    return grid


def graph_us(fn) -> float:
    """Median us of one CUDA-graph replay of fn."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e3


def sweep_batch(b: int, kv: str, hq: int) -> None:
    """Print the batch's line (see the module docstring)."""
    rng = random.Random(b)
    lengths = [rng.randint(300, 2000) for _ in range(b)]
    paged = make_paged(lengths, BLOCK, HKV, HEAD_DIM, torch.bfloat16, 1.2)
    cache = to_fp8(paged, *scales(2)) if kv == "fp8" else paged
    extra = {"k_scale": cache.k_scale, "v_scale": cache.v_scale} if kv == "fp8" else {}
    tables = torch.zeros(b, TABLE_BLOCKS, dtype=torch.int32, device=DEV)
    tables[:, : paged.tables.shape[1]] = paged.tables
    q = torch.randn(b, hq, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    ref_scales = (cache.k_scale, cache.v_scale) if kv == "fp8" else ()
    ref = dec.paged_decode_attention_ref(
        q.float(), cache.k_cache, cache.v_cache, tables, paged.seq_lens, 0.088, *ref_scales
    )
    timed: list[tuple[float, dict[str, object]]] = []
    for knobs in candidates():
        out = torch.full_like(q, float("nan"))

        def run(knobs: dict[str, object] = knobs, out: torch.Tensor = out) -> torch.Tensor:
            return dec.paged_decode_attention(
                q, cache.k_cache, cache.v_cache, tables, paged.seq_lens, 0.088, out, **extra, **knobs
            )

        try:
            run()
            err = rel_err(out, ref)
            if err > 1e-2:
                print(f"WRONG B={b} {knobs}: {err:.2e}", flush=True)
                continue
            timed.append((graph_us(run), knobs))
        except Exception as e:  # a knob set this GPU or Triton refuses: reported, not fatal
            print(f"FAILED B={b} {knobs}: {type(e).__name__}: {str(e)[:100]}", flush=True)
    default = next((us for us, k in timed if not k), float("nan"))
    timed.sort(key=lambda r: r[0])
    best_us, best = timed[0]
    others = "; ".join(f"{us:.1f} {k}" for us, k in timed[1:3])
    print(f"{b:<4} {best}  {default:.1f}  {best_us:.1f}  {default / best_us:.3f}  | next: {others}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="the cache dtype")
    parser.add_argument("--hq", type=int, default=16, help="query heads (over 8 KV heads): 16 = 0.6B, 32 = 8B")
    parser.add_argument("--batches", default="16,32,64,96,128,192,256")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_decode_mid.py needs a CUDA GPU")
    print("B  best-knobs  default_us  best_us  gain")
    for b in (int(x) for x in args.batches.split(",")):
        sweep_batch(b, args.kv, args.hq)


if __name__ == "__main__":
    main()

"""Small-batch decode on the GPU: the skinny GEMM against cuBLAS, and the decode kernel's partition size.

    PYTHONPATH=$PWD python3 benchmarks/bench_small_batch.py [--json FILE]

1. Linear layers of the Qwen3-0.6B and Qwen3-8B shapes at M = 1..64 rows, bf16: ``F.linear`` (cuBLAS) against
   ``fnvllm.kernels.skinny_gemm.skinny_linear``: correctness (to bf16 rounding of the float32 product), then
   microseconds per call and TB/s of weight bytes. Each call reads a different copy of the weight (>= 256 MiB of
   copies in rotation), so the L2 cache (50 MiB) does not serve it, as in a real forward pass.
2. Decode attention (Qwen3-0.6B heads: 16 query / 8 KV, head dim 128, 256-token blocks, tables 4096 tokens wide as
   the bench's graphs capture them) at B = 1, 4, 16, 64 and contexts U(100, 356) and U(100, 2048), per partition
   size: microseconds per call (timed as CUDA-graph replays, so launch overhead is not counted).
Prints a table per part; ``--json`` appends one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fnvllm.kernels.decode_attention import auto_partition_size, paged_decode_attention
from fnvllm.kernels.skinny_gemm import skinny_config, skinny_linear

GEMMS = {
    "0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)},
}
ROWS = (1, 4, 16, 32, 64)


def graph_time_us(fn: Callable[[int], object], calls: int, repeats: int = 5) -> float:
    """Mean device microseconds of fn(i) for i in 0..calls-1, captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up: compiles
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def _rotating(fn: Callable[..., torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor], i: int) -> torch.Tensor:
    return fn(x, weights[i % len(weights)])


def bench_gemms(out: list[dict[str, object]]) -> None:
    head = f"{'shape':>5} {'gemm':>8} {'M':>3} {'cuBLAS us':>10} {'TB/s':>6} {'skinny us':>10} {'TB/s':>6}"
    print(head + f" {'x':>5}  cfg")
    for shape, gemms in GEMMS.items():
        for name, (k, n) in gemms.items():
            copies = max(2, (256 << 20) // (2 * n * k))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                exact = F.linear(x.float(), weights[0].float())
                got = skinny_linear(x, weights[0]).float()
                ok = (got - exact).abs().max().item() <= 2 * exact.abs().max().item() * 2**-8
                cublas = graph_time_us(functools.partial(_rotating, F.linear, x, weights), copies)
                ours = graph_time_us(functools.partial(_rotating, skinny_linear, x, weights), copies)
                nbytes = 2 * n * k
                row = {
                    "part": "gemm", "shape": shape, "gemm": name, "m": m, "cublas_us": round(cublas, 2),
                    "skinny_us": round(ours, 2), "correct": ok, "config": list(skinny_config(m, n, k)),
                }  # fmt: skip
                out.append(row)
                print(
                    f"{shape:>5} {name:>8} {m:>3} {cublas:>10.2f} {nbytes / cublas / 1e6:>6.2f} {ours:>10.2f} "
                    f"{nbytes / ours / 1e6:>6.2f} {cublas / ours:>5.2f}  {tuple(skinny_config(m, n, k))}"
                    f"{'' if ok else '  WRONG'}"
                )
            weights.clear()
            torch.cuda.empty_cache()


def bench_decode(out: list[dict[str, object]]) -> None:
    heads, kv_heads, dim, block, width = 16, 8, 128, 256, 16
    print(f"\n{'B':>3} {'contexts':>12} " + " ".join(f"{'p' + str(p):>8}" for p in (64, 128, 256, 512)) + "   auto")
    for b in (1, 4, 16, 64):
        for lo, hi in ((100, 356), (100, 2048)):
            rng = random.Random(b * 7 + hi)
            lens = [rng.randint(lo, hi) for _ in range(b)]
            num_blocks = b * width + 1
            k_cache = torch.randn(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            tables = torch.arange(1, num_blocks, device="cuda", dtype=torch.int32).view(b, width)
            seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
            q = torch.randn(b, heads, dim, device="cuda", dtype=torch.bfloat16)
            ref = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, partition_size=512)
            times = {}
            for p in (64, 128, 256, 512):
                got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, partition_size=p)
                assert (got.float() - ref.float()).abs().max().item() < 2e-2, (b, p)
                call = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, seq_lens, dim**-0.5)
                times[p] = graph_time_us(lambda _i, call=call, p=p: call(partition_size=p), 20)
            auto = auto_partition_size(b, kv_heads, width * block)
            out.append({"part": "decode", "b": b, "contexts": [lo, hi], "us": times, "auto": auto})
            cells = " ".join(f"{times[p]:>8.2f}" for p in times)
            print(f"{b:>3} {f'U({lo},{hi})':>12} {cells}   {auto}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="append one JSON line per measurement here")
    parser.add_argument("--skip-gemm", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_batch.py needs a CUDA GPU (it times kernels on the device)")
    out: list[dict[str, object]] = []
    if not args.skip_gemm:
        bench_gemms(out)
    bench_decode(out)
    if args.json:
        with open(args.json, "a") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""Attention kernels on one GPU: correctness, decode bandwidth with a knob sweep, FlashAttention-4, prefill.

    PYTHONPATH=$PWD python3 benchmarks/bench_attention.py [--json PATH] [--budget-s 165] [--no-sweep]

(a) every kernel against its torch reference at real and odd sizes (PASS/FAIL with the relative error);
(b) decode: B=256, context U(100, 2048) (random.Random(0)), Hq 16 / Hkv 8 / D 128, bf16, blocks of 256 and then
    16 tokens in random order over a cache 1.5x the blocks in use (~1.7 GB a tensor, far above the 50 MB L2).
    Bytes = KV actually read = sum(seq_lens) x Hkv x D x 2 (K and V) x 2 bytes; time = median of CUDA-graph
    replays under triton.testing.do_bench (which flushes L2 before each). A coordinate sweep from the defaults
    over partition_size / tile_size / num_warps / num_stages / gqa_mode / prefetch / heads_inner prints TB/s per
    config and keeps the best (the 16-token sweep starts from the 256-token best); it stops at its time share;
(c) FlashAttention-4 (flash_attn.cute.flash_attn_varlen_func, page_table + seqused_k, pack_gqa) on the same
    problem when it imports;
(d) prefill: a mixed 8192-token batch (4 chunks over cached prefixes + 1024 decode rows), TFLOP/s of the causal
    attention math (4 x D x Hq per visible query-key pair) for a few tile configs.
A summary table comes last; --json writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import time
from collections.abc import Callable

import torch
import triton
import triton.testing

from fnvllm.kernels import decode_attention as dec
from fnvllm.kernels import fused_ops
from fnvllm.kernels import prefill_attention as pre
from fnvllm.kernels import store_kv as skv
from fnvllm.kernels.decode_attention import DecodeKernelConfig

DEV = "cuda"
HQ, HKV, HEAD_DIM = 16, 8, 128
DECODE_SWEEP: tuple[tuple[dict[str, object], ...], ...] = (  # one coordinate per step; the best so far moves
    tuple({"partition_size": v} for v in (256, 512, 1024, 2048)),
    tuple({"tile_size": v} for v in (32, 64, 128)),
    tuple({"num_warps": v} for v in (2, 4, 8)),
    tuple({"num_stages": v} for v in (1, 2, 3, 4)),
    ({"gqa_mode": "sum", "tile_size": 16}, {"gqa_mode": "sum", "tile_size": 32}),
    ({"prefetch": True, "num_stages": 1}, {"heads_inner": False}),
)
PREFILL_CONFIGS = (
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
    (64, 32, 4, 4),
    (128, 32, 8, 3),
    (64, 32, 4, 3),
    (64, 32, 2, 4),
    (32, 32, 2, 4),
    (64, 64, 4, 4),
    (32, 64, 4, 3),
)


@dataclasses.dataclass
class Paged:
    """A paged KV problem on the GPU: caches, tables, lengths, and the bytes of KV a decode reads."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # (B, width) int32, random block order
    seq_lens: torch.Tensor  # (B,) int32
    kv_bytes: int


def make_paged(lengths: list[int], block_size: int, hkv: int, d: int, dtype: torch.dtype, slack: float) -> Paged:
    """Caches of slack x the needed blocks (random normal), tables drawn from a random permutation of them."""
    needed = [math.ceil(n / block_size) for n in lengths]
    width, num_blocks = max(1, max(needed)), max(1, int(sum(needed) * slack)) + 1
    perm = torch.randperm(num_blocks, device=DEV, generator=torch.Generator(DEV).manual_seed(0)).int()
    tables = torch.zeros(len(lengths), width, dtype=torch.int32, device=DEV)
    starts = [0, *itertools.accumulate(needed)]
    for i, n in enumerate(needed):
        tables[i, :n] = perm[starts[i] : starts[i] + n]
    shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape, device=DEV, dtype=dtype)
    v_cache = torch.randn(shape, device=DEV, dtype=dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    return Paged(k_cache, v_cache, tables, seq_lens, sum(lengths) * hkv * d * 2 * k_cache.element_size())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; inf when out holds a NaN/inf."""
    if not torch.isfinite(out).all():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def graph_seconds(fn: Callable[[], object]) -> float:
    """Median seconds of one CUDA-graph replay of fn (run once first to compile)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e-3


# ------------------------------------------------------------------------------------------------ (a) correctness


def check(results: dict, name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Record and print PASS/FAIL for one kernel output."""
    err = rel_err(out, ref)
    ok = err <= tol
    results["correctness"].append({"name": name, "rel_err": err, "tol": tol, "pass": ok})
    print(f"{'PASS' if ok else 'FAIL'}  {name:<58} rel {err:.2e} (tol {tol:.0e})", flush=True)


def check_decode(results: dict, name: str, lengths: list[int], hq: int, hkv: int, d: int, bs: int, dtype, **knobs):
    """Decode kernel vs reference on one batch (NaN-poisoned output)."""
    p = make_paged(lengths, bs, hkv, d, dtype, 1.2)
    q = torch.randn(len(lengths), hq, d, device=DEV, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    dec.paged_decode_attention(q, p.k_cache, p.v_cache, p.tables, p.seq_lens, d**-0.5, out, **knobs)
    ref = dec.paged_decode_attention_ref(q.float(), p.k_cache.float(), p.v_cache.float(), p.tables, p.seq_lens, d**-0.5)
    check(results, name, out, ref, 1e-5 if dtype == torch.float32 else 1e-2)


def check_prefill(results: dict, name: str, batch, hq: int, hkv: int, d: int, bs: int, dtype, **knobs) -> None:
    """Prefill kernel vs reference on (cached prefix, q_len) per sequence."""
    p = make_paged([s + n for s, n in batch], bs, hkv, d, dtype, 1.2)
    args = prefill_args(batch, p)
    q = torch.randn(int(args[0][-1]), hq, d, device=DEV, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    pre.paged_prefill_attention(q, p.k_cache, p.v_cache, *args, d**-0.5, out, **knobs)
    ref = pre.paged_prefill_attention_ref(q.float(), p.k_cache.float(), p.v_cache.float(), *args, d**-0.5)
    check(results, name, out, ref, 1e-5 if dtype == torch.float32 else 1e-2)


def prefill_args(batch, p: Paged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens_q, seq_lens, block_tables, max_seqlen_q) for a batch of (prefix, q_len)."""
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in batch)], dtype=torch.int32, device=DEV)
    return cu, p.seq_lens, p.tables, max(n for _, n in batch)


def correctness(results: dict) -> None:
    """(a): each kernel at real sizes and at odd ones (G 3, D 64, fp16/fp32, odd block sizes and lengths)."""
    rng = random.Random(1)
    real = [rng.randint(1, 2048) for _ in range(64)]
    real[:3] = [0, 1, 2048]
    for bs in (16, 256):
        check_decode(results, f"decode real bs{bs} bf16 dot", real, HQ, HKV, HEAD_DIM, bs, torch.bfloat16)
        sum_knobs = {"gqa_mode": "sum", "tile_size": 32}
        check_decode(results, f"decode real bs{bs} bf16 sum", real, HQ, HKV, HEAD_DIM, bs, torch.bfloat16, **sum_knobs)
    odd = [1, 0, 777, 32, 3001]
    check_decode(results, "decode odd G3 D64 bs32 fp16 p256", odd, 12, 4, 64, 32, torch.float16, partition_size=256)
    check_decode(results, "decode odd G3 D64 bs64 fp32 prefetch", odd, 12, 4, 64, 64, torch.float32, prefetch=True)
    mixed = ((0, 2048), (1024, 700), (3000, 17), *((rng.randint(100, 2048), 1) for _ in range(64)))
    for bs in (16, 256):
        check_prefill(results, f"prefill real mixed bs{bs} bf16", mixed, HQ, HKV, HEAD_DIM, bs, torch.bfloat16)
    odd_batch = ((0, 1), (5, 100), (77, 33), (128, 1))
    check_prefill(results, "prefill odd G3 D64 bs32 fp16", odd_batch, 12, 4, 64, 32, torch.float16)
    check_prefill(
        results, "prefill odd G3 D64 bs128 fp32 64x32", odd_batch, 12, 4, 64, 128, torch.float32, block_m=64, block_n=32
    )
    check_store_kv(results)
    check_fused(results)


def check_store_kv(results: dict) -> None:
    """store_kv at 8192 tokens (and an odd 3-token fp16 case), exact against the reference."""
    for name, (t, hkv, d, dtype) in {
        "real 8192x8x128 bf16": (8192, 8, 128, torch.bfloat16),
        "odd 3x1x64 fp16": (3, 1, 64, torch.float16),
    }.items():
        kv = torch.randn(t, 3, hkv, d, device=DEV, dtype=dtype)
        k, v = kv[:, 0], kv[:, 1]  # strided (T, Hkv, D)
        caches = [torch.zeros(t // 16 + 4, 16, hkv, d, device=DEV, dtype=dtype) for _ in range(4)]
        slots = torch.randperm(caches[0].shape[0] * 16, device=DEV)[:t]
        skv.store_kv(k, v, caches[0], caches[1], slots)
        skv.store_kv_ref(k, v, caches[2], caches[3], slots)
        check(results, f"store_kv {name} (k, exact)", caches[0], caches[2], 0.0)
        check(results, f"store_kv {name} (v, exact)", caches[1], caches[3], 0.0)


def check_fused(results: dict) -> None:
    """The fused ops at the Qwen3-0.6B sizes (bf16) and at odd sizes (fp32)."""
    for name, (t, n, h, d, inter, dtype) in {
        "real": (512, 1024, 16, 128, 3072, torch.bfloat16),
        "odd": (7, 1000, 12, 64, 1000, torch.float32),
    }.items():
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        x, res = torch.randn(t, n, device=DEV, dtype=dtype), torch.randn(t, n, device=DEV, dtype=dtype)
        w = torch.randn(n, device=DEV, dtype=dtype)
        check(results, f"rmsnorm {name}", fused_ops.rmsnorm(x, w, 1e-6), fused_ops.rmsnorm_ref(x, w, 1e-6), tol)
        got, want = fused_ops.fused_add_rmsnorm(x, res, w, 1e-6), fused_ops.fused_add_rmsnorm_ref(x, res, w, 1e-6)
        check(results, f"fused_add_rmsnorm {name} (normed)", got[0], want[0], tol)
        check(results, f"fused_add_rmsnorm {name} (residual)", got[1], want[1], 0.0)
        gu = torch.randn(t, 2 * inter, device=DEV, dtype=dtype)
        check(results, f"silu_and_mul {name}", fused_ops.silu_and_mul(gu), fused_ops.silu_and_mul_ref(gu), tol)
        qkv = torch.randn(t, h + 4, d, device=DEV, dtype=dtype)
        q, angles = qkv[:, :h], torch.rand(t, d // 2, device=DEV) * 100
        got_q, want_q = (
            fused_ops.rotary(q, angles.cos(), angles.sin()),
            fused_ops.rotary_ref(q, angles.cos(), angles.sin()),
        )
        check(results, f"rotary {name} (strided q)", got_q, want_q, tol)


# ------------------------------------------------------------------------------------------------ (b) decode


def decode_problem(block_size: int) -> tuple[torch.Tensor, Paged]:
    """The benchmark's decode batch: (q (256, 16, 128) bf16, paged KV with contexts U(100, 2048))."""
    rng = random.Random(0)
    lengths = [rng.randint(100, 2048) for _ in range(256)]
    torch.manual_seed(0)
    p = make_paged(lengths, block_size, HKV, HEAD_DIM, torch.bfloat16, 1.5)
    return torch.randn(256, HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16), p


def time_decode(q: torch.Tensor, p: Paged, cfg: DecodeKernelConfig) -> float:
    """Seconds per decode launch (partition + reduce kernels) under a CUDA graph."""
    knobs = dataclasses.asdict(cfg)
    ws = dec.make_decode_workspace(q, p.tables, p.k_cache.shape[1], cfg.partition_size)
    out = torch.empty_like(q)
    return graph_seconds(
        lambda: dec.paged_decode_attention(
            q, p.k_cache, p.v_cache, p.tables, p.seq_lens, 0.088, out, workspace=ws, **knobs
        )
    )


def describe(cfg: DecodeKernelConfig) -> str:
    """One-line knob summary."""
    return (
        f"part={cfg.partition_size:<4} tile={cfg.tile_size:<3} warps={cfg.num_warps} stages={cfg.num_stages} "
        f"{cfg.gqa_mode:<3} prefetch={int(cfg.prefetch)} heads_inner={int(cfg.heads_inner)}"
    )


def sweep_decode(label: str, q, p: Paged, start: DecodeKernelConfig, deadline: float, sweep: bool) -> dict:
    """Time `start`, then (when sweep) one coordinate step at a time; returns records and the best config."""
    records, seen = [], {}

    def measure(cfg: DecodeKernelConfig) -> float:
        if cfg not in seen:
            try:
                seen[cfg] = time_decode(q, p, cfg)
            except Exception as e:  # a config that does not compile or fit: recorded, not fatal
                seen[cfg] = math.inf
                print(f"  {label} {describe(cfg)}  failed: {type(e).__name__}: {str(e)[:80]}")
            tbs = p.kv_bytes / seen[cfg] / 1e12
            records.append({**dataclasses.asdict(cfg), "us": seen[cfg] * 1e6, "tb_s": tbs})
            print(f"  {label} {describe(cfg)}  {seen[cfg] * 1e6:8.1f} us  {tbs:5.2f} TB/s", flush=True)
        return seen[cfg]

    best = start
    for step in DECODE_SWEEP if sweep else ():
        for change in step:
            cand = dataclasses.replace(best, **change)
            if cand.tile_size > cand.partition_size or time.perf_counter() > deadline:
                continue
            if measure(cand) < measure(best):
                best = cand
    best_s = measure(best)
    return {
        "records": records,
        "best": dataclasses.asdict(best),
        "best_us": best_s * 1e6,
        "best_tb_s": p.kv_bytes / best_s / 1e12,
        "default_tb_s": p.kv_bytes / measure(start) / 1e12,
        "kv_bytes": p.kv_bytes,
        "stopped_at_budget": time.perf_counter() > deadline,
    }


def bench_decode(results: dict, budget_end: float, sweep: bool) -> None:
    """(b) for block sizes 256 then 16, and (c) FA4 on the 256-token problem."""
    start, t0 = dec.DEFAULT_DECODE_CONFIG, time.perf_counter()
    for i, bs in enumerate((256, 16)):
        q, p = decode_problem(bs)
        deadline = t0 + (budget_end - t0) * (0.55 if i == 0 else 0.8)
        res = sweep_decode(f"decode bs{bs}", q, p, start, deadline, sweep)
        results["decode"][f"bs{bs}"] = res
        best = DecodeKernelConfig(**res["best"])
        out = dec.paged_decode_attention(q, p.k_cache, p.v_cache, p.tables, p.seq_lens, 0.088, **res["best"])
        ref = dec.paged_decode_attention_ref(q, p.k_cache, p.v_cache, p.tables, p.seq_lens, 0.088)
        check(results, f"decode bench bs{bs} best config", out, ref, 1e-2)
        results["fa4"][f"bs{bs}"] = bench_fa4(q, p)
        start = best
        del q, p
        torch.cuda.empty_cache()


def bench_fa4(q: torch.Tensor, p: Paged) -> dict:
    """(c) FlashAttention-4 on the same decode problem, when flash_attn.cute imports."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        print(f"  FA4 not installed ({e})")
        return {"installed": False}
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=DEV)
    kwargs = {
        "cu_seqlens_q": cu,
        "max_seqlen_q": 1,
        "seqused_k": p.seq_lens,
        "page_table": p.tables,
        "softmax_scale": 0.088,
        "causal": True,
    }

    def run(extra: dict) -> object:
        return flash_attn_varlen_func(q, p.k_cache, p.v_cache, **kwargs, **extra)

    extra = {"pack_gqa": True}
    try:
        run(extra)
    except TypeError:
        extra = {}
        run(extra)
    seconds = triton.testing.do_bench(lambda: run(extra), warmup=5, rep=30, return_mode="median") * 1e-3
    tbs = p.kv_bytes / seconds / 1e12
    print(f"  FA4 page {p.k_cache.shape[1]} {extra}: {seconds * 1e6:.1f} us  {tbs:.2f} TB/s", flush=True)
    return {"installed": True, "us": seconds * 1e6, "tb_s": tbs, **{k: str(v) for k, v in extra.items()}}


# ------------------------------------------------------------------------------------------------ (d) prefill


def mixed_batch() -> tuple[tuple[int, int], ...]:
    """The prefill benchmark's 8192 tokens: 4 chunks over cached prefixes + 1024 decode rows, as (prefix, q_len)."""
    rng = random.Random(2)
    return ((0, 2048), (1024, 2048), (0, 1536), (3072, 1536), *((rng.randint(100, 2048), 1) for _ in range(1024)))


def bench_prefill(results: dict, deadline: float, batch: tuple[tuple[int, int], ...], block_size: int = 256) -> None:
    """(d) TFLOP/s of the prefill kernel on a mixed batch for each of PREFILL_CONFIGS, then check the best."""
    p = make_paged([s + n for s, n in batch], block_size, HKV, HEAD_DIM, torch.bfloat16, 1.5)
    args = prefill_args(batch, p)
    q = torch.randn(int(args[0][-1]), HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    flops = 4 * HEAD_DIM * HQ * sum(n * s + n * (n + 1) // 2 for s, n in batch)
    out, records = torch.empty_like(q), []
    for bm, bn, warps, stages in PREFILL_CONFIGS:
        if time.perf_counter() > deadline:
            break
        knobs = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
        try:
            seconds = graph_seconds(
                lambda k=knobs: pre.paged_prefill_attention(q, p.k_cache, p.v_cache, *args, 0.088, out, **k)
            )
        except Exception as e:  # a config that does not compile or fit
            print(f"  prefill {knobs} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        records.append({**knobs, "us": seconds * 1e6, "tflop_s": flops / seconds / 1e12})
        print(
            f"  prefill {q.shape[0]} tok {knobs}: {seconds * 1e6:8.1f} us  {flops / seconds / 1e12:6.1f} TFLOP/s",
            flush=True,
        )
    best = max(records, key=lambda r: r["tflop_s"]) if records else None
    if best is not None:
        knobs = {k: best[k] for k in ("block_m", "block_n", "num_warps", "num_stages")}
        got = pre.paged_prefill_attention(q, p.k_cache, p.v_cache, *args, 0.088, **knobs)
        check(
            results,
            "prefill bench best config",
            got,
            pre.paged_prefill_attention_ref(q, p.k_cache, p.v_cache, *args, 0.088),
            1e-2,
        )
    results["prefill"] = {"records": records, "best": best, "flops": flops}


# ------------------------------------------------------------------------------------------------ summary


def summary(results: dict) -> None:
    """The short table printed last."""
    print("\n== summary ==")
    for key, res in results["decode"].items():
        best = DecodeKernelConfig(**res["best"])
        speed = f"{res['best_tb_s']:5.2f} TB/s ({res['best_us']:7.1f} us)"
        print(f"decode {key:<6} best {speed}  {describe(best)}  (default {res['default_tb_s']:.2f} TB/s)")
    for key, res in results["fa4"].items():
        print(
            f"FA4    {key:<6} "
            + (f"{res['tb_s']:5.2f} TB/s ({res['us']:7.1f} us)" if res.get("installed") else "FA4 not installed")
        )
    best = results["prefill"].get("best")
    if best:
        print(f"prefill mixed batch: best {best['tflop_s']:.1f} TFLOP/s ({best['us']:.0f} us) {best}")
    passed = sum(r["pass"] for r in results["correctness"])
    print(f"correctness: {passed} PASS, {len(results['correctness']) - passed} FAIL")


def main() -> None:
    """Run (a)-(d) within the time budget; print the table; write --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every number to PATH")
    parser.add_argument("--budget-s", type=float, default=165.0, help="wall-clock budget; sweeps stop at their share")
    parser.add_argument("--no-sweep", action="store_true", help="time only the default decode configuration")
    args = parser.parse_args()
    t_end = time.perf_counter() + args.budget_s
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "correctness": [],
        "decode": {},
        "fa4": {},
        "prefill": {},
    }
    print(f"{results['device']}  torch {torch.__version__}  triton {triton.__version__}\n== (a) correctness ==")
    correctness(results)
    print("== (b) decode, (c) FA4 ==")
    bench_decode(results, t_end - 25, not args.no_sweep)
    print("== (d) prefill ==")
    bench_prefill(results, t_end, mixed_batch())
    summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

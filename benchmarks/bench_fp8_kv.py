"""FP8 KV cache on one GPU: the Triton kernels against the torch reference at real sizes, then decode speed.

    PYTHONPATH=$PWD python3 benchmarks/bench_fp8_kv.py [--json PATH] [--budget-s 150] [--no-sweep] [--quick]
        [--sms N]

The FP8 caches of (a)-(c) have the memory order the engine gives them (``ENGINE_FP8_LAYOUT``, the Triton backend's
``kv_layout="auto"``: head-major), and (b) also times the FP8 default over caches in the other order.

(a) correctness, bf16 queries over float8_e4m3fn caches with per-head scales (Hq 16 / Hkv 8 / D 128):
    store_kv at 8192 tokens (bit-exact against ``fp8.quantize_fp8``: mismatched bytes are counted), decode (64
    contexts U(1, 2048), blocks of 16 and 256, split-K and one partition) and the varlen prefill (a mixed batch)
    against the torch FP8 reference (tolerance 1e-2 of ||ref||), and the FP8 reference against the bf16 one on
    the same (unquantized) values, for information;
(b) decode speed on benchmarks/bench_attention.py's problem (B=256, context U(100, 2048), 256-token blocks in
    random order, caches 1.5x the blocks in use), bf16 with its default knobs and FP8 with the FP8 defaults, then
    FP8_CANDIDATES (other ``fp8_path`` choices; each checked against the reference, the "_qk8" paths against
    the reference over e4m3-rounded queries), then a short coordinate sweep around the best (partition size,
    stages, warps, tile), and once with the tiles widened to bfloat16 instead of float16 (``fp8_compute_fp16``
    off: the choice it documents; "mma" and "mma_eo" paths only, both then multiplying as "mma" in bfloat16).
    Bytes = the KV actually read: sum(seq_lens) x Hkv x D x 2 (K and V) x 2 bytes (bf16) or 1 byte (fp8). Time =
    median CUDA-graph replay (triton.testing.do_bench flushes L2). Targets (issue 20): fp8 >= 3.9 TB/s and
    >= 1.85x the bf16 tokens/s;
(b2) read probes: the same KV bytes read by a kernel that only loads them (XOR-folded, no attention math), by
    the decode kernel's access pattern (a program reads one KV head's slice of each token row: 128 contiguous
    bytes for FP8, 256 for bf16) and by wider ones (2-8 heads a program: 256-1024 contiguous bytes for FP8): what
    the pattern itself allows, apart from the kernel's work;
(c) prefill speed (the mixed 8192-token batch of bench_attention.py), bf16 vs fp8, default knobs.
A short table comes last (and once early, after the candidates); --json writes every number. --quick skips (a)
and (c) (for a short GPU call); (b2) always runs (a few seconds).
--sms N runs everything inside a CUDA green context of N SMs (``benchmarks/green.py``; the DRAM stays whole): an
H100 with 88-96 of its 132 SMs has an H200's bytes per SM, and there the FP8 kernels sat as far behind the read
probe as on an H200 (BENCHMARKS.md, twenty-ninth session). It checks first that kernels land on N SMs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time

import numpy as np
import torch
import triton
import triton.language as tl

from benchmarks.bench_attention import (
    DEV,
    HEAD_DIM,
    HKV,
    HQ,
    Paged,
    decode_problem,
    describe,
    graph_seconds,
    make_paged,
    mixed_batch,
    prefill_args,
    rel_err,
)
from benchmarks.green import limit_sms
from fnvllm.kernels import decode_attention as dec
from fnvllm.kernels import prefill_attention as pre
from fnvllm.kernels import store_kv as skv
from fnvllm.kernels.attention import kv_layout, zeros_kv_cache
from fnvllm.kernels.backends.triton import auto_kv_layout
from fnvllm.kernels.decode_attention import DecodeKernelConfig
from fnvllm.kernels.fp8 import quantize_fp8

# The memory order the engine gives FP8 caches (the Triton backend's ``kv_layout="auto"``): (a)-(c) use it.
ENGINE_FP8_LAYOUT = auto_kv_layout("fp8")

# Knob sets tried after the default (on top of the launcher's FP8 choice at B=256). The H200 call of 2026-12-02
# (02:15) measured every fp8_path at tiles of 64 and 128, 2-4 stages, 4 and 8 warps: "wgmma_qk8" at tiles of 128
# and 2-3 stages 197.8-198.2 us, level with "mma" (198.0); "wgmma" (K widened too) 256.9, the halves 209.8-285.5,
# "mma_words" 286-341, 8 warps 246-305 (docs/fp8.md; the slower paths were removed since). Kept: the closest
# ones, to follow them across Triton versions.
FP8_CANDIDATES: tuple[dict[str, object], ...] = (
    # the default before "mma_eo" (tiles of 128), and "mma_eo" at tiles of 64 (H100 on 88 SMs: 215.4 us against 217.5
    # at 128)
    {"fp8_path": "mma", "tile_size": 128, "num_stages": 3, "num_warps": 4},
    {"fp8_path": "mma_eo", "tile_size": 64, "num_stages": 3, "num_warps": 4},
    {"fp8_path": "wgmma_qk8", "tile_size": 128, "num_stages": 3, "num_warps": 4},
    {"fp8_path": "wgmma_qk8", "tile_size": 128, "num_stages": 2, "num_warps": 4},
    {"fp8_path": "wgmma_qk8", "tile_size": 64, "num_stages": 3, "num_warps": 4},
    # two KV heads a program (256 contiguous bytes a token row, as the bf16 kernel reads): H100 317-561 us against
    # "mma"'s 214 (twenty-eighth session)
    {"fp8_path": "mma_pairs", "tile_size": 64, "num_stages": 3, "num_warps": 4},
    {"fp8_path": "mma_pairs", "tile_size": 64, "num_stages": 2, "num_warps": 4},
    {"fp8_path": "mma_pairs", "tile_size": 32, "num_stages": 3, "num_warps": 4},
    {"fp8_path": "mma_pairs", "tile_size": 64, "num_stages": 3, "num_warps": 8},
    # V alone widened in its loaded layout, K as "mma" and both still staged by cp.async (unlike "mma_words", which
    # loaded both by hand). Static SASS for sm_90 (benchmarks/sass_count.py, Triton 3.6, B 256's knobs otherwise):
    # 714 / 448 / 427 instructions a warp in the tile loop, 196 / 126 / 128 registers, at tiles of 128 and 2 stages
    # / 64 and 3 / 64 and 2, against "mma"'s 1,145 at tiles of 128 (168 registers). H100 (2026-12-06, batch order):
    # 263.1 / 235.3 / 255.1 us against "mma"'s 227.7; longest first, tiles of 64 and 3 stages level with "mma".
    {"fp8_path": "mma_v16", "tile_size": 64, "num_stages": 3, "num_warps": 4},
    {"fp8_path": "mma_v16", "tile_size": 64, "num_stages": 2, "num_warps": 4},
    {"fp8_path": "mma_v16", "tile_size": 128, "num_stages": 2, "num_warps": 4},
    # the transposed products with K widened too, q in float16 (370 instructions a warp per tile of 64): on the H100
    # 11 % slower than "mma" longest first, bound by shared memory (BENCHMARKS.md, twenty-eighth session); 30 % on
    # 88-96 SMs, the H200 stand-in (twenty-ninth session)
    {"gqa_mode": "kq", "tile_size": 64, "num_stages": 3, "num_warps": 4},
)
FP8_SWEEP: tuple[tuple[dict[str, object], ...], ...] = (  # one coordinate per step; the best so far moves
    tuple({"partition_size": v} for v in (256, 512, 1024, 2048)),
    tuple({"num_stages": v} for v in (2, 3, 4)),
    tuple({"num_warps": v} for v in (4, 8)),
    tuple({"tile_size": v} for v in (64, 128)),
    ({"heads_inner": False},),
)


@dataclasses.dataclass
class Fp8Paged:
    """The FP8 copy of a Paged problem: e4m3 caches, their (Hkv,) scales, and the bytes a decode reads."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    kv_bytes: int


def to_fp8(p: Paged, k_scale: torch.Tensor, v_scale: torch.Tensor, layout: str = ENGINE_FP8_LAYOUT) -> Fp8Paged:
    """Quantize p's caches (block by block, to bound the float32 temporaries) into caches of memory order
    ``layout`` (``attention.kv_layout``; the engine's for FP8 caches unless given)."""
    k8, v8 = (zeros_kv_cache(*p.k_cache.shape, torch.float8_e4m3fn, torch.device(DEV), layout) for _ in "kv")
    step = max(1, (1 << 28) // (p.k_cache[0].numel() * 4))
    for lo in range(0, p.k_cache.shape[0], step):
        k8[lo : lo + step] = quantize_fp8(p.k_cache[lo : lo + step], k_scale)
        v8[lo : lo + step] = quantize_fp8(p.v_cache[lo : lo + step], v_scale)
    return Fp8Paged(k8, v8, k_scale, v_scale, p.kv_bytes // p.k_cache.element_size())


def scales(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head scales around 1 (k, v), so a wrong head index shows in the error."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(HKV, generator=gen) * 0.5 + 0.5).to(DEV), (torch.rand(HKV, generator=gen) * 0.5 + 0.5).to(DEV)


# ------------------------------------------------------------------------------------------------ (a) correctness


def record(results: dict, name: str, err: float, tol: float) -> None:
    """Record and print PASS/FAIL for one check."""
    ok = err <= tol
    results["correctness"].append({"name": name, "value": err, "tol": tol, "pass": ok})
    print(f"{'PASS' if ok else 'FAIL'}  {name:<62} {err:.2e} (tol {tol:.0e})", flush=True)


def check_store(results: dict) -> None:
    """store_kv into FP8 caches at 8192 x 8 x 128 from strided bf16 views: share of bytes unlike the reference."""
    t, k_scale, v_scale = 8192, *scales(1)
    kv = torch.randn(t, 3, HKV, HEAD_DIM, device=DEV, dtype=torch.bfloat16) * 4
    k, v = kv[:, 0], kv[:, 1]  # strided (T, Hkv, D)
    caches = [torch.zeros(t // 16 + 4, 16, HKV, HEAD_DIM, device=DEV).to(torch.float8_e4m3fn) for _ in range(4)]
    slots = torch.randperm(caches[0].shape[0] * 16, device=DEV)[:t]
    skv.store_kv(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    skv.store_kv_ref(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    for name, got, want in (("k", caches[0], caches[2]), ("v", caches[1], caches[3])):
        diff = (got.view(torch.uint8) != want.view(torch.uint8)).float().mean().item()
        record(results, f"store_kv fp8 8192x8x128 bf16 ({name}, share of bytes differing)", diff, 0.0)


def check_decode(results: dict, block_size: int, **knobs: object) -> None:
    """Decode over FP8 caches vs the torch FP8 reference; and that reference vs bf16 (information)."""
    rng = random.Random(3)
    lengths = [rng.randint(1, 2048) for _ in range(64)]
    lengths[:2] = [1, 2048]
    p = make_paged(lengths, block_size, HKV, HEAD_DIM, torch.bfloat16, 1.2)
    f = to_fp8(p, *scales(2))
    q = torch.randn(len(lengths), HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    args = (p.tables, p.seq_lens, HEAD_DIM**-0.5)
    dec.paged_decode_attention(q, f.k_cache, f.v_cache, *args, out, k_scale=f.k_scale, v_scale=f.v_scale, **knobs)
    ref = dec.paged_decode_attention_ref(q.float(), f.k_cache, f.v_cache, *args, f.k_scale, f.v_scale)
    label = f"decode fp8 bs{block_size} " + (" ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults")
    record(results, label, rel_err(out, ref), 1e-2)
    full = dec.paged_decode_attention_ref(q.float(), p.k_cache.float(), p.v_cache.float(), *args)
    results["fp8_vs_bf16_reference"][label] = rel_err(ref, full)
    print(f"      fp8 reference vs bf16 reference: {rel_err(ref, full):.2e} (e4m3 rounding, information)")


def check_prefill(results: dict, block_size: int) -> None:
    """The varlen prefill over FP8 caches vs the torch FP8 reference, on chunks over prefixes plus decode rows."""
    rng = random.Random(4)
    batch = ((0, 2048), (1024, 700), (3000, 17), *((rng.randint(100, 2048), 1) for _ in range(64)))
    p = make_paged([s + n for s, n in batch], block_size, HKV, HEAD_DIM, torch.bfloat16, 1.2)
    f = to_fp8(p, *scales(5))
    args = prefill_args(batch, p)
    q = torch.randn(int(args[0][-1]), HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    pre.paged_prefill_attention(
        q, f.k_cache, f.v_cache, *args, HEAD_DIM**-0.5, out, k_scale=f.k_scale, v_scale=f.v_scale
    )
    ref = pre.paged_prefill_attention_ref(q.float(), f.k_cache, f.v_cache, *args, HEAD_DIM**-0.5, f.k_scale, f.v_scale)
    record(results, f"prefill fp8 mixed bs{block_size}", rel_err(out, ref), 1e-2)


def correctness(results: dict) -> None:
    """(a); a check that raises (a knob set that does not compile here) is recorded as a FAIL, not fatal."""
    checks = [check_store]
    for bs in (16, 256):
        checks.append(lambda r, bs=bs: check_decode(r, bs))
        checks.append(lambda r, bs=bs: check_decode(r, bs, partition_size=512))
        checks.append(lambda r, bs=bs: check_prefill(r, bs))
    for check in checks:
        try:
            check(results)
        except Exception as e:  # recorded, not fatal
            record(results, f"raised {type(e).__name__}: {str(e)[:60]}", math.inf, 0.0)


# ------------------------------------------------------------------------------------------------ (b) decode


def time_decode(
    q: torch.Tensor,
    p: Paged | Fp8Paged,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cfg: DecodeKernelConfig,
    seq_order: torch.Tensor | None = None,
) -> float:
    """Seconds per decode launch under a CUDA graph, with the knobs of cfg (and the step's order, when given)."""
    knobs = {**dataclasses.asdict(cfg), "seq_order": seq_order}
    ws = dec.make_decode_workspace(q, tables, p.k_cache.shape[1], cfg.partition_size)
    out = torch.empty_like(q)
    extra = {"k_scale": p.k_scale, "v_scale": p.v_scale} if isinstance(p, Fp8Paged) else {}
    return graph_seconds(
        lambda: dec.paged_decode_attention(
            q, p.k_cache, p.v_cache, tables, seq_lens, 0.088, out, workspace=ws, **knobs, **extra
        )
    )


def describe8(cfg: DecodeKernelConfig) -> str:
    """describe(cfg) with the FP8 path."""
    return f"{describe(cfg)} path={cfg.fp8_path}"


def bench_decode(results: dict, deadline: float, sweep: bool) -> None:
    """(b): bf16 at its defaults (one partition, as the launcher picks at B=256), FP8 at its defaults, then the
    candidates and a coordinate sweep around the best; a config whose output misses the reference by more than
    1e-2 counts as failed (infinitely slow)."""
    q, p = decode_problem(256)
    f = to_fp8(p, *scales(6))
    partition = dec.auto_partition_size(q.shape[0], HKV, p.tables.shape[1] * 256)
    bf16_cfg = dataclasses.replace(dec.DEFAULT_DECODE_CONFIG, partition_size=partition)
    bf16_s = time_decode(q, p, p.tables, p.seq_lens, bf16_cfg)
    print(f"  decode bf16 {describe(bf16_cfg)}  {bf16_s * 1e6:8.1f} us  {p.kv_bytes / bf16_s / 1e12:5.2f} TB/s")
    refs = {
        rounded: dec.paged_decode_attention_ref(
            q.float().to(torch.float8_e4m3fn).float() if rounded else q,
            *(f.k_cache, f.v_cache, p.tables, p.seq_lens, 0.088, f.k_scale, f.v_scale),
        ).float()
        for rounded in (False, True)
    }
    seen: dict[DecodeKernelConfig, float] = {}
    errors: dict[str, float] = {}

    def measure(cfg: DecodeKernelConfig) -> float:
        if cfg not in seen:
            try:
                out = run_decode(q, f, p, cfg)
                err = rel_err(out, refs["_qk8" in cfg.fp8_path])
                errors[describe8(cfg)] = err
                seen[cfg] = time_decode(q, f, p.tables, p.seq_lens, cfg) if err <= 1e-2 else math.inf
                note = f"err {err:.1e}" + ("" if err <= 1e-2 else " FAIL")
            except Exception as e:  # a config that does not compile or fit: recorded, not fatal
                seen[cfg] = math.inf
                note = f"failed: {type(e).__name__}: {str(e)[:80]}"
            print(
                f"  decode fp8  {describe8(cfg)}  {seen[cfg] * 1e6:8.1f} us  {f.kv_bytes / seen[cfg] / 1e12:5.2f} TB/s"
                f"  {note}",
                flush=True,
            )
        return seen[cfg]

    start = dataclasses.replace(dec.DEFAULT_FP8_DECODE_CONFIG, partition_size=partition)
    best = start
    measure(start)
    ordered_s = time_ordered(q, f, p, start, refs[False], errors)
    other = to_fp8(p, f.k_scale, f.v_scale, layout="NHD" if ENGINE_FP8_LAYOUT == "HND" else "HND")
    other_s = time_ordered(q, other, p, start, refs[False], errors)  # what the memory order is worth
    del other
    for change in FP8_CANDIDATES if sweep else ():
        cand = dataclasses.replace(start, **change)
        if time.perf_counter() < deadline and measure(cand) < measure(best):
            best = cand
    early_summary(bf16_s, seen, f.kv_bytes)
    for step in FP8_SWEEP if sweep else ():
        for change in step:
            cand = dataclasses.replace(best, **change)
            if cand.tile_size > cand.partition_size or time.perf_counter() > deadline:
                continue
            if measure(cand) < measure(best):
                best = cand
    results["decode_errors"] = errors
    bf16_compute_s = time_bf16_compute(q, f, p, best) if best.fp8_path in ("mma", "mma_eo") else math.inf
    try:
        err = rel_err(run_decode(q, f, p, best), refs["_qk8" in best.fp8_path])
    except Exception:  # every config failed: recorded as a FAIL
        err = math.inf
    record(results, f"decode fp8 bench problem, best config ({best.fp8_path})", err, 1e-2)
    results["decode"] = {
        "bf16": {"us": bf16_s * 1e6, "tb_s": p.kv_bytes / bf16_s / 1e12, "config": dataclasses.asdict(bf16_cfg)},
        "fp8_default": {"us": measure(start) * 1e6, "tb_s": f.kv_bytes / measure(start) / 1e12},
        "fp8_default_ordered": {"us": ordered_s * 1e6, "tb_s": f.kv_bytes / ordered_s / 1e12},
        "fp8_default_ordered_other_layout": {"us": other_s * 1e6, "tb_s": f.kv_bytes / other_s / 1e12},
        "layout": ENGINE_FP8_LAYOUT,
        "fp8_best": {"us": measure(best) * 1e6, "tb_s": f.kv_bytes / measure(best) / 1e12, **dataclasses.asdict(best)},
        "fp8_bf16_compute": {"us": bf16_compute_s * 1e6, "tb_s": f.kv_bytes / bf16_compute_s / 1e12},
        "records": [{**dataclasses.asdict(c), "us": s * 1e6} for c, s in seen.items()],
        "bytes": {"bf16": p.kv_bytes, "fp8": f.kv_bytes},
    }


def time_ordered(
    q: torch.Tensor, f: Fp8Paged, p: Paged, cfg: DecodeKernelConfig, ref: torch.Tensor, errors: dict[str, float]
) -> float:
    """Seconds per launch of cfg with the sequences longest first, as a decode step stages them for the engine's
    large FP8 batches (``cuda_graphs.longest_first``), after checking its output against the reference (f's
    caches in either memory order)."""
    from fnvllm.executor.cuda_graphs import longest_first

    order = np.zeros(q.shape[0], dtype=np.int32)
    longest_first(p.seq_lens.cpu().numpy(), order)
    seq_order = torch.from_numpy(order).to(q.device)
    out = torch.full_like(q, float("nan"))
    knobs = {**dataclasses.asdict(cfg), "seq_order": seq_order, "k_scale": f.k_scale, "v_scale": f.v_scale}
    dec.paged_decode_attention(q, f.k_cache, f.v_cache, p.tables, p.seq_lens, 0.088, out, **knobs)
    err = rel_err(out.float(), ref)
    label = f"{describe8(cfg)} longest first, {kv_layout(f.k_cache)} caches"
    errors[label] = err
    s = time_decode(q, f, p.tables, p.seq_lens, cfg, seq_order) if err <= 1e-2 else math.inf
    print(f"  decode fp8  {label}  {s * 1e6:8.1f} us  {f.kv_bytes / s / 1e12:5.2f} TB/s  err {err:.1e}", flush=True)
    return s


def run_decode(q: torch.Tensor, f: Fp8Paged, p: Paged, cfg: DecodeKernelConfig) -> torch.Tensor:
    """One FP8 decode with cfg's knobs into a NaN-filled output (float32 copy)."""
    out = torch.full_like(q, float("nan"))
    dec.paged_decode_attention(
        q, f.k_cache, f.v_cache, p.tables, p.seq_lens, 0.088, out, k_scale=f.k_scale, v_scale=f.v_scale,
        **dataclasses.asdict(cfg),
    )  # fmt: skip
    return out.float()


def early_summary(bf16_s: float, seen: dict[DecodeKernelConfig, float], fp8_bytes: int) -> None:
    """The fastest FP8 configurations so far against bf16 (printed before the coordinate sweep)."""
    print("\n== early: fastest FP8 decode configs (B=256, U(100, 2048)) ==")
    print(f"| bf16 defaults | {bf16_s * 1e6:.1f} us | 1.00x |")
    for cfg, s in sorted(seen.items(), key=lambda kv: kv[1])[:6]:
        print(f"| {describe8(cfg)} | {s * 1e6:.1f} us | {fp8_bytes / s / 1e12:.2f} TB/s | {bf16_s / s:.2f}x |")
    print(flush=True)


def time_bf16_compute(q: torch.Tensor, f: Fp8Paged, p: Paged, cfg: DecodeKernelConfig) -> float:
    """Seconds per FP8 decode with the tiles widened to q's bfloat16 (the launcher's float16 choice switched off
    for this measurement only); inf when it fails."""
    chosen = dec.fp8_compute_fp16
    dec.fp8_compute_fp16 = lambda q, k_cache: False
    try:
        seconds = time_decode(q, f, p.tables, p.seq_lens, cfg)
    except Exception as e:  # recorded, not fatal
        print(f"  decode fp8 bf16-compute failed: {type(e).__name__}: {str(e)[:80]}")
        seconds = math.inf
    finally:
        dec.fp8_compute_fp16 = chosen
    print(
        f"  decode fp8  {describe(cfg)} bf16 compute  {seconds * 1e6:8.1f} us  {f.kv_bytes / seconds / 1e12:5.2f} TB/s"
    )
    return seconds


# ------------------------------------------------------------------------------------------------ (b2) read probes


@triton.jit
def _read_probe_kernel(
    k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, stride_cb, stride_ct, stride_bt, stride_cg,
    WORDS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Read what a decode program reads, and nothing else: program (g, b) walks sequence b's tokens through the
    block table, TILE at a time, and loads the WORDS consecutive 32-bit words of head group g from each token's
    K and V rows (one KV head of an FP8 cache = 32 words, of a bf16 one 64), XOR-folding them (one integer op a
    word), then stores one word so nothing is optimised away. stride_cg: words from one head group to the next
    (WORDS in the engine's token-major layout; a block's whole token run in the head-major probe layout)."""
    group, seq = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    cols = group * stride_cg + tl.arange(0, WORDS)
    acc = tl.zeros([TILE, WORDS], tl.int32)
    for t0 in range(0, seq_len, TILE):
        tok = t0 + tl.arange(0, TILE)
        live = tok < seq_len
        block = tl.load(tables_ptr + seq * stride_bt + tok // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        rows = block * stride_cb + (tok % BLOCK_SIZE) * stride_ct
        ptrs = rows[:, None] + cols[None, :]
        acc ^= tl.load(k_ptr + ptrs, mask=live[:, None], other=0) ^ tl.load(v_ptr + ptrs, mask=live[:, None], other=0)
    tl.store(out_ptr + seq * tl.num_programs(0) + group, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


PROBE_CONFIGS: tuple[tuple[int, int, int], ...] = (  # (KV heads a program reads, FP8 tile tokens (bf16: half), stages)
    (1, 128, 3),
    (1, 64, 3),
    (2, 64, 3),
    (4, 32, 3),
    (8, 16, 3),
)  # 32 KiB of K + V a tile (the (1, 64) entry: 16 KiB); ~104 registers a thread, no cp.async pipelining


def probe_seconds(
    k: torch.Tensor, v: torch.Tensor, p: Paged, heads: int, tile: int, stages: int, head_major: bool = False
) -> float:
    """Seconds per read probe over caches k, v viewed as int32 words, `heads` KV heads a program. head_major: the
    same bytes stored (blocks, Hkv, block_size, head words), so one head's tokens of a block are one contiguous
    run (FlashInfer's HND layout) instead of 128 / 256-byte pieces 1 / 2 KiB apart (one head only)."""
    kw, vw = k.view(torch.int32), v.view(torch.int32)  # (blocks, block_size, Hkv, head words)
    if head_major:
        if heads != 1:
            raise ValueError(f"head_major probes read one KV head a program, got heads={heads}")
        kw, vw = (w.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for w in (kw, vw))  # same shape, HND bytes
    words = heads * kw.shape[3]
    groups = HKV // heads
    out = torch.empty(p.seq_lens.shape[0] * groups, dtype=torch.int32, device=DEV)
    stride_cb, stride_ct = kw.stride(0), kw.stride(1)
    stride_cg = kw.stride(2) if head_major else words

    def launch() -> None:
        _read_probe_kernel[(groups, p.seq_lens.shape[0])](
            kw, vw, p.tables, p.seq_lens, out, stride_cb, stride_ct, p.tables.stride(0), stride_cg,
            WORDS=words, BLOCK_SIZE=kw.shape[1], TILE=tile, num_warps=4, num_stages=stages,
        )  # fmt: skip

    return graph_seconds(launch)


def bench_read_probes(results: dict) -> None:
    """(b2): how fast the decode problem's KV bytes can be read at all, by the decode kernel's access pattern (one
    KV head's row slice a program: 128 contiguous bytes a token for FP8, 256 for bf16) and by wider ones (2-8
    heads a program), bf16 and FP8 caches."""
    q, p = decode_problem(256)
    f = to_fp8(p, *scales(6), layout="NHD")  # the probes make their own head-major copies
    rows = []
    configs = [(heads, tile, stages, False) for heads, tile, stages in PROBE_CONFIGS]
    configs += [(1, tile, 3, True) for tile in (128, 64, 256)]  # head-major layout: one head's block contiguous
    for name, k, v, nbytes in (("fp8", f.k_cache, f.v_cache, f.kv_bytes), ("bf16", p.k_cache, p.v_cache, p.kv_bytes)):
        for heads, tile, stages, head_major in configs:
            tile = tile // k.element_size()  # the same bytes a tile for both caches
            layout = "HND" if head_major else "NHD"
            try:
                sec = probe_seconds(k, v, p, heads, tile, stages, head_major)
            except Exception as e:  # recorded, not fatal
                err = f"{type(e).__name__}: {str(e)[:80]}"
                print(f"  read probe {name} {layout} heads={heads} tile={tile}: failed: {err}")
                continue
            seg = heads * k.shape[3] * k.element_size()
            rows.append({"cache": name, "heads": heads, "tile": tile, "stages": stages, "us": sec * 1e6,
                         "tb_s": nbytes / sec / 1e12, "segment_bytes": seg, "layout": layout})  # fmt: skip
            print(
                f"  read probe {name:4s} {layout} {heads} KV head(s) a program ({seg:4d} B a token row), "
                f"tile {tile:3d}, stages {stages}: {sec * 1e6:7.1f} us  {nbytes / sec / 1e12:5.2f} TB/s",
                flush=True,
            )
    results["read_probes"] = rows
    del q


# ------------------------------------------------------------------------------------------------ (c) prefill


def bench_prefill(results: dict) -> None:
    """(c): the mixed batch, bf16 and FP8 caches, default knobs."""
    batch = mixed_batch()
    p = make_paged([s + n for s, n in batch], 256, HKV, HEAD_DIM, torch.bfloat16, 1.5)
    f = to_fp8(p, *scales(7))
    args = prefill_args(batch, p)
    q = torch.randn(int(args[0][-1]), HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    flops = 4 * HEAD_DIM * HQ * sum(n * s + n * (n + 1) // 2 for s, n in batch)
    out = torch.empty_like(q)
    bf16_s = graph_seconds(lambda: pre.paged_prefill_attention(q, p.k_cache, p.v_cache, *args, 0.088, out))
    fp8_s = graph_seconds(
        lambda: pre.paged_prefill_attention(
            q, f.k_cache, f.v_cache, *args, 0.088, out, k_scale=f.k_scale, v_scale=f.v_scale
        )
    )
    results["prefill"] = {
        "bf16": {"us": bf16_s * 1e6, "tflop_s": flops / bf16_s / 1e12},
        "fp8": {"us": fp8_s * 1e6, "tflop_s": flops / fp8_s / 1e12},
    }
    for name, s in (("bf16", bf16_s), ("fp8", fp8_s)):
        print(f"  prefill {name}: {s * 1e6:8.1f} us  {flops / s / 1e12:6.1f} TFLOP/s", flush=True)


# ------------------------------------------------------------------------------------------------ summary


def summary(results: dict) -> None:
    """The short table printed last."""
    d = results.get("decode")
    print("\n== FP8 KV summary (H200 targets: fp8 decode >= 3.9 TB/s read and >= 1.85x bf16 tokens/s) ==")
    print("| kernel | time (us) | TB/s read | tokens/s vs bf16 |")
    print("|---|---|---|---|")
    if d:
        base = d["bf16"]["us"]
        print(f"| decode bf16 (defaults) | {base:.1f} | {d['bf16']['tb_s']:.2f} | 1.00x |")
        rows = (
            ("fp8_default", "decode fp8 (defaults)"),
            ("fp8_default_ordered", f"decode fp8 (defaults, longest first: the engine's order; {d['layout']} caches)"),
            ("fp8_default_ordered_other_layout", "decode fp8 (the same over caches in the other memory order)"),
            ("fp8_best", "decode fp8 (best of sweep)"),
            ("fp8_bf16_compute", "decode fp8 (best, bf16 compute)"),
        )
        for key, label in rows:
            print(f"| {label} | {d[key]['us']:.1f} | {d[key]['tb_s']:.2f} | {base / d[key]['us']:.2f}x |")
        best = {k: d["fp8_best"][k] for k in ("partition_size", "tile_size", "num_warps", "num_stages", "fp8_path")}
        print(f"best fp8 decode knobs: {best}")
    if "prefill" in results:
        pf = results["prefill"]
        print(
            f"prefill mixed 8192 tokens: bf16 {pf['bf16']['us']:.0f} us ({pf['bf16']['tflop_s']:.1f} TFLOP/s), "
            f"fp8 {pf['fp8']['us']:.0f} us ({pf['fp8']['tflop_s']:.1f} TFLOP/s)"
        )
    for r in results.get("read_probes", ()):
        print(
            f"read probe {r['cache']:4s} {r.get('layout', 'NHD')} {r['heads']} KV head(s) a program "
            f"({r['segment_bytes']} B a token row, tile "
            f"{r['tile']}): {r['us']:.1f} us, {r['tb_s']:.2f} TB/s"
        )
    passed = sum(r["pass"] for r in results["correctness"])
    print(f"correctness: {passed} PASS, {len(results['correctness']) - passed} FAIL")


def main() -> None:
    """Run (a)-(c) within the time budget; print the table; write --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every number to PATH")
    parser.add_argument("--budget-s", type=float, default=150.0, help="seconds the decode sweep may take (after (a))")
    parser.add_argument("--no-sweep", action="store_true", help="time the defaults only")
    parser.add_argument("--quick", action="store_true", help="decode speed only: skip (a) and (c)")
    parser.add_argument("--sms", type=int, help="run in a CUDA green context of this many SMs (see the docstring)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_kv.py needs a CUDA GPU")
    green = limit_sms(args.sms) if args.sms else None
    t0 = time.perf_counter()
    results: dict = {"correctness": [], "fp8_vs_bf16_reference": {}, "device": torch.cuda.get_device_name(),
                     "sms": args.sms}  # fmt: skip
    if not args.quick:
        correctness(results)
    torch.cuda.empty_cache()
    bench_decode(results, time.perf_counter() + args.budget_s * 0.85, not args.no_sweep)
    torch.cuda.empty_cache()
    bench_read_probes(results)
    torch.cuda.empty_cache()
    if not args.quick:
        bench_prefill(results)
    results["seconds"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    summary(results)
    del green


if __name__ == "__main__":
    main()

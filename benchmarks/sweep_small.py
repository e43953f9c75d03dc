"""Budgeted on-GPU sweep of the small-batch decode kernels (H200): launch configs to paste into the tuned tables.

    PYTHONPATH=$PWD python3 benchmarks/sweep_small.py --budget-s 150 [--shapes 0.6b,8b] [--rows 1,16,64]
        [--parts attn,gemm,glu,fused,partials,step] [--json FILE]

The parts asked for run in this order, each given a share of the budget (what one leaves goes to the next), every
candidate checked against its reference before it is timed (a WRONG line, never a table entry, when not):
1. attn: decode attention (``paged_decode_attention``) at B = 1, 16, 64 sequences (block 256, tables 16 blocks
   wide as the engine's graphs capture them) against the checkout's own choice: partition sizes, tiles, warps,
   stages, the merge in-kernel or by the reduce kernel, and the first K/V tile read before the launch wait
   (``preload_kv``). Knobs are picked per batch by their time at the latency bench's contexts (U(100, 384):
   prompts of 100-128 ids plus 256 outputs), among those within GUARD of the checkout's choice at U(100, 1024).
2. gemm: the skinny GEMM (``skinny_gemm.skinny_linear``) at each (rows bucket, N, K) of the Qwen3-0.6B and 8B
   projections, against cuBLAS (``F.linear``) and the shipped config. Candidates are tried in priority order, each
   on every shape of its rows bucket (one compile serves them all), until the part's time is spent.
3. fused: the residual add + RMSNorm inside qkv / gate_up and SiLU-and-mul inside down_proj (one launch) at the
   best plain configs, against the two launches they replace (the norm / activation kernel, then the faster of
   cuBLAS and the best skinny config).
   partials: o_proj and down_proj at 2-64 rows left as K-split float32 partials (``skinny_gemm.skinny_partials``)
   for the residual add + RMSNorm after them, timed as that pair (the norm sums the partials) against the
   checkout's pair (``linear_partials``, then the norm); prints ``PARTIALS_CONFIGS`` entries where a shape wins.
Timing: CUDA-graph replays of many calls (launch overhead excluded, as in the engine's decode graphs), each call
reading a different copy of the weights or KV cache (256 MiB of copies, 5x the L2), with programmatic dependent
launch on (the default), so a kernel's prologue overlaps the one before it as in a decode step.
4. step: the whole Qwen3-0.6B decode step (28 layers + logits, one CUDA graph, device us) at B = 1, 16, 64 with the
   latency bench's contexts, under this checkout's tables ("checkout") and under them with this run's
   measurements put in ("swept"), logits compared.
Printed after each part and again last: the tables (us per call) and Python literals to paste:
``SMALL_BATCH_DECODE`` (decode_attention.py; the checkout's, with this run's picks put in), the entries of
``TUNED_CONFIGS``, ``FUSED_TIMES`` and ``PARTIALS_CONFIGS`` (skinny_gemm.py) for the cases this run measured (part 4
puts the first three in, not the partials).

Without a GPU, --smoke runs every part at tiny shapes under Triton's interpreter (checks only; times are not
device times), to test the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from benchmarks.bench_small_batch import graph_time_us
from fnvllm.kernels import fused_ops, skinny_gemm
from fnvllm.kernels.decode_attention import (
    auto_partition_size,
    fuses_reduce,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from fnvllm.kernels.reference import rmsnorm_ref
from fnvllm.kernels.skinny_gemm import Norm, SkinnyConfig, skinny_config, skinny_linear

# (K, N) of each projection: hidden -> qkv, q heads -> o, hidden -> gate|up, intermediate -> down.
GEMMS = {
    "0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)},
}
SMOKE_GEMMS = {"tiny": {"qkv": (64, 96), "o": (96, 40), "gate_up": (64, 80), "down": (80, 40)}}
HEADS = {"0.6b": (16, 8, 128), "8b": (32, 8, 128)}
ROTATE_BYTES = 256 << 20
SHARES = {"attn": 0.45, "gemm": 0.35, "glu": 0.2, "fused": 0.1, "partials": 0.15}  # of the budget; unspent moves on
# Decode contexts of the attention cases: the latency bench's first (prompts of 100-128 ids + 256 outputs), which
# picks the knobs, then a longer one that guards against knobs that only pay at short contexts (``best_attention``).
CONTEXTS = ((100, 384), (100, 1024))
LATENCY_CONTEXT = CONTEXTS[0]
BATCHES = (1, 16, 64)


START = time.perf_counter()  # the wall clock of the whole run (a caller may kill it: see --step-until-s)
_NOTES = {"printed": 0, "dropped": 0}


def note(line: str) -> None:
    """Print a WRONG / FAILED line, the first 8 only (the rest are counted), so the tables stay in a short tail."""
    if _NOTES["printed"] < 8:
        print(line, flush=True)
        _NOTES["printed"] += 1
    else:
        _NOTES["dropped"] += 1


class Timer(NamedTuple):
    """How a part times fn(i), i = 0 .. calls - 1: device us per call (a CUDA graph), or host us (smoke)."""

    us: Callable[[Callable[[int], object], int], float]


def host_time_us(fn: Callable[[int], object], calls: int) -> float:
    """Host us per call (the smoke run's stand-in for device time; meaningless as a measurement)."""
    start = time.perf_counter()
    for i in range(min(calls, 2)):
        fn(i)
    return (time.perf_counter() - start) * 1e6 / min(calls, 2)


class Budget:
    """Seconds left for a part: its share of the total plus whatever earlier parts left."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.start = time.perf_counter()
        self.part_end = self.start

    def open_part(self, share: float) -> None:
        """Start a part allowed share x the total, plus the unspent time of the parts before it."""
        self.part_end = max(self.part_end, time.perf_counter()) + share * self.total_s

    def left(self) -> float:
        """Seconds left in the current part."""
        return self.part_end - time.perf_counter()


# ---------------------------------------------------------------------------------------------- part 1: GEMMs


def bucket_of(m: int) -> int:
    """The tuned table's rows bucket of m rows (1, 16 or 64)."""
    return 1 if m <= 1 else 16 if m <= 16 else 64


def one_per_key(rows: list[dict], key: Callable[[dict], tuple]) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): rows of one table key (its rows bucket) reduced to one, the row measured at the bucket's
    own row count when there is one, else the one at the most rows; e.g. ``--rows 32,64`` measures two row counts of
    the 17-64 bucket, and a literal holding both would name its key twice (Python keeps the last silently)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        k, held = key(r), best.get(key(r))
        if held is None or (held["m"] != bucket_of(held["m"]) and (r["m"] == bucket_of(r["m"]) or r["m"] > held["m"])):
            best[k] = r
    kept = [r for r in rows if best[key(r)] is r]
    return kept, [r for r in rows if best[key(r)] is not r]


# (block_n, block_k, split_k, num_warps, num_stages, preload) per rows bucket, most promising first (a 60 s budget
# tries the first ~6 of each): one weight tile per program read before the PDL wait, then deeper K loops.
_ONE_ROW = (
    (8, 1024, 1, 4, 1, True),
    (8, 1024, 2, 4, 1, True),
    (4, 1024, 1, 4, 1, True),
    (8, 1024, 4, 4, 1, True),
    (16, 512, 2, 4, 1, True),
    (4, 2048, 1, 4, 1, True),
    (8, 512, 2, 4, 1, True),
    (16, 1024, 1, 8, 1, True),
    (4, 1024, 2, 4, 1, True),
    (8, 2048, 1, 8, 1, True),
    (16, 512, 4, 4, 1, True),
    (8, 256, 4, 4, 1, True),
    (8, 256, 2, 4, 3, False),
    (16, 256, 2, 4, 3, False),
    (4, 512, 2, 2, 1, True),
    (8, 512, 4, 4, 1, True),
)
# 16 and 64 rows: first the configs whose whole weight slice per program is one tile read before the PDL wait (K
# split so that a split is one tile), then the earlier lists' best shapes.
_SIXTEEN_ROWS = (
    (16, 1024, 1, 8, 1, True),
    (16, 1024, 2, 8, 1, True),
    (16, 1024, 3, 8, 1, True),
    (16, 512, 2, 4, 1, True),
    (32, 512, 2, 8, 1, True),
    (16, 512, 4, 4, 1, True),
    (32, 256, 4, 4, 1, True),
    (16, 256, 4, 4, 1, True),
    (32, 256, 1, 4, 1, True),
    (16, 256, 1, 4, 1, True),
    (32, 128, 4, 4, 4, False),
    (64, 128, 1, 4, 3, False),
)
_SIXTY_FOUR_ROWS = ((32, 256, 4, 4, 1, True), (16, 256, 4, 4, 1, True), (16, 512, 2, 8, 1, True),
                    (32, 256, 1, 4, 1, True), (16, 256, 2, 4, 1, True), (32, 512, 2, 8, 1, True),
                    (16, 256, 3, 4, 1, True), (32, 128, 4, 4, 4, False), (64, 128, 1, 4, 3, False),
                    (16, 256, 1, 4, 3, False), (32, 128, 2, 4, 4, False), (64, 64, 1, 4, 4, False))  # fmt: skip


def gemm_candidates(m: int) -> list[SkinnyConfig]:
    """Launch configs tried at m rows, most promising first: CUDA cores with rows unpadded at one row, tensor
    cores (rows padded to 16) above."""
    bm = 1 << max(0, (m - 1).bit_length())
    if m <= 1:
        return [SkinnyConfig(bm, *t[:5], use_dot=False, preload=t[5]) for t in _ONE_ROW]
    table = _SIXTEEN_ROWS if m <= 16 else _SIXTY_FOUR_ROWS
    return [SkinnyConfig(max(16, bm), *t[:5], preload=t[5]) for t in table]


def _gemm_ok(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """Within bf16 rounding of the float32 product."""
    return (got.float() - exact).abs().max().item() <= 2 * exact.abs().max().item() * 2**-8 + 1e-6


class GemmCase(NamedTuple):
    """One (shape, projection, rows) case: x, the weight copies, the exact product."""

    shape: str
    name: str
    m: int
    k: int
    n: int
    x: torch.Tensor
    weights: list[torch.Tensor]
    exact: torch.Tensor


def _rotating(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list, i: int) -> object:
    """fn(x, the i-th weight copy, cyclically)."""
    return fn(x, ws[i % len(ws)])


def time_gemm(timer: Timer, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], case: GemmCase) -> float:
    """us per call of fn(x, w), w cycling through the case's weight copies."""
    return timer.us(functools.partial(_rotating, fn, case.x, case.weights), len(case.weights))


def weight_copies(n: int, k: int, device: str) -> list[torch.Tensor]:
    """bf16 (n, k) weights, as many copies as rotate past L2 on a GPU (two elsewhere)."""
    copies = max(2, ROTATE_BYTES // (2 * n * k)) if device == "cuda" else 2
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]


def gemm_cases(gemms: dict[str, dict[str, tuple[int, int]]], rows: list[int], device: str) -> Iterator[GemmCase]:
    """Every (shape, projection, rows) case, weights allocated per projection (rotated past L2 on a GPU)."""
    dtype = torch.bfloat16
    for shape, projections in gemms.items():
        for name, (k, n) in projections.items():
            weights = weight_copies(n, k, device)
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                yield GemmCase(shape, name, m, k, n, x, weights, F.linear(x.float(), weights[0].float()))


def sweep_gemms(timer: Timer, budget: Budget, gemms: dict, rows: list[int], device: str, out: list[dict]) -> dict:
    """Part 1. Returns {(shape, name, m): (case, result row)} for part 2."""
    cases = {}
    for case in gemm_cases(gemms, rows, device):
        row: dict[str, object] = {"part": "gemm", "shape": case.shape, "gemm": case.name, "m": case.m}
        row |= {"n": case.n, "k": case.k, "mb": 2 * case.n * case.k / 1e6, "tried": 0, "wrong": 0}
        row["cublas_us"] = time_gemm(timer, F.linear, case)
        shipped = skinny_config(case.m, case.n, case.k)
        row["shipped_us"], row["shipped_cfg"] = (
            time_gemm(timer, functools.partial(skinny_linear, config=shipped), case),
            shipped,
        )
        row["best_us"], row["best_cfg"], row["top"] = row["shipped_us"], shipped, [(row["shipped_us"], shipped)]
        cases[(case.shape, case.name, case.m)] = (case, row)
        out.append(row)
    by_m = {m: [key for key in cases if key[2] == m] for m in rows}
    queues = {m: gemm_candidates(m) for m in rows}
    while budget.left() > 0 and any(queues.values()):
        for m in rows:  # one candidate per rows bucket in turn, on every case of that bucket
            if not queues[m] or budget.left() <= 0:
                continue
            cfg = queues[m].pop(0)
            for key in by_m[m]:
                _try_gemm(timer, cfg, *cases[key])
    return cases


def _try_gemm(timer: Timer, cfg: SkinnyConfig, case: GemmCase, row: dict) -> None:
    """Check cfg on the case (a WRONG line if it fails), time it, keep it among the row's best."""
    row["tried"] += 1
    try:
        ok = _gemm_ok(skinny_linear(case.x, case.weights[0], None, cfg), case.exact)
    except Exception as e:  # a config the compiler refuses (shared memory, registers) is skipped, not fatal
        note(f"FAILED: {case.shape} {case.name} m={case.m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
        return
    if not ok:
        row["wrong"] += 1
        note(f"WRONG: {case.shape} {case.name} m={case.m} {cfg}")
        return
    try:
        us = time_gemm(timer, functools.partial(skinny_linear, config=cfg), case)
    except Exception as e:  # e.g. a graph capture failing: reported, the sweep goes on
        note(f"FAILED timing: {case.shape} {case.name} m={case.m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
        return
    row["top"] = sorted([*row["top"], (us, cfg)], key=lambda t: t[0])[:3]
    if us < row["best_us"]:
        row["best_us"], row["best_cfg"] = us, cfg


# ---------------------------------------------------------------------------------------------- part 2: fusions


def _unfused_norm(plain: Callable, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor) -> object:
    """The residual add + RMSNorm kernel, then the projection."""
    return plain(fused_ops.fused_add_rmsnorm(x, res, nw, 1e-6)[0], w)


def _fused_norm(cfg: SkinnyConfig, x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor,
                res_out: torch.Tensor) -> object:  # fmt: skip
    """One skinny launch normalising on load."""
    return skinny_linear(x, w, None, cfg, norm=Norm(nw, 1e-6, res, res_out))


def _fused_norm_at(cfg: SkinnyConfig, res: torch.Tensor, nw: torch.Tensor, res_out: torch.Tensor) -> Callable:
    """(x, w) -> the fused norm projection at cfg."""
    return functools.partial(_fused_norm, cfg, res=res, nw=nw, res_out=res_out)


def _glu_at(cfg: SkinnyConfig) -> Callable:
    """(x, w) -> the SiLU-fused projection at cfg."""
    return functools.partial(skinny_linear, config=cfg, glu=True)


def _unfused_silu(plain: Callable, x: torch.Tensor, w: torch.Tensor) -> object:
    """The SiLU-and-mul kernel, then the projection."""
    return plain(fused_ops.silu_and_mul(x), w)


def sweep_fused(timer: Timer, budget: Budget, cases: dict, out: list[dict]) -> None:
    """Part 2: for qkv / gate_up (norm) and down (SiLU) at <= 16 rows, one fused launch at each of the plain
    product's three best configs against the two launches it replaces."""
    for (shape, name, m), (case, grow) in cases.items():
        if name == "o" or m > 16 or budget.left() <= 0:
            continue
        kind = "silu" if name == "down" else "norm"
        plain_cfg = grow["best_cfg"]
        skinny_plain = functools.partial(skinny_linear, config=plain_cfg)
        plain = F.linear if grow["cublas_us"] <= grow["best_us"] else skinny_plain
        row: dict[str, object] = {"part": "fused", "kind": kind, "shape": shape, "gemm": name, "m": m}
        row |= {"n": case.n, "k": case.k, "plain": "cublas" if plain is F.linear else "skinny"}
        if kind == "norm":
            res, res_out = torch.randn_like(case.x), torch.empty_like(case.x)
            nw = torch.rand(case.k, device=case.x.device, dtype=case.x.dtype) + 0.5
            exact = F.linear(fused_ops.fused_add_rmsnorm(case.x, res, nw, 1e-6)[0].float(), case.weights[0].float())
            x = case.x
            unfused = functools.partial(_unfused_norm, plain, res=res, nw=nw)
            make = functools.partial(_fused_norm_at, res=res, nw=nw, res_out=res_out)
        else:
            x = torch.randn(m, 2 * case.k, device=case.x.device, dtype=case.x.dtype)
            exact = F.linear(fused_ops.silu_and_mul(x).float(), case.weights[0].float())
            unfused = functools.partial(_unfused_silu, plain)
            make = _glu_at
        fcase = case._replace(x=x, exact=exact)
        row["unfused_us"] = time_gemm(timer, unfused, fcase)
        row["fused_us"], row["fused_cfg"] = float("inf"), None
        for _, cfg in grow["top"][:2]:
            fn = make(cfg)
            try:
                if not _gemm_ok(fn(x, case.weights[0]), exact):
                    note(f"WRONG: fused {kind} {shape} {name} m={m} {cfg}")
                    continue
                us = time_gemm(timer, fn, fcase)
            except Exception as e:  # reported, the sweep goes on
                note(f"FAILED: fused {kind} {shape} {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                continue
            if us < row["fused_us"]:
                row["fused_us"], row["fused_cfg"] = us, cfg
        out.append(row)


# ---------------------------------------------------------------------------------------------- glu epilogue

# (block_n, block_k, split_k, num_warps, num_stages, preload) of the gate/up projection with SiLU-and-mul in its
# epilogue (block_n even, >= 32 with tl.dot: half gate rows, half up rows), per rows bucket.
_GLU_KNOBS = {
    16: ((32, 256, 1, 4, 1, True), (32, 1024, 1, 8, 1, True), (32, 512, 1, 8, 1, True), (64, 256, 1, 4, 1, True),
         (32, 512, 2, 8, 1, True), (32, 128, 1, 4, 4, False), (64, 128, 1, 4, 3, False)),
    64: ((32, 256, 1, 4, 1, True), (64, 128, 1, 4, 3, False), (32, 128, 1, 4, 4, False), (32, 256, 2, 4, 1, True),
         (64, 64, 1, 4, 4, False), (32, 512, 2, 8, 1, True)),
}  # fmt: skip


def best_of_knobs(
    timer: Timer, budget: Budget, knobs: tuple, case: GemmCase, make: Callable[[SkinnyConfig], Callable], label: str
) -> tuple[float, SkinnyConfig | None]:
    """(us, config) of the fastest knob tuple (block_n, block_k, split_k, num_warps, num_stages, preload) at the
    case's rows whose ``make(config)(x, w)`` matches case.exact within bf16 rounding, tried in order while the
    budget lasts ((inf, None) when none did); WRONG / FAILED lines for the others."""
    best: tuple[float, SkinnyConfig | None] = (float("inf"), None)
    for t in knobs:
        if budget.left() <= 0:
            break
        cfg = SkinnyConfig(max(16, 1 << max(0, (case.m - 1).bit_length())), *t[:5], preload=t[5])
        fn = make(cfg)
        try:
            got = fn(case.x, case.weights[0]).float()
            if (got - case.exact.float()).abs().max().item() > 2 * case.exact.abs().max().item() * 2**-7:
                note(f"WRONG: {label} {case.shape} {case.name} m={case.m} {cfg}")
                continue
            us = time_gemm(timer, fn, case)
        except Exception as e:  # a config the compiler refuses is skipped
            note(f"FAILED: {label} {case.shape} {case.name} m={case.m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            continue
        if us < best[0]:
            best = (us, cfg)
    return best


def _glu_out_at(cfg: SkinnyConfig) -> Callable:
    """(x, w) -> gate/up with SiLU-and-mul in its epilogue at cfg."""
    return functools.partial(skinny_linear, config=cfg, glu_out=True)


def _linear_then_silu(x: torch.Tensor, w: torch.Tensor) -> object:
    """The checkout's gate/up projection (``skinny_gemm.linear``: cuBLAS or the skinny kernel, by its tables), then
    the SiLU-and-mul kernel: the two launches the epilogue replaces."""
    return fused_ops.silu_and_mul(skinny_gemm.linear(x, w))


def sweep_glu(timer: Timer, budget: Budget, gemms: dict, rows: list[int], device: str, out: list[dict]) -> None:
    """Part: gate/up + SiLU-and-mul as one launch (``glu_out``) at 16 and 64 rows, against the two launches."""
    for shape, projections in gemms.items():
        k, n = projections["gate_up"]
        weights = weight_copies(n, k, device)
        for m in rows:
            bucket = bucket_of(m)
            if bucket not in _GLU_KNOBS or budget.left() <= 0:
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            case = GemmCase(shape, "gate_up", m, k, n, x, weights, fused_ops.silu_and_mul(F.linear(x, weights[0])))
            row: dict[str, object] = {"part": "fused", "kind": "glu", "shape": shape, "gemm": "gate_up", "m": m}
            row |= {"n": n, "k": k, "plain": "checkout"}
            row["unfused_us"] = time_gemm(timer, _linear_then_silu, case)
            row["fused_us"], row["fused_cfg"] = best_of_knobs(
                timer, budget, _GLU_KNOBS[bucket], case, _glu_out_at, "glu"
            )
            out.append(row)
        del weights


# ---------------------------------------------------------------------------------------------- split partials

# (block_n, block_k, split_k, num_warps, num_stages, preload) of o_proj / down_proj left as split partials for the
# residual add + RMSNorm after them, per rows bucket (split_k >= 2), most promising first (the fourteenth session's
# pair measurements, BENCHMARKS.md).
_PARTIALS_KNOBS = {
    16: ((32, 512, 4, 4, 1, True), (32, 256, 8, 4, 3, False), (32, 256, 4, 4, 3, False), (32, 256, 4, 4, 1, True),
         (32, 128, 8, 4, 3, False), (16, 512, 4, 4, 1, True)),
    64: ((32, 256, 4, 4, 3, False), (16, 256, 2, 4, 3, False), (32, 128, 4, 4, 4, False), (32, 256, 2, 4, 3, False),
         (64, 128, 8, 4, 4, False), (16, 128, 4, 4, 4, False), (32, 128, 8, 4, 4, False)),
}  # fmt: skip


def _norm_after(
    project: Callable, res: torch.Tensor, nw: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """The projection of x by w (its output or its split partials), then the residual add + RMSNorm summing them:
    the normed rows."""
    return fused_ops.fused_add_rmsnorm(project(x, w), res, nw, 1e-6)[0]


def _partials_pair_at(cfg: SkinnyConfig, res: torch.Tensor, nw: torch.Tensor) -> Callable:
    """(x, w) -> the projection left as split partials at cfg, then the norm summing them."""
    return functools.partial(_norm_after, functools.partial(skinny_gemm.skinny_partials, config=cfg), res, nw)


def sweep_partials(timer: Timer, budget: Budget, gemms: dict, rows: list[int], device: str, out: list[dict]) -> None:
    """Part: o_proj and down_proj at 2-64 rows as split partials, each launch shape timed with the add + RMSNorm
    after it (which sums them) against the checkout's pair (``skinny_gemm.linear_partials``, then the norm)."""
    for shape, projections in gemms.items():
        for name in ("o", "down"):
            k, n = projections[name]
            weights = weight_copies(n, k, device)
            nw = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
            for m in rows:
                bucket = bucket_of(m)
                if bucket not in _PARTIALS_KNOBS or budget.left() <= 0:
                    continue
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                res = torch.randn(m, n, device=device, dtype=torch.bfloat16)
                exact = rmsnorm_ref(F.linear(x.float(), weights[0].float()) + res.float(), nw.float(), 1e-6)
                case = GemmCase(shape, name, m, k, n, x, weights, exact)
                row: dict[str, object] = {"part": "partials", "shape": shape, "gemm": name, "m": m, "n": n, "k": k}
                checkout = functools.partial(_norm_after, skinny_gemm.linear_partials, res, nw)
                row["checkout_us"] = time_gemm(timer, checkout, case)
                row["best_us"], row["best_cfg"] = best_of_knobs(
                    timer, budget, _PARTIALS_KNOBS[bucket], case, functools.partial(_partials_pair_at, res=res, nw=nw),
                    "partials",
                )  # fmt: skip
                out.append(row)
            del weights


# ---------------------------------------------------------------------------------------------- part 3: attention


class AttnCase(NamedTuple):
    """B sequences of contexts U(lo, hi): q, cache/table copies, seq_lens, the reference output."""

    b: int
    ctx: tuple[int, int]
    q: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    ref: torch.Tensor


def attn_case(
    b: int, ctx: tuple[int, int], heads: tuple[int, int, int], block: int, width: int, device: str
) -> AttnCase:
    """A decode attention case, with enough cache copies to cycle past L2 on a GPU."""
    hq, hkv, d = heads
    rng = random.Random(b * 7919 + ctx[1])
    lens = [rng.randint(*ctx) for _ in range(b)]
    used = sum(-(-n // block) for n in lens)
    copies = max(2, min(32, ROTATE_BYTES // (used * block * hkv * d * 4))) if device == "cuda" else 1
    caches, tables = [], []
    for _ in range(copies):
        k_cache = torch.randn(used + 1, block, hkv, d, device=device, dtype=torch.bfloat16)
        caches.append((k_cache, torch.randn_like(k_cache)))
        table, ids = torch.zeros(b, width, dtype=torch.int32), (torch.randperm(used) + 1).tolist()
        for s, n in enumerate(lens):
            nb = -(-n // block)
            table[s, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
            ids = ids[nb:]
        tables.append(table.to(device))
    q = torch.randn(b, hq, d, device=device, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, device=device, dtype=torch.int32)
    k0, v0 = caches[0]
    ref = paged_decode_attention_ref(q.float(), k0.float(), v0.float(), tables[0], seq_lens, d**-0.5)
    return AttnCase(b, ctx, q, caches, tables, seq_lens, ref)


def attn_call(case: AttnCase, knobs: dict[str, object], i: int) -> torch.Tensor:
    """paged_decode_attention on the i-th cache copy with the given knobs (an empty dict: the shipped choice)."""
    k_cache, v_cache = case.caches[i % len(case.caches)]
    table = case.tables[i % len(case.tables)]
    return paged_decode_attention(case.q, k_cache, v_cache, table, case.seq_lens, case.q.shape[-1] ** -0.5, **knobs)


# (partition, tile, warps, stages, in-kernel merge, preload_kv, prefetch), most promising first for the latency
# workload's contexts (every sequence inside one 512-token partition): one partition per (sequence, KV head) with
# its first tile read before the launch wait, then finer splits, bigger tiles, and the shipped entries unpreloaded.
_ATTN_KNOBS = (
    (4096, 64, 4, 3, True, True, False), (256, 64, 4, 3, True, True, False), (64, 64, 4, 3, False, True, False),
    (512, 64, 4, 2, True, True, False), (128, 64, 4, 3, True, True, False), (4096, 128, 8, 2, True, True, False),
    (128, 64, 4, 3, False, True, False), (4096, 64, 4, 3, True, False, False), (256, 128, 8, 2, True, True, False),
    (64, 64, 4, 3, True, True, False), (4096, 64, 8, 3, True, True, False), (1024, 64, 4, 3, True, True, False),
    (256, 64, 4, 3, False, True, False), (4096, 32, 4, 4, True, True, False), (4096, 64, 4, 1, True, True, True),
    (256, 64, 4, 3, True, False, False), (1024, 64, 4, 3, True, False, False), (512, 64, 4, 2, True, False, False),
    (128, 128, 8, 2, True, True, False), (64, 32, 4, 3, False, True, False),
)  # fmt: skip


def attn_candidates(max_context: int) -> list[dict[str, object]]:
    """Knob sets tried, most promising first (``_ATTN_KNOBS``), partitions capped at the table's width."""
    out: list[dict[str, object]] = []
    for part, tile, warps, stages, fused, preload, prefetch in _ATTN_KNOBS:
        out.append({"partition_size": min(part, max_context), "tile_size": min(tile, max_context),
                    "num_warps": warps, "num_stages": stages, "fused_reduce": fused, "preload_kv": preload,
                    "prefetch": prefetch})  # fmt: skip
    return out


def sweep_attention(timer: Timer, budget: Budget, heads: tuple[int, int, int], batches: tuple[int, ...],
                    block: int, width: int, device: str, out: list[dict]) -> None:  # fmt: skip
    """Part 3: every knob set on every (B, context) case in turn, until the part's time is spent."""
    contexts = CONTEXTS if device == "cuda" else ((10, 40), (10, 120))  # smoke: inside 8 blocks of 16
    cases = [attn_case(b, ctx, heads, block, width, device) for b in batches for ctx in contexts]
    rows = []
    for case in cases:
        auto = auto_partition_size(case.b, heads[1], block * width)
        row = {"part": "attn", "b": case.b, "ctx": case.ctx, "auto": f"p{auto} fused={fuses_reduce(case.b, heads[1])}"}
        row["auto_us"] = timer.us(functools.partial(attn_call, case, {}), len(case.caches))
        row["times"], row["knobs"] = {}, {}
        rows.append(row)
        out.append(row)
    for knobs in attn_candidates(block * width):
        if budget.left() <= 0:
            break
        label = _knob_label(knobs)
        for case, row in zip(cases, rows, strict=True):
            try:
                got = attn_call(case, knobs, 0).float()
                if (got - case.ref).abs().max().item() > 2e-2:
                    note(f"WRONG: attn b={case.b} ctx={case.ctx} {label}")
                    continue
                row["times"][label] = timer.us(functools.partial(attn_call, case, knobs), len(case.caches))
                row["knobs"][label] = knobs
            except Exception as e:  # a shape the compiler refuses is skipped
                note(f"FAILED: attn b={case.b} ctx={case.ctx} {label}: {type(e).__name__}: {str(e)[:100]}")


def _knob_label(knobs: dict[str, object]) -> str:
    """A short name of a knob set: p<partition> t<tile> w<warps> s<stages> F (in-kernel merge) or R (reduce), then
    L when the first tile is preloaded before the launch wait and P with the register prefetch."""
    merge = "F" if knobs["fused_reduce"] else "R"
    extra = ("L" if knobs.get("preload_kv") else "") + ("P" if knobs.get("prefetch") else "")
    label = f"p{knobs['partition_size']} t{knobs['tile_size']} w{knobs['num_warps']} s{knobs['num_stages']} {merge}"
    return f"{label}{extra}"


# ---------------------------------------------------------------------------------------------- part 4: step


def swept_tables(out: list[dict]) -> tuple[dict, dict, dict]:
    """(TUNED_CONFIGS, FUSED_TIMES, SMALL_BATCH_DECODE): this checkout's tables with what this sweep measured put
    in: every GEMM case's best config with its times; every fused case that ran; per batch bucket the attention
    knobs ``best_attention`` picks (buckets where the checkout's own choice won keep their entry)."""
    from fnvllm.kernels import decode_attention, skinny_gemm
    from fnvllm.kernels.decode_attention import DecodeKernelConfig
    from fnvllm.kernels.skinny_gemm import Fused, Tuned

    gemms = one_per_key([r for r in out if r["part"] == "gemm"], _tuned_key)[0]
    fused_rows = one_per_key([r for r in out if r["part"] == "fused" and r["fused_cfg"] is not None], _fused_key)[0]
    tuned = dict(skinny_gemm.TUNED_CONFIGS) | {
        _tuned_key(r): Tuned(r["best_cfg"], r["best_us"], r["cublas_us"]) for r in gemms
    }  # fmt: skip
    fused = dict(skinny_gemm.FUSED_TIMES) | {
        _fused_key(r): Fused(r["fused_cfg"], r["fused_us"], r["unfused_us"]) for r in fused_rows
    }  # fmt: skip
    decode = dict(decode_attention.SMALL_BATCH_DECODE)
    for b, (label, _) in best_attention(out).items():
        if label is not None:
            knobs = next(r["knobs"][label] for r in out if r["part"] == "attn" and label in r["knobs"])
            decode[b] = DecodeKernelConfig(**knobs)  # type: ignore[arg-type]
    return tuned, fused, decode


# A knob set is picked for a batch by its time at the first context of CONTEXTS (the latency workload's), among
# those no more than GUARD x the checkout's own choice at the others (long contexts must not pay for it).
GUARD = 1.10


def best_attention(out: list[dict]) -> dict[int, tuple[str | None, float]]:
    """Per batch size: (the knob set with the least time at the first context among those within GUARD of the
    checkout's choice at the other contexts, or None when the checkout's choice is faster or nothing qualified;
    that time)."""
    best: dict[int, tuple[str | None, float]] = {}
    for b in sorted({r["b"] for r in out if r["part"] == "attn"}):
        rows = [r for r in out if r["part"] == "attn" and r["b"] == b]
        primary, guards = rows[0], rows[1:]
        choice: tuple[str | None, float] = (None, primary["auto_us"])
        for label, us in primary["times"].items():
            guarded = all(label in r["times"] and r["times"][label] <= GUARD * r["auto_us"] for r in guards)
            if guarded and us < choice[1]:
                choice = (label, us)
        best[b] = choice
    return best


@contextlib.contextmanager
def using_tables(tuned: dict, fused: dict, decode: dict) -> Iterator[None]:
    """Within: skinny_gemm's and decode_attention's tables replaced by these (restored after)."""
    from fnvllm.kernels import decode_attention, skinny_gemm

    tables = (skinny_gemm.TUNED_CONFIGS, skinny_gemm.FUSED_TIMES, decode_attention.SMALL_BATCH_DECODE)
    saved = [dict(t) for t in tables]
    for table, new in zip(tables, (tuned, fused, decode), strict=True):
        table.clear()
        table.update(new)
    skinny_gemm.skinny_config.cache_clear()
    try:
        yield
    finally:
        for table, kept in zip(tables, saved, strict=True):
            table.clear()
            table.update(kept)
        skinny_gemm.skinny_config.cache_clear()


def step_variants() -> dict[str, tuple[str, str]]:
    """The decode steps part 4 times: label -> (model ops, tables). "checkout": this checkout's ops and tables;
    "swept attn": its GEMM tables with this run's SMALL_BATCH_DECODE; "swept": every table this run measured."""
    return {"checkout": ("triton", "none"), "swept attn": ("triton", "attn"), "swept": ("triton", "all")}


def _variant_tables(which: str, tables: tuple[dict, dict, dict]) -> contextlib.AbstractContextManager:
    """The tables a step variant runs under (``step_variants``)."""
    from fnvllm.kernels import skinny_gemm as sg

    if which == "none":
        return contextlib.nullcontext()
    if which == "attn":
        return using_tables(dict(sg.TUNED_CONFIGS), dict(sg.FUSED_TIMES), tables[2])
    return using_tables(*tables)


def sweep_step(batches: tuple[int, ...], out: list[dict], until_s: float) -> None:
    """Part 4: the whole Qwen3-0.6B decode step (28 layers + logits, one CUDA graph, device time) at the latency
    workload's contexts (``LATENCY_CONTEXT``), per ``step_variants``, logits compared with the checkout's."""
    from bench_small_batch import build_models, run_step, step_inputs

    from fnvllm.kernels.backends import get_backend

    tables = swept_tables(out)
    variants = step_variants()
    models = build_models("0.6b", {ops for ops, _ in variants.values()})
    backend = get_backend("triton")
    for b in batches:
        if time.perf_counter() - START > until_s:
            print(f"step: B={b} and larger not run (past {until_s:.0f} s of wall time)", flush=True)
            break
        ids, caches, meta = step_inputs(models["triton"], b, LATENCY_CONTEXT)
        row: dict[str, object] = {"part": "step", "b": b}
        logits = {}
        for label, (ops, which) in variants.items():
            step = functools.partial(run_step, models[ops], ids, caches, meta, backend)
            with _variant_tables(which, tables):
                try:
                    logits[label] = step(0).float()
                    row[label] = graph_time_us(step, 1, repeats=20)
                except Exception as e:  # reported in the table
                    note(f"FAILED: step b={b} {label}: {type(e).__name__}: {str(e)[:150]}")
                    row[label] = float("nan")
        for label in variants:
            if label != "checkout" and label in logits and "checkout" in logits:
                same = (logits["checkout"].argmax(-1) == logits[label].argmax(-1)).float().mean().item()
                row[f"{label} diff"] = (logits["checkout"] - logits[label]).abs().max().item()
                row[f"{label} same"] = same
        out.append(row)
        print_step([row])
        del caches


# ---------------------------------------------------------------------------------------------- output


def print_gemm(rows: list[dict]) -> None:
    """Part 1's table and the TUNED_CONFIGS literal."""
    if not rows:
        return
    print(f"\n{'shape':>5} {'gemm':>8} {'M':>3} {'MB':>6} {'cuBLAS':>7} {'shipped':>7} {'best':>7} {'TB/s':>5} "
          f"{'tried':>5} best config")  # fmt: skip
    for r in rows:
        tbs, cfg = r["mb"] / r["best_us"], tuple(r["best_cfg"])
        print(f"{r['shape']:>5} {r['gemm']:>8} {r['m']:>3} {r['mb']:>6.1f} {r['cublas_us']:>7.2f} "
              f"{r['shipped_us']:>7.2f} {r['best_us']:>7.2f} {tbs:>5.2f} {r['tried']:>5} {cfg}")  # fmt: skip
    print_tuned_literal(rows)


def print_tuned_literal(rows: list[dict]) -> None:
    """The TUNED_CONFIGS literal of part 1's rows."""
    _print_literal(
        "TUNED_CONFIGS = {  # (N, K, rows bucket): Tuned(config, skinny us, cuBLAS us)", rows, _tuned_key,
        lambda r: f"Tuned({_cfg_literal(r['best_cfg'])}, {r['best_us']:.2f}, {r['cublas_us']:.2f}),"
                  f"  # {r['shape']} {r['gemm']}",
    )  # fmt: skip


def _print_literal(header: str, rows: list[dict], key: Callable[[dict], tuple], entry: Callable[[dict], str]) -> None:
    """A table literal: ``header``, one ``key(r): entry(r)`` line per key (``one_per_key``), a comment line per row
    left out, the closing brace."""
    print(f"\n{header}")
    kept, dropped = one_per_key(rows, key)
    for r in kept:
        print(f"    {key(r)}: {entry(r)}")
    for r in dropped:
        print(f"    # {r['shape']} {r['gemm']} at {r['m']} rows: measured, left out (its bucket's entry is above)")
    print("}")


def _tuned_key(r: dict) -> tuple[int, int, int]:
    """A GEMM row's TUNED_CONFIGS / PARTIALS_CONFIGS key: (N, K, rows bucket)."""
    return (r["n"], r["k"], bucket_of(r["m"]))


def _fused_key(r: dict) -> tuple[str, int, int, int]:
    """A fused row's FUSED_TIMES key: (kind, N, K, rows bucket)."""
    return (r["kind"], r["n"], r["k"], bucket_of(r["m"]))


def _cfg_literal(cfg: SkinnyConfig) -> str:
    """SkinnyConfig(...) with only the fields that differ from the defaults named."""
    defaults = SkinnyConfig(0, 0, 0, 0)
    head = f"{cfg.block_m}, {cfg.block_n}, {cfg.block_k}, {cfg.split_k}, {cfg.num_warps}, {cfg.num_stages}"
    extra = [f"{f}={getattr(cfg, f)}" for f in ("use_dot", "fused_reduce", "preload")
             if getattr(cfg, f) != getattr(defaults, f)]  # fmt: skip
    return f"SkinnyConfig({', '.join([head, *extra])})"


def print_fused(rows: list[dict]) -> None:
    """Part 2's table and the FUSED_TIMES literal."""
    if not rows:
        return
    print(f"\n{'kind':>5} {'shape':>5} {'gemm':>8} {'M':>3} {'unfused':>8} {'(plain)':>7} {'fused':>8} config")
    for r in rows:
        cfg = tuple(r["fused_cfg"]) if r["fused_cfg"] else None
        print(f"{r['kind']:>5} {r['shape']:>5} {r['gemm']:>8} {r['m']:>3} {r['unfused_us']:>8.2f} {r['plain']:>7} "
              f"{r['fused_us']:>8.2f} {cfg}")  # fmt: skip
    print_fused_literal(rows)


def print_fused_literal(rows: list[dict]) -> None:
    """The FUSED_TIMES literal of part 2's rows."""
    _print_literal(
        "FUSED_TIMES = {  # (kind, N, K, rows bucket): Fused(config, fused us, unfused us)",
        [r for r in rows if r["fused_cfg"] is not None], _fused_key,
        lambda r: f"Fused({_cfg_literal(r['fused_cfg'])}, {r['fused_us']:.2f}, {r['unfused_us']:.2f}),"
                  f"  # {r['shape']} {r['gemm']}",
    )  # fmt: skip


def print_partials(rows: list[dict]) -> None:
    """The partials part's table (us per projection + norm pair) and its PARTIALS_CONFIGS literal."""
    if not rows:
        return
    print(f"\n{'shape':>5} {'gemm':>5} {'M':>3} {'checkout':>8} {'best':>8} best config (split partials + norm)")
    for r in rows:
        cfg = tuple(r["best_cfg"]) if r["best_cfg"] else None
        print(f"{r['shape']:>5} {r['gemm']:>5} {r['m']:>3} {r['checkout_us']:>8.2f} {r['best_us']:>8.2f} {cfg}")
    print_partials_literal(rows)


def print_partials_literal(rows: list[dict]) -> None:
    """PARTIALS_CONFIGS entries where a shape beat the checkout's pair."""
    _print_literal(
        "PARTIALS_CONFIGS = {  # (N, K, rows bucket): Tuned(config, pair us, checkout's pair us); winners only",
        [r for r in rows if r["best_cfg"] is not None and r["best_us"] < r["checkout_us"]], _tuned_key,
        lambda r: f"Tuned({_cfg_literal(r['best_cfg'])}, {r['best_us']:.2f}, {r['checkout_us']:.2f}),"
                  f"  # {r['shape']} {r['gemm']}, with the norm after it",
    )  # fmt: skip


def print_attention(rows: list[dict]) -> None:
    """Part 3: per case the shipped choice and the best knob set, then the whole matrix (us per call)."""
    if not rows:
        return
    print(f"\n{'B':>3} {'context':>10} {'auto':>16} {'auto us':>8} {'best us':>8} best")
    labels: list[str] = []
    for r in rows:
        labels += [label for label in r["times"] if label not in labels]
        best = min(r["times"].items(), key=lambda kv: kv[1], default=("-", float("nan")))
        print(f"{r['b']:>3} {r['ctx']!s:>10} {r['auto']:>16} {r['auto_us']:>8.2f} {best[1]:>8.2f} {best[0]}")
    print("\nattention matrix, us per call (rows: knob sets; columns: B/context hi):")
    print(f"{'':>22} " + " ".join(f"{r['b']:>3}/{r['ctx'][1]:<4}" for r in rows))
    print(f"{'auto':>22} " + " ".join(f"{r['auto_us']:>8.2f}" for r in rows))
    for label in labels:
        print(f"{label:>22} " + " ".join(f"{r['times'].get(label, float('nan')):>8.2f}" for r in rows))


def print_sweeps(out: list[dict]) -> None:
    """Parts 1-3's tables and literals."""
    print_gemm([r for r in out if r["part"] == "gemm"])
    print_fused([r for r in out if r["part"] == "fused"])
    print_partials([r for r in out if r["part"] == "partials"])
    print_attention([r for r in out if r["part"] == "attn"])
    print_decode_table(out)


def print_step(rows: list[dict]) -> None:
    """Part 4's table: device us per decode step, per variant."""
    if not rows:
        return
    labels = list(step_variants())
    print(
        f"\n{'B':>3} " + " ".join(f"{label:>14}" for label in labels) + "  checks vs checkout (max |diff|, argmax same)"
    )
    for r in rows:
        checks = " ".join(f"{k}={v:.3g}" for k, v in r.items() if k.endswith(("diff", "same")))
        times = " ".join(f"{r.get(label, float('nan')):>14.1f}" for label in labels)
        print(f"{r['b']:>3} {times}  {checks}")


def print_decode_table(out: list[dict]) -> None:
    """The SMALL_BATCH_DECODE literal: the checkout's entries with this run's picks (``best_attention``) put in."""
    tables = swept_tables(out)[2] if any(r["part"] == "attn" for r in out) else {}
    picks = best_attention(out)
    print("\nSMALL_BATCH_DECODE = {  # batch bucket: knobs (this run's pick at the latency context, or kept)")
    for b, cfg in sorted(tables.items()):
        label, us = picks.get(b, (None, float("nan")))
        why = f"{label}: {us:.2f} us" if label is not None else "kept (checkout's choice not beaten)"
        print(f"    {b}: {cfg!r},  # {why}")
    print("}")


def print_literals(out: list[dict]) -> None:
    """The tables to paste, compactly (printed last, so a cut tail keeps them)."""
    print("\n==== tables to paste (this run) ====")
    gemm = [r for r in out if r["part"] == "gemm"]
    if gemm:
        print_tuned_literal(gemm)
    fused = [r for r in out if r["part"] == "fused"]
    if fused:
        print_fused_literal(fused)
    partials = [r for r in out if r["part"] == "partials"]
    if partials:
        print_partials_literal(partials)
    if any(r["part"] == "attn" for r in out):
        print_decode_table(out)
    print_step([r for r in out if r["part"] == "step"])
    if _NOTES["dropped"]:
        print(f"({_NOTES['dropped']} more WRONG/FAILED lines not shown)")


def verified_tables(out: list[dict]) -> tuple[dict, dict, dict]:
    """``swept_tables``, except that at a batch size where part 4 timed the "swept" step slower than the
    checkout's (or did not time it), that size's rows bucket keeps the checkout's entries in all three tables."""
    from fnvllm.kernels import decode_attention
    from fnvllm.kernels import skinny_gemm as sg

    tuned, fused, decode = swept_tables(out)
    steps = {r["b"]: r for r in out if r["part"] == "step"}
    for b in BATCHES:
        r = steps.get(b)
        if r is not None and r.get("swept", float("nan")) < r.get("checkout", float("nan")):
            continue
        bucket = bucket_of(b)
        tuned = {k: v for k, v in tuned.items() if k[2] != bucket} | {
            k: v for k, v in sg.TUNED_CONFIGS.items() if k[2] == bucket
        }
        fused = {k: v for k, v in fused.items() if k[3] != bucket} | {
            k: v for k, v in sg.FUSED_TIMES.items() if k[3] == bucket
        }
        if b in decode_attention.SMALL_BATCH_DECODE:
            decode[b] = decode_attention.SMALL_BATCH_DECODE[b]
        else:
            decode.pop(b, None)
    return tuned, fused, decode


def write_verified_tables(out: list[dict], path: str) -> None:
    """Pickle ``verified_tables`` to path; say which batch sizes take this run's tables."""
    import pickle

    tuned, fused, decode = verified_tables(out)
    with open(path, "wb") as f:
        pickle.dump({"tuned": tuned, "fused": fused, "decode": decode}, f)
    steps = {r["b"]: r for r in out if r["part"] == "step"}
    taken = [b for b, r in steps.items() if r.get("swept", float("nan")) < r.get("checkout", float("nan"))]
    print(f"(verified tables written to {path}: this run's tables at B = {taken}, the checkout's elsewhere)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=60.0, help="seconds for parts 1-3 (setup included)")
    parser.add_argument("--shapes", default="0.6b", help="comma-separated: 0.6b, 8b")
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts (1, 16, 64 buckets)")
    parser.add_argument(
        "--parts",
        default="attn,gemm,glu,fused,partials,step",
        help="comma-separated: attn, gemm, glu, fused, partials, step",
    )
    parser.add_argument(
        "--step-until-s", type=float, default=150.0, help="wall seconds after which part 4 starts no new batch size"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter, no GPU needed")
    parser.add_argument("--json", default=None, help="append one JSON line per result here")
    parser.add_argument(
        "--tables-out", default=None, help="pickle the verified tables here (for benchmarks/latency_tables.py)"
    )
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a killed run keeps what it printed
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("sweep_small.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    device = "cpu" if smoke else "cuda"
    fused_ops.set_pdl(not smoke)  # the default on the H200; restored below
    torch.manual_seed(0)
    timer = Timer(host_time_us if smoke else graph_time_us)
    budget, parts, rows = Budget(args.budget_s), args.parts.split(","), [int(r) for r in args.rows.split(",")]
    gemms = SMOKE_GEMMS if smoke else {s: GEMMS[s] for s in args.shapes.split(",")}
    asked = sum(SHARES[p] for p in parts if p in SHARES) or 1.0
    shares = {p: SHARES[p] / asked for p in parts if p in SHARES}  # the budget split over the parts asked for
    out: list[dict] = []
    try:
        cases: dict = {}
        if "attn" in parts:  # first: the part this run is for (a kill later keeps its table)
            budget.open_part(shares["attn"])
            heads, block, width, batches = ((4, 2, 16), 16, 8, (1, 3)) if smoke else (HEADS["0.6b"], 256, 16, BATCHES)
            sweep_attention(timer, budget, heads, batches, block, width, device, out)
            print_attention([r for r in out if r["part"] == "attn"])
            print_decode_table(out)
        if "gemm" in parts or "fused" in parts:
            budget.open_part(shares.get("gemm", 0.0))
            cases = sweep_gemms(timer, budget, gemms, rows, device, out) if "gemm" in parts else {}
            print_gemm([r for r in out if r["part"] == "gemm"])
        if "glu" in parts:
            budget.open_part(shares["glu"])
            glu_gemms = SMOKE_GEMMS if smoke else {s: GEMMS[s] for s in args.shapes.split(",")}
            sweep_glu(timer, budget, glu_gemms, [m for m in rows if m > 1], device, out)
            print_fused([r for r in out if r["part"] == "fused" and r["kind"] == "glu"])
        if "fused" in parts:
            budget.open_part(shares["fused"])
            sweep_fused(timer, budget, cases, out)
            print_fused([r for r in out if r["part"] == "fused" and r["kind"] != "glu"])
        if "partials" in parts:
            budget.open_part(shares["partials"])
            sweep_partials(timer, budget, gemms, [m for m in rows if m > 1], device, out)
            print_partials([r for r in out if r["part"] == "partials"])
        print(f"\n(parts 1-3 took {time.perf_counter() - START:.0f} s of wall time)", flush=True)
        if "step" in parts and not smoke:
            fused_ops.set_pdl(fused_ops.PDL_DEFAULT)
            sweep_step(BATCHES, out, args.step_until_s)
    finally:
        fused_ops.set_pdl(fused_ops.PDL_DEFAULT)
        print_literals(out)
        print(f"\n(sweep took {time.perf_counter() - START:.0f} s, budget {args.budget_s:.0f} s)", flush=True)
        if args.tables_out:
            write_verified_tables(out, args.tables_out)
    if args.json:
        with open(args.json, "a") as f:
            for row in out:
                f.write(json.dumps({k: v for k, v in row.items() if k != "top"}, default=str) + "\n")


if __name__ == "__main__":
    main()

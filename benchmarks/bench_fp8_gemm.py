"""The FP8 weight GEMMs at Qwen3-8B sizes on one GPU: correctness, then time against bf16 and cuBLAS fp8.

    PYTHONPATH=$PWD python3 benchmarks/bench_fp8_gemm.py [--sweep] [--budget-s 100] [--json PATH] [--sms N]
        [--ceiling]

The four GEMMs of one Qwen3-8B layer (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 24576, down 12288 ->
4096), weights N(0, 1/K) quantized to e4m3 with 128 x 128 block scales (``quant.quantize_fp8_blocks``).

(a) correctness of ``fp8_linear`` (the shipped dispatch) and of each kernel at each M: relative error (Frobenius)
    against the float32 product of the same operands (bf16 activations for the streaming kernel, quantized ones
    for the fp8 tensor-core kernels and cuBLAS); tolerance 1e-2;
(b) time per GEMM and per layer at M = 1, 4, 16, 32, 64, 128, 256, 8192: bf16 (F.linear, cuBLAS), cuBLAS fp8
    (``fp8_scaled_mm``: activation quantization + ``torch._scaled_mm`` with block scales), ours: ``stream``
    (``fp8_gemm_small_m``, M <= 64), ``swap`` (quantization + ``fp8_gemm_swap``, M <= 1024), ``swap_fused``
    (``fp8_gemm_swap_bf16``: the quantization in the kernel, M <= 256), ``blockwise``
    (quantization + ``fp8_gemm_blockwise``, M >= 16) and ``shipped`` (``fp8_linear``); ``swap_ready`` times
    ``fp8_gemm_swap`` from activations quantized beforehand (its producer's job in a decode step), and
    ``swap_ready_pre1`` / ``swap_ready_pre2`` the same pick with 1 / 2 weight blocks read before the PDL wait
    (``SwapConfig.preload``), ``swap_ready_tiles`` the same pick reading the weight laid out by
    ``tile_major_weight`` (each 8 KB tile contiguous: do the (N, K) layout's 128-byte pieces cost bandwidth?).
    Each timing replays a CUDA graph of calls on enough weight copies to exceed the
    50 MB L2 (weights come from HBM), under CUDA events. TB/s counts weight bytes (fp8: 1 byte per weight + 4 per
    128 x 128 block; bf16: 2 bytes). A variant that fails (e.g. does not compile) prints its error and is left out;
(c) --sweep: coordinate descent over each kernel's launch knobs per GEMM and M (the blockwise kernel first at
    M = 256, 64, 128, where decode steps of the 8B shape run; then swap at 1, 16, blockwise at 32, the fused swap,
    swap at 32, 64; the streaming kernel last), each candidate checked for correctness before it is timed,
    stopping at --budget-s seconds; prints the best per shape beside the default pick, the per-layer sums with the
    best, and the best as TUNED_STREAM / TUNED_SWAP / TUNED_BLOCKWISE tables to paste into
    fnvllm/kernels/fp8_gemm.py.
The last table is the summary: the layer's four GEMMs summed per M for every variant.

Options for the small-M swap kernel's sweep (issue 20), e.g. within a 200 s wall budget::

    timeout 200 python3 benchmarks/bench_fp8_gemm.py --sweep --budget-s 165 --total-s 180 --ms 16 1 4 32 \\
        --variants shipped --sweep-kernels swap swap_fused

--variants limits (a) and (b); --sweep-kernels swap swap_fused replaces the fixed plan by the two swap kernels
at each --ms in the order given (the first M gets the full descent over SWAP_KNOBS, including the kernel-side
levers pdl / prefetch / tma; later ones start from the GEMM's best so far and walk SWAP_REFINE_KNOBS);
--total-s caps the sweep at that many seconds after the start. At the end: the summary, TUNED_SWAP and
SWAP_FUSED_MAX_M to paste, and the per-layer table (today's ``fp8_linear`` against the swept tables, µs and TB/s
of fp8 weight bytes per M), which is also printed before the sweep with today's numbers only.

--ceiling measures this card's read ceiling (``benchmarks/read_ceiling.py``) and prints each summary cell's rate as
a fraction of it, beside issue 20's small-M target read the same way (3.5 of the H200's 4.16 TB/s: 0.841), for a
card other than the H200.

--split-cost (e) splits each GEMM's time from ready activations at the --ms up to SWAP_MAX_M into its parts: the
shipped pick (the swap kernel and, with K splits, the launch that sums them), the kernel alone (its float32 partials
kept), the sum launch alone (on those partials), the pick without PDL, beside the weight bytes' time at the card's
read ceiling (µs per call, chains over the weight copies as in (b)).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from benchmarks.green import limit_sms
from benchmarks.read_ceiling import L2_BYTES, read_ceiling_tb_s
from fnvllm.bench import H200_READ_TB_S
from fnvllm.kernels import fp8_gemm as g
from fnvllm.kernels import fused_ops as f
from fnvllm.model.quant import quantize_fp8_blocks

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # name: (N, K)
MS = (1, 4, 16, 32, 64, 128, 256, 8192)
TOLERANCE = 1e-2
DEVICE = "cuda"  # a dry run of the script's logic may set "cpu" (with the Triton interpreter and a stub timer)
VARIANTS = ("bf16", "cublas_fp8", "stream", "swap", "swap_ready", "swap_fused", "blockwise", "shipped")
VARIANTS += ("swap_ready_pre1", "swap_ready_pre2")  # swap_ready's pick with 1 / 2 weight blocks preloaded
VARIANTS += ("swap_ready_tiles",)  # swap_ready's pick reading the weight laid out by g.tile_major_weight
STREAM_KNOBS = {
    "convert": ("asm", "asm_hoisted", "cast", "bits"),
    "reduce": ("last", "launch"),
    "swap": (True, False),
    "block_n": (32, 64, 128, 16),
    "block_k": (256, 512, 128),
    "split_k": (1, 2, 3, 4, 6, 8),
    "num_warps": (4, 8),
    "num_stages": (3, 2, 4, 5),
}
BLOCKWISE_KNOBS = {  # the most likely first: 256-token tiles and 256-row tiles spill (sm_90 SASS), so left out
    "block_m": (64, 128, 32),
    "split_k": (1, 2, 3),
    "block_n": (128, 64),
    "num_stages": (3, 4, 5),
    "num_warps": (8, 4),
}
SWAP_KNOBS = {  # most likely to matter first (a descent cut short by the budget still covers them); the levers
    # pdl / prefetch / tma are off (today's kernel) in the pick; block_t is limited to what M fills
    "split_k": (1, 2, 3, 4, 6, 8, 12, 16),
    "pdl": (False, True),
    "prefetch": (False, True),
    "num_stages": (3, 4, 5, 6, 2),
    "tma": (False, True),
    "preload": (0, 1, 2),
    "block_n": (128, 64, 256),
    "num_warps": (4, 8),
    "reduce": ("last", "launch"),
    "block_t": (16, 32, 64, 128, 256),
}
# At a token count after the first one swept, a (GEMM, kernel) descends from its best at an earlier M over these
# knobs only (its split and depth may move with M; the rest rarely does), so the budget reaches every M.
SWAP_REFINE_KNOBS = ("split_k", "num_stages", "pdl", "prefetch", "preload", "block_t", "tma")
SWAP_VARIANTS = ("swap", "swap_fused", "swap_ready")
SMALL_M_TARGET_TB_S = 3.5  # issue 20: the small-M FP8 GEMM's weight bytes at M <= 16, on the H200


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--sweep", action="store_true", help="also search the kernels' launch knobs")
    parser.add_argument("--budget-s", type=float, default=60.0, help="seconds the sweep may take")
    parser.add_argument("--ms", type=int, nargs="+", default=list(MS), help="token counts M")
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="variants (a) checks and (b) times"
    )
    parser.add_argument(
        "--sweep-kernels",
        nargs="+",
        choices=("all", *SWAP_VARIANTS),
        default=["all"],
        help="'all': the fixed plan over every kernel; else only these swap kernels at --ms, in the order given",
    )
    parser.add_argument(
        "--total-s", type=float, help="stop the sweep this many seconds after the script starts (wall budget)"
    )
    parser.add_argument(
        "--sms", type=int, help="run in a CUDA green context of this many SMs (benchmarks/green.py: an H200 stand-in)"
    )
    parser.add_argument(
        "--layer-chain",
        action="store_true",
        help="(d) time the producers and a layer's GEMMs with the ops that make their inputs, with and without "
        "the quantization launches (FNVLLM_FP8_FUSED_QUANT's two paths), at the --ms up to SWAP_MAX_M",
    )
    parser.add_argument(
        "--split-cost",
        action="store_true",
        help="(e) each GEMM's swap kernel alone, its split-sum launch alone and the pick without PDL, beside its "
        "weight bytes at the read ceiling",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="measure this card's read ceiling (benchmarks/read_ceiling.py) and print each summary cell's "
        "fraction of it beside issue 20's target as one (3.5 of the H200's 4.16 TB/s)",
    )
    return parser.parse_args()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32."""
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def time_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Mean µs of one call: a CUDA graph of all ``calls`` in order, replayed ``reps`` times under CUDA events."""
    for call in calls:  # compile and warm outside the graph
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def short(e: Exception) -> str:
    """The first line of an exception, cut to 120 characters."""
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


def fp8_weight_bytes(n: int, k: int) -> int:
    """Bytes of an (N, K) e4m3 weight with its float32 scales, one per 128 x 128 block."""
    return n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)


class Gemm:
    """One layer GEMM's weights: ``copies`` bf16 weights and their fp8 quantizations (copies: enough for L2)."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name, self.n, self.k = name, n, k
        self.copies = max(1, math.ceil(L2_BYTES / (n * k)))
        torch.manual_seed(0)
        self.bf16 = [(torch.randn(n, k, device=DEVICE) / math.sqrt(k)).bfloat16() for _ in range(self.copies)]
        self.fp8 = [quantize_fp8_blocks(w) for w in self.bf16]
        self._tiles: dict[tuple[int, int], g.TileMajorWeight] = {}

    def tiles(self, w: torch.Tensor, block_n: int) -> g.TileMajorWeight:
        """``g.tile_major_weight(w, block_n)`` of one of this GEMM's fp8 weights, made on first use (the timing
        calls each product once before it captures them, so none is made inside a CUDA graph)."""
        key = (w.data_ptr(), block_n)
        if key not in self._tiles:
            self._tiles[key] = g.tile_major_weight(w, block_n)
        return self._tiles[key]

    @property
    def fp8_bytes(self) -> int:
        """Bytes of one fp8 weight with its scales."""
        return fp8_weight_bytes(self.n, self.k)

    def x(self, m: int) -> torch.Tensor:
        """Activations (m, K) bf16, the same for a given m."""
        torch.manual_seed(m)
        return torch.randn(m, self.k, device=DEVICE).bfloat16()

    def call(
        self,
        variant: str,
        x: torch.Tensor,
        w: torch.Tensor,
        s: torch.Tensor,
        cfg: object = None,
        ready: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One product by ``variant`` (see (b) in the module docstring); cfg: a kernel config for stream/swap;
        ready: x already quantized (``quantize_activations(x)``), which ``swap_ready`` starts from (None: made here)."""
        if variant.startswith("swap_ready"):  # cfg None: the shipped pick for ready activations (TUNED_SWAP_READY)
            cfg = cfg or g.pick_ready_swap_config(x.shape[0], *w.shape, x.device)
            tiles = self.tiles(w, cfg.block_n) if variant == "swap_ready_tiles" else None  # type: ignore[attr-defined]
            if variant.startswith("swap_ready_pre"):  # that pick with N weight blocks read before the wait
                cfg = attrs.evolve(cfg, preload=int(variant[-1]))  # type: ignore[misc]
            quantized = ready or g.quantize_activations(x)
            return g.fp8_gemm_swap(*quantized, w, s, x.dtype, cfg, w_tiles=tiles)  # type: ignore[arg-type]
        if variant == "stream":
            return g.fp8_gemm_small_m(x, w, s, cfg)  # type: ignore[arg-type]
        if variant == "swap":
            return g.fp8_gemm_swap(*g.quantize_activations(x), w, s, x.dtype, cfg)  # type: ignore[arg-type]
        if variant == "swap_fused":
            return g.fp8_gemm_swap_bf16(x, w, s, cfg)  # type: ignore[arg-type]
        if variant == "blockwise":
            return g.fp8_gemm_blockwise(*g.quantize_activations(x), w, s, x.dtype, config=cfg)  # type: ignore[arg-type]
        if variant == "cublas_fp8":
            return g.fp8_scaled_mm(x, w, s)
        return g.fp8_linear(x, w, s)

    def applies(self, variant: str, m: int) -> bool:
        """Whether ``variant`` runs at M = m."""
        if variant == "stream":
            return m <= g.SMALL_M
        if variant == "swap" or variant.startswith("swap_ready"):
            return m <= 1024
        if variant == "swap_fused":
            return m <= 256
        if variant == "blockwise":
            return m >= 16
        return True

    def error(self, variant: str, m: int, cfg: object = None, repeats: int = 3) -> float:
        """Largest relative error of ``repeats`` calls of ``variant`` against the float32 product of the operands
        it uses (repeated: a split-K sum that raced would show as an occasional wrong tile)."""
        x = self.x(m)
        w, s = self.fp8[0]
        outs = [self.call(variant, x, w, s, cfg) for _ in range(repeats)]
        uses_bf16_x = variant == "stream" or (variant == "shipped" and (m <= g.STREAM_MAX_M or DEVICE != "cuda"))
        if uses_bf16_x:
            exact = g.fp8_linear_ref(x.float(), w, s)
        else:
            exact = g.fp8_blockwise_ref(*g.quantize_activations(x), w, s, torch.float32)
        return max(rel_error(out, exact) for out in outs)

    def time(self, variant: str, m: int, cfg: object = None) -> float:
        """µs per call of ``variant`` at M = m."""
        x = self.x(m)
        reps = 3 if m >= 4096 else 20
        if variant == "bf16":
            return time_us([lambda w=w: F.linear(x, w) for w in self.bf16], reps)
        ready = g.quantize_activations(x) if variant.startswith("swap_ready") else None  # once, outside the timing
        return time_us([lambda w=w, s=s: self.call(variant, x, w, s, cfg, ready) for w, s in self.fp8], reps)


def run_checks(gemms: list[Gemm], ms: list[int], record: dict, variants: tuple[str, ...] = VARIANTS) -> bool:
    """(a): every fp8 variant at every M; True when all pass (a variant that raises is reported, not failed)."""
    print("(a) correctness: relative error against the float32 product of the same operands")
    ok = True
    for gemm in gemms:
        for m in ms:
            parts = []
            for variant in variants:
                if variant == "bf16" or not gemm.applies(variant, m):
                    continue
                try:
                    err = gemm.error(variant, m)
                except Exception as e:  # a variant that cannot run is reported and skipped
                    parts.append(f"{variant} ERROR {short(e)}")
                    continue
                record["checks"][f"{gemm.name} M={m} {variant}"] = err
                ok &= err < TOLERANCE or variant != "shipped"
                parts.append(f"{variant} {err:.1e}{'' if err < TOLERANCE else ' FAIL'}")
            print(f"  {gemm.name:8} M={m:5}: " + ", ".join(parts))
    return ok


def run_times(
    gemms: list[Gemm], ms: list[int], record: dict, variants: tuple[str, ...] = VARIANTS
) -> dict[tuple[str, int, str], float]:
    """(b): µs per GEMM for every variant that applies and runs."""
    print("(b) time per GEMM (µs; TB/s of weight bytes)")
    times: dict[tuple[str, int, str], float] = {}
    for gemm in gemms:
        for m in ms:
            parts = []
            for variant in variants:
                if not gemm.applies(variant, m):
                    continue
                try:
                    us = gemm.time(variant, m)
                except Exception as e:  # reported, not fatal
                    parts.append(f"{variant} ERROR {short(e)}")
                    continue
                times[gemm.name, m, variant] = us
                record["times_us"][f"{gemm.name} M={m} {variant}"] = us
                nbytes = 2 * gemm.n * gemm.k if variant == "bf16" else gemm.fp8_bytes
                parts.append(f"{variant} {us:.1f} ({nbytes / us / 1e6:.2f})")
            print(f"  {gemm.name:8} M={m:5}: " + "  ".join(parts))
    return times


def descend(
    gemm: Gemm, variant: str, m: int, starts: list[object], knobs: dict[str, tuple], deadline: float
) -> tuple[dict[str, float], object | None]:
    """Coordinate descent from the best of configs ``starts``: each knob in turn over its values, the others at
    the best so far (a swap prefetch candidate also turns pdl on: it needs it); a candidate must pass the
    correctness check before it is timed. Returns ({repr(config): µs},
    the best config or None when none ran)."""
    results: dict[str, float] = {}
    best, best_us = None, math.inf

    def trial(cfg: object) -> float:
        key = repr(cfg)
        if key not in results:
            try:
                ok = gemm.error(variant, m, cfg) < TOLERANCE
                results[key] = gemm.time(variant, m, cfg) if ok else math.inf
            except Exception:  # e.g. out of shared memory, or a knob this GPU lacks: not a candidate
                results[key] = math.inf
        return results[key]

    for cfg in starts:
        if time.monotonic() > deadline:
            return results, best
        if (us := trial(cfg)) < best_us:
            best, best_us = cfg, us
    for knob, values in knobs.items():
        for value in values:
            if time.monotonic() > deadline:
                return results, best
            change = {knob: value, "pdl": True} if (knob, value) == ("prefetch", True) else {knob: value}
            cfg = attrs.evolve(best or starts[0], **change)  # type: ignore[misc]
            if (us := trial(cfg)) < best_us:
                best, best_us = cfg, us
    return results, best


_Best = dict[tuple[str, int, str], float]
_Cfgs = dict[tuple[str, int, str], object]
FIXED_PLAN = [("blockwise", 256), ("blockwise", 64), ("blockwise", 128), ("swap", 1), ("swap", 16), ("blockwise", 32)]
FIXED_PLAN += [("swap_fused", 1), ("swap", 32), ("swap", 64), ("swap_fused", 16), ("stream", 1), ("stream", 16)]


def _starts_and_knobs(
    gemm: Gemm, variant: str, m: int, cfgs: _Cfgs, refine: bool
) -> tuple[object, list[object], dict[str, tuple]]:
    """(the default pick, the configs a descent starts from, the knobs it walks) for ``variant`` at M = m. With
    ``refine``, a swap kernel also starts from its best at the nearest M swept before and from the other swap
    kernel's best at this M, and then walks only SWAP_REFINE_KNOBS."""
    device = torch.device(DEVICE)
    if variant == "stream":
        return (pick := g.pick_small_m_config(m, gemm.n, gemm.k, device)), [pick], STREAM_KNOBS
    if variant == "blockwise":
        return (pick := g.pick_blockwise_config(m, gemm.n, gemm.k, device)), [pick], BLOCKWISE_KNOBS
    pick_config = g.pick_ready_swap_config if variant == "swap_ready" else g.pick_swap_config
    pick = pick_config(m, gemm.n, gemm.k, device)
    fill = max(16, 1 << (m - 1).bit_length())  # no token tile wider than M needs
    knobs = {k: tuple(v for v in vs if k != "block_t" or v <= fill) for k, vs in SWAP_KNOBS.items()}
    if variant == "swap_ready":  # from ready inputs the split sum's form is the open question: walk it first
        knobs = {"reduce": knobs["reduce"], **{k: v for k, v in knobs.items() if k != "reduce"}}
    if not refine:
        return pick, [pick], knobs
    seeds = [cfg for (name, at, v), cfg in sorted(cfgs.items(), key=lambda e: abs(e[0][1] - m)) if name == gemm.name
             and v in SWAP_VARIANTS and (v, at) != (variant, m)]  # fmt: skip
    seeds = [attrs.evolve(cfg, block_t=min(cfg.block_t, fill)) for cfg in seeds[:2]]  # type: ignore[attr-defined]
    if not seeds:
        return pick, [pick], knobs
    return pick, [pick, *seeds], {k: knobs[k] for k in SWAP_REFINE_KNOBS}


def run_sweep(
    gemms: list[Gemm],
    budget_s: float,
    record: dict,
    plan: list[tuple[str, int]],
    deadline: float | None = None,
    refine_swaps: bool = False,
) -> tuple[_Best, _Cfgs]:
    """(c): the best config per (GEMM, M, kernel) in ``plan``'s order, within the budget (and ``deadline``, a
    time.monotonic() instant); each (kernel, M, GEMM) gets at most 1.5 times its share of the time left, the
    items at the plan's first M weighing three times the others.
    refine_swaps: a swap kernel swept after the GEMM's first swap descent refines (``_starts_and_knobs``)."""
    print(f"(c) sweep (coordinate descent, budget {budget_s:.0f} s)", flush=True)
    deadline = min(deadline or math.inf, time.monotonic() + budget_s)
    best_times: _Best = {}
    cfgs: _Cfgs = {}
    items = [(variant, m, gemm) for variant, m in plan for gemm in gemms]
    weights = [3.0 if m == plan[0][1] else 1.0 for _, m, _ in items]  # the first M: full descents, fresh compiles
    for i, (variant, m, gemm) in enumerate(items):
        now = time.monotonic()
        if now > deadline:
            print("  budget spent")
            break
        item_deadline = min(deadline, now + 1.5 * (deadline - now) * weights[i] / sum(weights[i:]))
        refine = refine_swaps and any(key[0] == gemm.name and key[2] in SWAP_VARIANTS for key in cfgs)
        pick, starts, knobs = _starts_and_knobs(gemm, variant, m, cfgs, refine)
        results, best = descend(gemm, variant, m, starts, knobs, item_deadline)
        finite = {k: v for k, v in results.items() if math.isfinite(v)}
        record["sweep"][f"{gemm.name} M={m} {variant}"] = finite
        if best is None or not finite:
            print(f"  {gemm.name:8} M={m:5} {variant}: nothing ran ({len(results)} tried)", flush=True)
            continue
        best_times[gemm.name, m, variant], cfgs[gemm.name, m, variant] = finite[repr(best)], best
        pick_us = finite.get(repr(pick), math.nan)
        print(f"  {gemm.name:8} M={m:5} {variant}: best {finite[repr(best)]:.1f} µs "
              f"({gemm.fp8_bytes / finite[repr(best)] / 1e6:.2f} TB/s) {compact(best)}; pick {pick_us:.1f} µs; "
              f"{len(results)} tried", flush=True)  # fmt: skip
    return best_times, cfgs


def fused_max_m(gemms: list[Gemm], ms: list[int], best: _Best) -> dict[tuple[int, int], int]:
    """Per weight (N, K): the most tokens up to which the fused swap kernel measured faster than quantization +
    swap at every swept M (SWAP_FUSED_MAX_M's entries); weights where it never led are left out."""
    out = {}
    for gemm in gemms:
        up_to = 0
        for m in sorted(ms):
            fused, plain = best.get((gemm.name, m, "swap_fused")), best.get((gemm.name, m, "swap"))
            if fused is None or (plain is not None and plain <= fused):
                break
            up_to = m
        if up_to:
            out[gemm.n, gemm.k] = up_to
    return out


def swept_choice(
    gemm: Gemm, m: int, best: _Best, cfgs: _Cfgs, fused: dict[tuple[int, int], int]
) -> tuple[str, float, object] | None:
    """(kernel, µs, config) that the swept tables would run for ``gemm`` at M = m, or None when unswept."""
    variant = "swap_fused" if m <= fused.get((gemm.n, gemm.k), 0) else "swap"
    if (gemm.name, m, variant) not in best:
        return None
    return variant, best[gemm.name, m, variant], cfgs[gemm.name, m, variant]


def compact(cfg: object) -> str:
    """``cfg``'s constructor call naming only the fields that differ from their defaults (pasteable, short)."""
    fields = attrs.fields(type(cfg))
    changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in fields if getattr(cfg, f.name) != f.default]
    return f"{type(cfg).__name__}({', '.join(changed)})"


def print_swap_tables(gemms: list[Gemm], ms: list[int], best: _Best, cfgs: _Cfgs) -> None:
    """The swept swap configs as TUNED_SWAP and SWAP_FUSED_MAX_M literals of fnvllm.kernels.fp8_gemm."""
    fused = fused_max_m(gemms, ms, best)
    print("TUNED_SWAP: dict[tuple[int, int, int], SwapConfig] = {")
    for gemm in gemms:
        for m in sorted(ms):
            choice = swept_choice(gemm, m, best, cfgs, fused)
            if choice is not None and m <= g.SWAP_MAX_M:
                note = f"{gemm.name} {choice[0]} {choice[1]:.1f} µs"
                print(f"    ({gemm.n}, {gemm.k}, {m}): {compact(choice[2])},  # {note}")
    print("}")
    print(f"SWAP_FUSED_MAX_M: dict[tuple[int, int], int] = {fused}")


def print_layer_table(
    gemms: list[Gemm], ms: list[int], times: dict[tuple[str, int, str], float], best: _Best, cfgs: _Cfgs
) -> None:
    """Per M: the layer's four GEMMs by today's dispatch (``shipped``) against the swept tables, µs (TB/s)."""
    fused = fused_max_m(gemms, ms, best)
    fp8_bytes = sum(gm.fp8_bytes for gm in gemms)
    print("\nper layer (qkv + o + gate_up + down), today's fp8_linear vs the swept swap tables: µs (TB/s of fp8 bytes)")
    print(f"{'M':>4} | {'today':>14} | {'swept':>14} | " + " | ".join(f"{gm.name:>15}" for gm in gemms))
    for m in sorted(ms):
        today = [times.get((gm.name, m, "shipped")) for gm in gemms]
        swept = [swept_choice(gm, m, best, cfgs, fused) for gm in gemms]
        cells = []
        for total in (None if None in today else sum(today), None if None in swept else sum(c[1] for c in swept)):
            cells.append(f"{'-':>14}" if total is None else f"{total:>6.1f} ({fp8_bytes / total / 1e6:.2f})")
        per = [f"{t or math.nan:>6.1f} -> {c[1] if c else math.nan:>5.1f}" for t, c in zip(today, swept, strict=True)]
        print(f"{m:>4} | {cells[0]} | {cells[1]} | " + " | ".join(per), flush=True)


def print_sweep_tables(gemms: list[Gemm], ms: list[int], best: _Best, cfgs: _Cfgs) -> None:
    """The sweep's best configs as the TUNED_STREAM / TUNED_BLOCKWISE literals (where swept), then TUNED_SWAP and
    SWAP_FUSED_MAX_M, to paste into fnvllm/kernels/fp8_gemm.py."""
    for variant, name in (("stream", "TUNED_STREAM"), ("blockwise", "TUNED_BLOCKWISE")):
        lines = [f"    ({gm.n}, {gm.k}, {m}): {compact(cfg)},  # {gm.name} {best[key]:.1f} µs"
                 for gm in gemms for (nm, m, v), cfg in sorted(cfgs.items()) if nm == gm.name and v == variant
                 for key in [(nm, m, v)]]  # fmt: skip
        if lines:
            print(f"{name} = {{", *lines, "}", sep="\n")
    print_swap_tables(gemms, sorted({m for _, m, v in cfgs if v in SWAP_VARIANTS} | set(ms)), best, cfgs)


def print_summary(
    gemms: list[Gemm],
    ms: list[int],
    times: dict[tuple[str, int, str], float],
    best: dict[tuple[str, int, str], float],
    variants: tuple[str, ...] = VARIANTS,
    ceiling_tb_s: float | None = None,
) -> None:
    """The layer's four GEMMs summed per M and variant: µs (TB/s of weight bytes, and with ``ceiling_tb_s`` that
    rate's fraction of the card's read ceiling); "best" rows from the sweep."""
    fp8_bytes, bf16_bytes = sum(gm.fp8_bytes for gm in gemms), sum(2 * gm.n * gm.k for gm in gemms)
    print("\nsummary: one Qwen3-8B layer's four GEMMs (qkv, o, gate_up, down), µs (TB/s of weight bytes)")
    width = 16
    if ceiling_tb_s is not None:
        target = SMALL_M_TARGET_TB_S / H200_READ_TB_S
        print(
            f"  [fraction of this card's read ceiling, {ceiling_tb_s:.3f} TB/s; issue 20's small-M target "
            f"{SMALL_M_TARGET_TB_S} of the H200's {H200_READ_TB_S} = {target:.3f}]"
        )
        width = 24
    swept = sorted({variant for _, _, variant in best}, key=VARIANTS.index)
    columns = [*variants, *(f"{variant} best" for variant in swept)]
    print(f"{'M':>6} | " + " | ".join(f"{c:>{width}}" for c in columns))
    for m in ms:
        cells = []
        for column in columns:
            source, variant = (best, column.split()[0]) if column.endswith("best") else (times, column)
            parts = [source.get((gm.name, m, variant)) for gm in gemms]
            if None in parts:
                cells.append(f"{'-':>{width}}")
                continue
            us = sum(p or 0.0 for p in parts)
            rate = (bf16_bytes if variant == "bf16" else fp8_bytes) / us / 1e6
            share = "" if ceiling_tb_s is None else f" [{rate / ceiling_tb_s:.3f}]"
            cells.append(f"{us:>9.1f} ({rate:.2f}){share}")
        print(f"{m:>6} | " + " | ".join(cells))


# ---- (d) the producers of FP8 activations and one layer's chain ---------------------------------------------------

NORM_EPS = 1e-6
PRODUCER_REPEATS = 16  # calls of one producer per graph (activations stay in L2, as in a decode step)


def producer_calls(m: int, hidden: int, inter: int) -> dict[str, Callable[[], object]]:
    """One call of each op that makes a GEMM input at M = m, unfused (16-bit out, then ``quantize_activations``
    separately) and fused (``*_quant``: fp8 out)."""
    torch.manual_seed(m)
    x, res = (torch.randn(m, hidden, device=DEVICE).bfloat16() for _ in range(2))
    gate_up = torch.randn(m, 2 * inter, device=DEVICE).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).bfloat16()
    act = torch.randn(m, inter, device=DEVICE).bfloat16()
    return {
        "add_rmsnorm": lambda: f.fused_add_rmsnorm(x, res, w, NORM_EPS),
        "add_rmsnorm_quant": lambda: f.fused_add_rmsnorm_quant(x, res, w, NORM_EPS),
        "quantize (hidden)": lambda: g.quantize_activations(x),
        "silu_and_mul": lambda: f.silu_and_mul(gate_up),
        "silu_and_mul_quant": lambda: f.silu_and_mul_quant(gate_up),
        "quantize (inter)": lambda: g.quantize_activations(act),
    }


CHAIN_MODES = ("unfused", "fused", "fused+sums")  # FNVLLM_FP8_FUSED_QUANT=0, =1, =1 with FNVLLM_FP8_NORM_SUMS_SPLITS=1


def layer_chain(gemms: list[Gemm], m: int, mode: str) -> list[Callable[[], torch.Tensor]]:
    """One call per weight copy of a layer's GEMMs with the ops that make their inputs, each layer from the one
    before (its down output and residual): add + RMSNorm -> qkv; (attention skipped: o from fixed activations,
    quantized by its own launch) o -> add + RMSNorm -> gate_up -> SiLU-and-mul -> down. Each call returns the
    residual stream after its first norm. mode (CHAIN_MODES): "unfused": 16-bit norm / SiLU outputs, which
    ``fp8_linear`` quantizes; "fused": they write ``Fp8Activations`` (no quantization launch before qkv,
    gate_up, down); "fused+sums": also down's K splits left unsummed for the next layer's norm."""
    by_name = {gm.name: gm for gm in gemms}
    hidden = by_name["qkv"].k
    torch.manual_seed(m)
    x, res, attn = (torch.randn(m, hidden, device=DEVICE).bfloat16() for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).bfloat16()
    norm = f.fused_add_rmsnorm if mode == "unfused" else f.fused_add_rmsnorm_quant
    silu = f.silu_and_mul if mode == "unfused" else f.silu_and_mul_quant
    state: dict[str, object] = {"hidden": x, "residual": res}

    def one(c: int) -> torch.Tensor:
        qkv, o, gate_up, down = (by_name[n].fp8[c % by_name[n].copies] for n in ("qkv", "o", "gate_up", "down"))
        normed, residual = norm(state["hidden"], state["residual"], w, NORM_EPS)
        g.fp8_linear(normed, *qkv)
        normed, state["residual"] = norm(g.fp8_linear(attn, *o), residual, w, NORM_EPS)
        act = silu(g.fp8_linear(normed, *gate_up))
        state["hidden"] = g.fp8_linear_partials(act, *down) if mode == "fused+sums" else g.fp8_linear(act, *down)
        return residual

    return [lambda c=c: one(c) for c in range(max(gm.copies for gm in gemms))]


def chain_check(gemms: list[Gemm], m: int) -> dict[str, float]:
    """Per fused mode: the relative difference of its residual stream after three layers against the unfused
    chain's (0 expected on a GPU: the same operands reach the same kernels)."""
    residuals = {}
    for mode in CHAIN_MODES:
        calls = layer_chain(gemms, m, mode)
        residuals[mode] = [call() for call in calls[:3]][-1]
    return {mode: rel_error(residuals[mode], residuals["unfused"]) for mode in CHAIN_MODES[1:]}


def run_chains(gemms: list[Gemm], ms: list[int], record: dict) -> dict[tuple[int, str], float]:
    """(d): µs per producer call and per layer chain, both ways, at each M up to SWAP_MAX_M."""
    print("(d) producers of the GEMM inputs (µs per call) and one layer's chain (µs per layer)", flush=True)
    hidden, inter = gemms[0].k, gemms[-1].k
    out: dict[tuple[int, str], float] = {}
    for m in [m for m in ms if m <= g.SWAP_MAX_M]:
        parts = []
        for name, call in producer_calls(m, hidden, inter).items():
            out[m, name] = time_us([call] * PRODUCER_REPEATS, 20)
            parts.append(f"{name} {out[m, name]:.2f}")
        print(f"  M={m:3}: " + ", ".join(parts), flush=True)
        for mode in CHAIN_MODES:
            try:
                out[m, f"chain {mode}"] = time_us(layer_chain(gemms, m, mode), 20)
            except Exception as e:  # reported, not fatal
                print(f"  M={m:3} chain {mode}: ERROR {short(e)}")
        parts = []
        for gm in gemms:  # the split sum by a second launch vs by the tile's last program, from ready activations
            cfg = g.pick_ready_swap_config(m, gm.n, gm.k, torch.device(DEVICE))
            if cfg.split_k == 1:
                continue
            for reduce in g.SPLIT_REDUCES:
                out[m, f"{gm.name} {reduce}"] = gm.time("swap_ready", m, attrs.evolve(cfg, reduce=reduce))
            parts.append(f"{gm.name} " + " / ".join(f"{out[m, f'{gm.name} {r}']:.1f}" for r in g.SPLIT_REDUCES))
        print(f"  M={m:3}: swap_ready µs with the split sum {' / '.join(g.SPLIT_REDUCES)}: " + ", ".join(parts))
        diffs = chain_check(gemms, m)
        record["chains"][f"M={m} differences"] = diffs
        chains = ", ".join(f"{mode} {out.get((m, f'chain {mode}'), math.nan):.1f}" for mode in CHAIN_MODES)
        print(f"  M={m:3}: chain µs {chains}; residuals differ from unfused by " +
              ", ".join(f"{mode} {d:.1e}" for mode, d in diffs.items()), flush=True)  # fmt: skip
    record["chains"].update({f"M={m} {name}": us for (m, name), us in out.items()})
    return out


def print_chain_table(
    gemms: list[Gemm], ms: list[int], times: dict[tuple[str, int, str], float], chains: dict[tuple[int, str], float]
) -> None:
    """Per M: the four GEMMs summed with their quantization launches (``shipped``) and from ready fp8 activations
    (``swap_ready``), and the layer chain unfused vs fused (µs; TB/s of fp8 weight bytes)."""
    fp8_bytes = sum(gm.fp8_bytes for gm in gemms)

    def cell(us: float | None) -> str:
        return f"{'-':>14}" if us is None or not math.isfinite(us) else f"{us:>6.1f} ({fp8_bytes / us / 1e6:.2f})"

    def gemm_sum(m: int, variant: str) -> float | None:
        parts = [times.get((gm.name, m, variant)) for gm in gemms]
        return None if None in parts else sum(p or 0.0 for p in parts)

    print("\nper layer, µs (TB/s of fp8 weight bytes): the 4 GEMMs with quantization launches | from ready fp8 | "
          "the chain with the producers: unfused | fused (FNVLLM_FP8_FUSED_QUANT=1) | fused + down's split sum in "
          "the next norm (FNVLLM_FP8_NORM_SUMS_SPLITS=1)")  # fmt: skip
    print(f"{'M':>4} | {'GEMMs+quant':>14} | {'GEMMs ready':>14} | " + " | ".join(f"{m:>14}" for m in CHAIN_MODES))
    for m in [m for m in ms if m <= g.SWAP_MAX_M]:
        modes = " | ".join(cell(chains.get((m, f"chain {mode}"))) for mode in CHAIN_MODES)
        print(f"{m:>4} | {cell(gemm_sum(m, 'shipped'))} | {cell(gemm_sum(m, 'swap_ready'))} | {modes}", flush=True)


def print_ready_table(gemms: list[Gemm], ms: list[int], best: _Best, cfgs: _Cfgs) -> None:
    """The swap kernel's best configs swept from ready fp8 activations (``swap_ready``), as TUNED_SWAP entries."""
    rows = [(gm, m) for gm in gemms for m in sorted(ms) if (gm.name, m, "swap_ready") in cfgs]
    if not rows:
        return
    print("TUNED_SWAP_READY: dict[tuple[int, int, int], SwapConfig] = {  # swept from ready fp8 activations")
    for gm, m in rows:
        key = (gm.name, m, "swap_ready")
        print(f"    ({gm.n}, {gm.k}, {m}): {compact(cfgs[key])},  # {gm.name} {best[key]:.1f} µs")
    print("}")


def run_split_cost(gemms: list[Gemm], ms: list[int], record: dict, ceiling: float) -> None:
    """(e): µs per call of the shipped ready-activation pick, its kernel alone, its split sum alone and the pick
    without PDL, per GEMM and M, beside the weight bytes' time at this card's read ceiling (``ceiling`` TB/s)."""
    print(f"(e) where a swap GEMM's time goes (µs per call; read ceiling {ceiling:.3f} TB/s)")
    print(f"  {'GEMM':8} {'M':>3} {'splits':>6} | {'shipped':>8} {'kernel':>8} {'sum':>8} {'no PDL':>8} | at ceiling")
    for gm in gemms:
        for m in [m for m in ms if m <= g.SWAP_MAX_M]:
            row = split_cost_row(gm, m)
            row["at ceiling"] = gm.fp8_bytes / ceiling / 1e6
            record["split_cost"][f"{gm.name} M={m}"] = row
            cells = " ".join(f"{row[k]:8.2f}" for k in ("shipped", "kernel", "sum", "no PDL"))
            print(f"  {gm.name:8} {m:>3} {int(row['splits']):>6} | {cells} | {row['at ceiling']:8.2f}", flush=True)


def split_cost_row(gm: Gemm, m: int) -> dict[str, float]:
    """One GEMM's (e) timings at M = m from activations quantized once: the pick (kernel + split-sum launch), the
    kernel alone (float32 partials kept), the sum launch alone on those partials, the pick without PDL."""
    x = gm.x(m)
    x_q, x_scale = g.quantize_activations(x)
    cfg = g.pick_ready_swap_config(m, gm.n, gm.k, x.device)
    no_pdl = attrs.evolve(cfg, pdl=False)
    parts = [g.fp8_gemm_swap_partials(x_q, x_scale, w, s, cfg) for w, s in gm.fp8]
    outs = [torch.empty(m, gm.n, dtype=x.dtype, device=DEVICE) for _ in parts]

    def chain(product: Callable[[torch.Tensor, torch.Tensor], object]) -> float:
        return time_us([lambda w=w, s=s: product(w, s) for w, s in gm.fp8], 20)

    return {
        "splits": float(parts[0].shape[0]),
        "shipped": chain(lambda w, s: g.fp8_gemm_swap(x_q, x_scale, w, s, x.dtype, cfg)),
        "kernel": chain(lambda w, s: g.fp8_gemm_swap_partials(x_q, x_scale, w, s, cfg)),
        "sum": time_us([lambda p=p, o=o: g._sum_splits(p, o) for p, o in zip(parts, outs, strict=True)], 20),
        "no PDL": chain(lambda w, s: g.fp8_gemm_swap(x_q, x_scale, w, s, x.dtype, no_pdl)),
    }


def main() -> int:
    """Check, time, sweep, print the tables; exit 1 when the shipped dispatch fails a correctness check."""
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm.py times Triton and cuBLAS GEMMs: it needs a CUDA GPU")
    green = limit_sms(args.sms) if args.sms else None  # noqa: F841 (the context lives as long as main)
    began = time.monotonic()
    ms = sorted(args.ms)
    gemms = [Gemm(name, n, k) for name, (n, k) in GEMMS.items()]
    record: dict = {
        "device": torch.cuda.get_device_name(),
        "checks": {},
        "times_us": {},
        "sweep": {},
        "chains": {},
        "split_cost": {},
    }
    variants = tuple(args.variants)
    ok = run_checks(gemms, ms, record, variants)
    times = run_times(gemms, ms, record, variants)
    chains = run_chains(gemms, ms, record) if args.layer_chain else {}
    ceiling = read_ceiling_tb_s("cuda") if args.ceiling or args.split_cost else None  # measured once, for both
    if ceiling is not None:
        record["read_ceiling_tb_s"] = ceiling
    if args.split_cost and ceiling is not None:
        run_split_cost(gemms, ms, record, ceiling)
    if chains:
        print_chain_table(gemms, ms, times, chains)
    best: _Best = {}
    cfgs: _Cfgs = {}
    print_layer_table(gemms, ms, times, best, cfgs)
    if args.sweep:
        deadline = None if args.total_s is None else began + args.total_s
        if "all" in args.sweep_kernels:
            best, cfgs = run_sweep(gemms, args.budget_s, record, FIXED_PLAN, deadline)
        else:  # the swap kernels at the M given, in the order given (the first M gets the full descent)
            plan = [(variant, m) for m in args.ms for variant in args.sweep_kernels]
            best, cfgs = run_sweep(gemms, args.budget_s, record, plan, deadline, refine_swaps=True)
    print_summary(gemms, ms, times, best, variants, ceiling if args.ceiling else None)
    if args.sweep:
        print_sweep_tables(gemms, ms, best, cfgs)
        print_ready_table(gemms, ms, best, cfgs)
        print_layer_table(gemms, ms, times, best, cfgs)
    if chains:
        print_chain_table(gemms, ms, times, chains)
    print(f"({time.monotonic() - began:.0f} s; shipped dispatch correct: {ok})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The top-k rows' candidate pass (``fnvllm.kernels.sampling_segments``): old route vs the grid kernel vs a sweep of
the loop kernel's knobs, at Qwen3's preset (temperature 0.6, top_p 0.95, top_k 20).

    PYTHONPATH=$PWD python3 benchmarks/bench_sampling_topk.py [--quick]

Per logits (256 and 64 rows x 151,936 bf16, flat std 0.64 and std 3): device us of ``sample_rows`` (the
temperature-only call) and of the top-k redraw by each route, each timed alone by replaying a CUDA graph of 10 calls
(no host gaps), and whether the route's tokens on 3 seeded sets of uniforms equal the grid route's (and
``filtered_pick``'s). Routes: "old" = ``filtered_pick`` (one program per row), "grid" = ``_floor_kernel`` +
``_segment_kernel`` (the current default), "loop P W B preN" = ``_segment_loop_kernel`` with P programs per row
(or T programs in all), W warps, B tokens a step, N blocks loaded ahead (0-2), the floor folded in or by
``_floor_kernel`` ("floorK"). The full sweep runs on the 256 flat rows; the other logits take the best
loop variants of that sweep (and T 1024 / 2048 / 4096); then pass 2's warps and segment sizes on the best variant,
and HF's top_k 50 on fused_sampling's finer chunks. The table is printed after each case (a kill at the budget
keeps the latest), the whole one last.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 151936
DEVICE = "cuda"  # the dry run of the tests sets "cpu" (Triton interpreter, tiny rows)
STARTED = time.perf_counter()
# (programs per row (0: SEGMENT_TOTAL in all), warps, blocks loaded ahead, fold floor, block, SEGMENT_TOTAL,
# SKIP_EMPTY); the programs and the total vary without a recompile. The first is sampling_segments' default (the
# best of final call A, 2026-12-02); the second, the mid call's winner (14:10). Also: SKIP_EMPTY (candidates
# written one by one: ~200 instructions a warp per 512 tokens instead of 576 on sm90), one warp a program (no
# barrier in its reductions), more programs and deeper prefetch (a program of one warp waits on each load).
Variant = tuple[int, int, int, bool, int, int, bool]
SWEEP: list[Variant] = [(0, 1, 2, True, 256, 4096, True), (0, 2, 1, True, 512, 1024, False)]
SWEEP += [(0, 2, 1, True, 512, 4096, False)]
SWEEP += [(0, 2, 1, True, 512, total, True) for total in (1024, 4096)]
SWEEP += [(0, 1, 1, True, 512, total, True) for total in (1024, 2048, 4096, 8192)]
SWEEP += [(0, 1, 2, True, 512, total, True) for total in (2048, 4096, 8192)]
SWEEP += [(0, 1, 2, True, 256, 8192, True)]
SWEEP += [(0, 4, 1, True, 1024, 4096, True), (0, 2, 2, True, 512, 4096, True), (0, 1, 1, False, 512, 4096, True)]
QUICK_SWEEP: list[Variant] = [(0, 1, 2, True, 256, 4096, True), (0, 2, 1, True, 512, 1024, False)]


def log(text: str) -> None:
    """Print with the seconds since the start."""
    print(f"[{time.perf_counter() - STARTED:5.1f} s] {text}", flush=True)


def graph_us(fn: Callable[[], Any], calls: int = 10, replays: int = 5) -> float:
    """Device us per call of ``fn`` (already warmed up): a CUDA graph of ``calls`` calls replayed, median of
    ``replays`` replays by CUDA events; falls back to timing back-to-back calls if the capture fails."""
    times = []
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except Exception as error:  # e.g. a capture refused: time launches instead
        log(f"graph capture failed ({type(error).__name__}: {str(error)[:60]}), timing launches")

        def run() -> None:
            for _ in range(calls):
                fn()

    run()
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


class Case:
    """One logits tensor at the preset: its sample_rows state and stats for 3 seeded sets of uniforms."""

    def __init__(self, rows: int, spread: float, top_k: int = 20) -> None:
        from fnvllm.executor.fused_sampling import SEGMENTS_FINE_CHUNK, SEGMENTS_FINE_SEGMENT
        from fnvllm.kernels import sampling

        dev = DEVICE
        gen = torch.Generator(device=dev).manual_seed(0)
        self.logits = (torch.randn(rows, VOCAB, generator=gen, device=dev) * spread).to(torch.bfloat16)
        self.name = f"{rows} rows, std {spread}" + ("" if top_k == 20 else f", k {top_k}")
        self.scale = torch.full((rows,), 1 / 0.6, device=dev)
        self.top_k = torch.full((rows,), top_k, dtype=torch.int64, device=dev)
        self.top_p = torch.full((rows,), 0.95, device=dev)
        self.min_p = torch.zeros(rows, device=dev)
        self.rows = torch.arange(rows, dtype=torch.int32, device=dev)
        self.states, self.stats = [], []
        fine = top_k > -(-VOCAB // sampling.CHUNK)
        self.fine = {"chunk": SEGMENTS_FINE_CHUNK, "segment": SEGMENTS_FINE_SEGMENT} if fine else {}
        for seed in range(3):
            uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(10 + seed)).to(dev)
            state = sampling.RowSampling(
                scale=self.scale,
                fixed=torch.ones(rows, dtype=torch.int32, device=dev),
                uniforms=uniforms,
                drawn=torch.empty((3, rows), device=dev),
                out=torch.zeros((2, rows), dtype=torch.int64, device=dev),
            )
            self.stats.append(sampling.sample_rows(self.logits, state, seed=0))
            if self.fine:  # fused_sampling's route for a top-k above the chunks: finer maxima, smaller segments
                self.stats[-1] = sampling.chunk_summaries(self.logits, self.scale, self.rows, self.fine["chunk"])
            self.states.append(state)

    def sample_rows(self) -> None:
        """The temperature-only call (both launches of ``sample_rows``) on the first uniforms."""
        from fnvllm.kernels import sampling

        sampling.sample_rows(self.logits, self.states[0], seed=0)

    def pick(self, route: str, which: int = 0) -> None:
        """The top-k redraw of every row by ``route`` ("old" or a segments route, knobs already set)."""
        from fnvllm.kernels.sampling_filters import filtered_pick
        from fnvllm.kernels.sampling_segments import segmented_pick

        state = self.states[which]
        rows = self.rows
        args = (self.logits, rows, rows, rows, self.stats[which], self.scale, self.top_k, self.top_p, self.min_p)
        if route == "old":
            filtered_pick(*args, state.drawn, state.out, **({"chunk": self.fine["chunk"]} if self.fine else {}))
        else:
            segmented_pick(*args, state.drawn, state.out, **self.fine)

    def tokens(self, route: str) -> torch.Tensor:
        """(3, R) tokens of the route on the 3 sets of uniforms."""
        out = []
        for which in range(3):
            self.states[which].out.zero_()
            self.pick(route, which)
            out.append(self.states[which].out[0].clone())
        return torch.stack(out)


def set_route(variant: Variant | None) -> str:
    """Set sampling_segments' knobs for a loop variant (None: the grid kernel); returns the route's label."""
    from fnvllm.kernels import sampling_segments as seg

    if variant is None:
        seg.SEGMENTS_LOOP = False
        return "grid (floor + segment)"
    programs, warps, prefetch, fold, block, total, skip = variant
    seg.SEGMENTS_LOOP, seg.SEGMENT_PROGRAMS, seg.SEGMENT_WARPS = True, programs, warps
    seg.SEGMENT_PREFETCH, seg.FOLD_FLOOR, seg.SEGMENT_BLOCK, seg.SEGMENT_TOTAL = prefetch, fold, block, total
    seg.SKIP_EMPTY = skip
    return label(variant)


def label(variant: Variant) -> str:
    """A loop variant's name in the tables."""
    programs, warps, prefetch, fold, block, total, skip = variant
    per_row = f"P{programs}" if programs else f"T{total}"
    return f"loop {per_row} W{warps} B{block} pre{prefetch}{' skip' if skip else ''}{'' if fold else ' floorK'}"


def auto_variants(best: list[Variant]) -> list[Variant]:
    """The default variant and the best ones, plus the first one's kernel with its programs per row set by the
    total (64-row batches need more programs a row than 256-row ones)."""
    if not best:
        return [SWEEP[0]]
    _, warps, prefetch, fold, block, _, skip = best[0]
    extra = [(0, warps, prefetch, fold, block, total, skip) for total in (1024, 4096, 8192)]
    return [SWEEP[0], *[v for v in best + extra if v != SWEEP[0]]]


def run_case(case: Case, variants: list[Variant], results: list[tuple[str, str, float, float, str]]) -> None:
    """Time sample_rows, the old route, the grid route and each loop variant on one case; check tokens."""
    case.sample_rows()
    t_only = graph_us(case.sample_rows)
    results.append((case.name, "temperature only (sample_rows)", t_only, 0.0, "-"))
    log(f"{case.name}: sample_rows {t_only:.1f} us")
    case.pick("old")
    old_us = graph_us(lambda: case.pick("old"))
    old_tokens = case.tokens("old")
    results.append((case.name, "old (filtered_pick)", t_only + old_us, old_us, "-"))
    log(f"  old {old_us:.1f} us")
    want = None
    for variant in [None, *variants]:
        route = set_route(variant)
        try:
            case.pick("segments")
            torch.cuda.synchronize()
            us = graph_us(lambda: case.pick("segments"))
            got = case.tokens("segments")
        except Exception as error:  # one variant failing to compile must not stop the sweep
            log(f"  {route}: FAILED {type(error).__name__}: {str(error)[:200]}")
            continue
        want = got if want is None else want
        differ, vs_old = int((got != want).sum()), int((got != old_tokens).sum())
        verdict = ("PASS" if differ == 0 else f"FAIL {differ}") + ("" if vs_old == 0 else f" (vs old: {vs_old} differ)")
        results.append((case.name, route, t_only + us, us, verdict))
        log(f"  {route:<30} pick {us:7.1f} us  tokens == grid: {verdict}")
    set_route(None)


def table(results: list[tuple[str, str, float, float, str]]) -> str:
    """Per case and route: device us per sampling call (sample_rows + pick), of the pick alone, vs temperature
    only, and token equality with the grid route (3 seeded sets of uniforms)."""
    head = f"{'logits':<22} {'route':<38} {'call us':>8} {'pick us':>8} {'vs T':>6}  tokens == grid"
    lines = [head, "-" * len(head)]
    t_only = {name: us for name, route, us, _, _ in results if route.startswith("temperature")}
    for name, route, us, pick, verdict in results:
        lines.append(f"{name:<22} {route:<38} {us:>8.1f} {pick:>8.1f} {us / t_only[name]:>6.2f}  {verdict}")
    return "\n".join([*lines, "(device us, CUDA graphs of 10 calls, medians of 5; preset T 0.6 / top_p 0.95 / k 20)"])


def summary(results: list[tuple[str, str, float, float, str]]) -> str:
    """Per case: temperature only, the old and grid routes, the default loop variant and the 3 fastest others."""
    keep = []
    for name in dict.fromkeys(r[0] for r in results):
        rows = [r for r in results if r[0] == name]
        fixed = [r for r in rows if not r[1].startswith("loop") or r[1] == label(SWEEP[0])]
        fastest = sorted((r for r in rows if r not in fixed), key=lambda r: r[3])[:3]
        keep += fixed + fastest
    return table(keep)


def best_variants(
    results: list[tuple[str, str, float, float, str]], labels: dict[str, Variant], n: int
) -> list[Variant]:
    """The n fastest loop variants with equal tokens."""
    ranked = sorted((pick, route) for _, route, _, pick, verdict in results if route in labels and verdict == "PASS")
    return [labels[route] for _, route in ranked[:n]]


PASS2_KNOBS = [("pick W4", {"PICK_WARPS": 4}), ("pick W16", {"PICK_WARPS": 16}), ("seg 8", {"SEGMENT": 8})]


def pass2_sweep(case: Case, best: list[Variant], results: list[tuple[str, str, float, float, str]]) -> None:
    """The best variant with pass 2 (``_segments_pick_kernel``) at other warps (PICK_WARPS 8) and segments
    (SEGMENT 16: with 8, 38 x 8 slots fit a 512-slot sort instead of 1024; a chunk with more candidates sends its
    row to the per-row fallback); tokens checked against the grid route's (the last ones in ``results``)."""
    from fnvllm.kernels import sampling_segments as seg

    t_only = next(us for name, route, us, _, _ in results if name == case.name and route.startswith("temperature"))
    set_route(None)
    want = case.tokens("segments")
    for variant in best:
        for suffix, knobs in PASS2_KNOBS:
            route = set_route(variant) + " " + suffix
            saved = {name: getattr(seg, name) for name in knobs}
            try:
                for name, value in knobs.items():
                    setattr(seg, name, value)
                case.pick("segments")
                us = graph_us(lambda: case.pick("segments"))
                differ = int((case.tokens("segments") != want).sum())
            except Exception as error:  # a diagnostic must not stop the run
                log(f"  {route}: FAILED {type(error).__name__}: {str(error)[:200]}")
                continue
            finally:
                for name, value in saved.items():
                    setattr(seg, name, value)
            verdict = "PASS" if differ == 0 else f"FAIL {differ}"
            results.append((case.name, route, t_only + us, us, verdict))
            log(f"  {route:<30} pick {us:7.1f} us  tokens == grid: {verdict}")
    set_route(None)


def kernel_line(case: Case, variant: Variant | None) -> str:
    """The pick's kernels by torch.profiler, us per call each (one line), for a route."""
    from torch.profiler import ProfilerActivity, profile

    route = set_route(variant)
    try:
        case.pick("segments")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                case.pick("segments")
            torch.cuda.synchronize()
        rows = []
        for event in prof.key_averages():
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
            if total > 0:
                rows.append((total / 5, event.key))
        text = ", ".join(f"{name[:28]} {us:.1f}" for us, name in sorted(rows, reverse=True)[:4])
    except Exception as error:  # a diagnostic must not stop the run
        text = f"FAILED {type(error).__name__}: {str(error)[:80]}"
    set_route(None)
    return f"  kernels of {route}: {text}"


def main() -> None:
    """The sweep on 256 flat rows, then the other logits with the best variants; the table last."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short sweep (2 loop variants)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampling_topk needs a CUDA GPU")
    sweep = QUICK_SWEEP if args.quick else SWEEP
    labels = {label(v): v for v in sweep}
    results: list[tuple[str, str, float, float, str]] = []
    first = Case(256, 0.64)
    run_case(first, sweep, results)
    print(table(results), flush=True)
    best = best_variants(results, labels, 3)
    for variant in [None, *best[:1]]:
        log(kernel_line(first, variant))
    log("best loop variants on 256 flat rows: " + ", ".join(label(v) for v in best))
    for rows, spread in ((64, 0.64), (256, 3.0), (64, 3.0)):
        case = Case(rows, spread)
        run_case(case, auto_variants(best), results)
        print(table([r for r in results if r[0] == case.name]), flush=True)
    pass2_sweep(first, best[:1], results)  # last: the least likely to matter, and many compiles
    run_case(Case(256, 0.64, 50), auto_variants(best)[:3], results)
    print("summary: per case the default loop variant (" + label(SWEEP[0]) + ") and the 3 fastest others")
    print(summary(results), flush=True)


if __name__ == "__main__":
    main()

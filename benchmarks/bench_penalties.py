"""The penalised rows' float32 copy and penalty edits on the H200, by each route (issue 19).

    PYTHONPATH=$PWD python3 benchmarks/bench_penalties.py [--iters 20] [--host] [--sampler] [--sweep] [--budget 70]

Per case (256 and 64 rows x 151,936 bf16 logits, ~1,100-token histories: a 100-128-token prompt and ~1,000
outputs, token ids uniform over the vocabulary, as a random-weight checkpoint samples them; one case with heavy
repeats, ids below 512), the device us per call (CUDA graph of 10 calls, replayed --iters times, median) of:

    copy only     ``float_rows`` alone: the floor (the copy's bytes at the copy bandwidth)
    old           ``float_rows`` + ``penalize_`` (one program per row, three passes)
    from-source   ``float_rows`` + ``penalize_from_``, its count launch only for cases with presence / frequency
                  (REPETITION_FROM_SOURCE, the default route of repetition alone; PENALTIES_FROM_SOURCE otherwise)
    fused         ``penalised_rows``: the copy and the edits in one (rows, vocabulary blocks) launch

and whether each path's rows equal the old path's bit for bit (``equal``), plus the old path against the torch
reference (``penalize_ref``, max abs difference). The table is printed after the cases; ``--host`` then prints
the host's us per decode step of ``SlotHistory.penalties`` / ``record`` (kept columns moved on the device vs
uploaded), of the token write (``index_put_`` vs ``put_``) and of the penalised copy's launches (two vs one);
``--sampler`` the whole sampling call (256 rows, temperature and Qwen3's preset, the two penalty mixes) on each
route (old, repetition from the source, fused), with the seeded rows' tokens compared; ``--sweep`` the repetition
kernel's (parts, block) on 256 and 64 rows, then the fused kernel's tile (block, history block, warps) on the two
256-row cases until ``--budget`` seconds since the start have passed; the table is printed again at the end, with
each sweep's best.

On the CPU ``--check`` runs the paths once on tiny shapes under TRITON_INTERPRET (the bit-equality only).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.host_step import penalty_plan

VOCAB = 151936
STARTED = time.perf_counter()
CALLS_PER_GRAPH = 10


def make_case(num_rows: int, counted: bool, repeats: bool, vocab: int, seed: int, device: str) -> dict[str, Any]:
    """Logits, the slot buffer, meta and factors of one case (rows i at slot num_rows - 1 - i, every row penalised:
    repetition 1.05, and with ``counted`` frequency 0.3 / presence 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    big = vocab == VOCAB
    max_len, tail = (1200, 128) if big else (60, 8)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    high = 512 if repeats else vocab
    tokens = torch.randint(0, min(high, vocab), (num_rows, max_len), generator=gen, dtype=torch.int32)
    prompt = torch.randint(100, 129, (num_rows,), generator=gen) if big else torch.full((num_rows,), 8)
    ctx = prompt + torch.randint(max_len * 3 // 4, max_len - tail, (num_rows,), generator=gen)
    meta = torch.stack([torch.arange(num_rows - 1, -1, -1), ctx, ctx - prompt])
    frequency, presence = (0.3, 0.2) if counted else (0.0, 0.0)
    factors = torch.tensor([[1.05], [frequency], [presence]]).expand(3, num_rows).contiguous()
    on = {"logits": logits, "tokens": tokens, "meta": meta, "factors": factors}
    return {k: v.to(device) for k, v in on.items()} | {"mean_ctx": float(ctx.float().mean()), "counted": counted}


def paths(case: dict[str, Any]) -> dict[str, Callable[[], torch.Tensor]]:
    """Each path as a no-argument call returning its (P, V) float32 rows."""
    from fnvllm.kernels.penalties import float_rows, penalised_rows, penalize_, penalize_from_

    logits, tokens, meta, factors = case["logits"], case["tokens"], case["meta"], case["factors"]
    counts = torch.zeros(min(128, logits.shape[0]), logits.shape[1], dtype=torch.int32, device=logits.device)
    return {
        "copy only": lambda: float_rows(logits),
        "old": lambda: penalize_(float_rows(logits), tokens, meta, factors, counts),
        "from-source": lambda: penalize_from_(
            float_rows(logits), logits, None, tokens, meta, factors, counts, None, case["counted"]
        ),
        "fused": lambda: penalised_rows(logits, None, tokens, meta, factors),
    }


def device_us(call: Callable[[], Any], iters: int) -> float:
    """Median device us per call: a CUDA graph of CALLS_PER_GRAPH calls timed by events (plain launches if the
    capture fails)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    run: Callable[[], Any]
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(CALLS_PER_GRAPH):
                    call()
        torch.cuda.current_stream().wait_stream(stream)
        run = graph.replay
    except RuntimeError as exc:  # capture refused: time the launches themselves
        print(f"  (no CUDA graph: {str(exc)[:80]}; plain launches)")

        def run() -> None:
            for _ in range(CALLS_PER_GRAPH):
                call()

    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(times)


CASES = [  # name, rows, counted, repeats
    ("256 rep", 256, False, False),
    ("256 rep+pres+freq", 256, True, False),
    ("64 rep", 64, False, False),
    ("64 rep+pres+freq", 64, True, False),
    ("256 rep+pf, ids<512", 256, True, True),
]


def check_equal(case: dict[str, Any]) -> dict[str, str]:
    """Per path, 'yes' when its rows equal the old path's bit for bit, else the number of differing values; and
    the old path's max abs difference to the torch reference."""
    from fnvllm.kernels.penalties import float_rows_ref, penalize_ref

    calls = paths(case)
    old = calls["old"]()
    ref = penalize_ref(float_rows_ref(case["logits"]), case["tokens"], case["meta"], case["factors"])
    out = {"ref": f"{float((old - ref).abs().max()):.1e}"}
    for name in ("from-source", "fused"):
        got = calls[name]()
        same = torch.equal(got.view(torch.int32), old.view(torch.int32))
        out[name] = "yes" if same else f"NO ({int((got.view(torch.int32) != old.view(torch.int32)).sum())})"
    return out


def guarded(run: Callable[[], Any], failed: Any = None) -> Any:
    """What ``run`` returns, or ``failed`` (None: a dict saying so) after printing its error: one path that fails
    (a compile error on this Triton) must not lose the others' numbers."""
    try:
        return run()
    except Exception as error:  # printed, not raised
        print(f"  FAILED: {type(error).__name__}: {str(error)[:300]}", flush=True)
        return {"ref": "-", "from-source": "FAILED", "fused": "FAILED"} if failed is None else failed


def print_table(rows: list[dict[str, Any]]) -> None:
    """The table: device us per call per path, the fused one's saving, equality."""
    print(f"\n{'case':22s} {'ctx':>6s} {'copy':>7s} {'old':>7s} {'from-src':>8s} {'fused':>7s} {'old/fused':>9s} "
          f"{'eq src':>7s} {'eq fused':>8s} {'old-ref':>8s}")  # fmt: skip
    for r in rows:
        print(
            f"{r['case']:22s} {r['ctx']:6.0f} {r['copy only']:7.1f} {r['old']:7.1f} {r['from-source']:8.1f} "
            f"{r['fused']:7.1f} {r['old'] / r['fused']:9.2f} {r['eq']['from-source']:>7s} {r['eq']['fused']:>8s} "
            f"{r['eq']['ref']:>8s}"
        )


REPETITION_SWEEP = [(4, 256), (8, 128), (8, 256), (16, 64), (16, 128), (2, 512), (32, 64)]  # (parts, block)


def repetition_sweep(case: dict[str, Any], iters: int) -> list[tuple[float, tuple[int, int]]]:
    """float_rows + ``penalize_from_`` (repetition alone, no count launch) per (REPETITION_PARTS, REPETITION_BLOCK),
    each checked against the old path."""
    from fnvllm.kernels import penalties

    old = paths(case)["old"]()
    call = paths(case)["from-source"]
    default, results = (penalties.REPETITION_PARTS, penalties.REPETITION_BLOCK), []
    try:
        for parts, block in REPETITION_SWEEP:
            penalties.REPETITION_PARTS, penalties.REPETITION_BLOCK = parts, block
            same = guarded(lambda: torch.equal(call().view(torch.int32), old.view(torch.int32)), "-")
            us = guarded(lambda: device_us(call, iters), float("nan"))
            if us == us:  # not NaN
                results.append((us, (parts, block)))
            print(f"  parts {parts:3d} block {block:4d}: {us:7.1f} us  equal {same}", flush=True)
    finally:
        penalties.REPETITION_PARTS, penalties.REPETITION_BLOCK = default
    return sorted(results)


SWEEP = [  # (block, history block, warps), the likeliest first (the sweep stops at the budget)
    (4096, 1024, 4),
    (4096, 2048, 4),
    (4096, 512, 4),
    (8192, 2048, 8),
    (8192, 1024, 8),
    (2048, 1024, 4),
    (2048, 2048, 4),
    (4096, 1024, 8),
    (4096, 2048, 8),
    (8192, 2048, 4),
    (2048, 512, 2),
    (2048, 2048, 2),
    (1024, 1024, 2),
    (16384, 2048, 16),
]


def sweep(case: dict[str, Any], iters: int, budget: float) -> list[tuple[float, tuple[int, int, int]]]:
    """The fused kernel's us per call per tile (block, history block, warps), until ``budget`` s since the start;
    each tile's rows checked against the old path."""
    from fnvllm.kernels.penalties import penalised_rows

    old = paths(case)["old"]()
    results = []
    for block, history, warps in SWEEP:
        if time.perf_counter() - STARTED > budget:
            print("  (sweep stopped: budget)")
            break
        args = (case["logits"], None, case["tokens"], case["meta"], case["factors"], block, history, warps)
        same = guarded(lambda a=args: torch.equal(penalised_rows(*a).view(torch.int32), old.view(torch.int32)), "-")
        us = guarded(lambda a=args: device_us(lambda: penalised_rows(*a), iters), float("nan"))
        if us == us:  # not NaN
            results.append((us, (block, history, warps)))
        print(f"  block {block:5d} history {history:5d} warps {warps}: {us:7.1f} us  equal {same}", flush=True)
    return sorted(results)


ROUTES = {  # fused_sampling's switches per route of the penalised rows (those on)
    "old": (),
    "rep. from source": ("REPETITION_FROM_SOURCE",),
    "fused": ("PENALISED_COPY_FUSED",),
}
_ROUTE_SWITCHES = ("REPETITION_FROM_SOURCE", "PENALTIES_FROM_SOURCE", "PENALISED_COPY_FUSED")


def sampler_ab(case: dict[str, Any], iters: int) -> list[str]:
    """The whole sampling call (``Sampler.sample``, every row penalised from the case's slot buffer, seeded rows)
    on each route of ROUTES, for temperature 0.6 and Qwen3's preset (top_p 0.95, top_k 20), plus the case's
    penalties: device us per call (plain launches, CUDA events) and whether the tokens equal the old route's."""
    from fnvllm.executor import fused_sampling
    from fnvllm.executor.history import SlotPenalties
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams

    logits, num_rows = case["logits"], case["logits"].shape[0]
    counts = torch.zeros(min(128, num_rows), logits.shape[1], dtype=torch.int32, device=logits.device)
    penalties = SlotPenalties(case["tokens"], case["meta"], case["factors"], counts, case["counted"])
    rep, freq, pres = (float(f) for f in case["factors"][:, 0])
    defaults = {name: getattr(fused_sampling, name) for name in _ROUTE_SWITCHES}
    lines = []
    for label, extra in (("temperature 0.6", {}), ("preset", {"top_p": 0.95, "top_k": 20})):
        kwargs = {"repetition_penalty": rep, "frequency_penalty": freq, "presence_penalty": pres, **extra}
        params = [SamplingParams(temperature=0.6, seed=i, **kwargs) for i in range(num_rows)]
        batch = prepare_sampling(params, [3] * num_rows, [None] * num_rows, logits.shape[1], logits.device, penalties)
        sampler, cells, want = Sampler(0, kernels=True), [], None
        for route, on in ROUTES.items():
            for name in _ROUTE_SWITCHES:
                setattr(fused_sampling, name, name in on)
            tokens = sampler.sample(logits, batch).token_ids
            want = tokens if want is None else want
            us = device_plain_us(functools.partial(sampler.sample, logits, batch), iters)
            cells.append(f"{route} {us:.1f}" + ("" if torch.equal(tokens, want) else " (TOKENS DIFFER)"))
        for name, value in defaults.items():
            setattr(fused_sampling, name, value)
        penalty = "repetition" if not case["counted"] else "rep. + pres. + freq."
        lines.append(f"sampler, {label} + {penalty}, us per call: " + ", ".join(cells))
        print(lines[-1], flush=True)
    return lines


def device_plain_us(call: Callable[[], Any], iters: int) -> float:
    """Median device us per call of plain launches (CUDA events around each call)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _host_us(call: Callable[[], Any], iters: int) -> float:
    """Median host us per call (no synchronisation inside: the device runs behind)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _index_put(tokens: torch.Tensor, meta: torch.Tensor, sampled: torch.Tensor) -> None:
    """The token write as ``record`` made it before: (slot, ctx) index tensors."""
    tokens.index_put_((meta[0], meta[1]), sampled.to(torch.int32))


def _put(tokens: torch.Tensor, meta: torch.Tensor, sampled: torch.Tensor) -> None:
    """The token write as ``record`` makes it now: flat indices."""
    tokens.put_(meta[2], sampled.to(torch.int32))


def host_costs(iters: int = 300) -> list[str]:
    """The host's us per decode step on the GPU machine: ``SlotHistory.penalties`` + ``record`` at 64 and 256
    rows with the kept columns moved on the device (``advance``, the default on a GPU) and uploaded each step, the
    token write by ``index_put_`` (before) and ``put_`` (now), and the penalised copy's launches (8 rows: the
    device stays ahead) by float_rows + penalize_ and by penalised_rows."""
    from fnvllm.executor.history import SlotHistory
    from fnvllm.kernels.penalties import float_rows, penalised_rows, penalize_, penalize_from_
    from fnvllm.state import SamplingParams

    device, lines = torch.device("cuda"), []
    for batch in (64, 256):
        params = tuple(SamplingParams(temperature=0.6, repetition_penalty=1.05) for _ in range(batch))
        slots, rows = tuple(range(batch))[::-1], tuple(range(batch))
        sampled = torch.zeros(batch, dtype=torch.int64, device=device)
        cells = []
        for advance in (False, True):
            history = SlotHistory(batch, 2048, VOCAB, device)
            history.in_use, history.advance = True, advance
            pen, rec = [], []
            for step in range(iters):
                plan = penalty_plan(step, batch, params, slots, context=1000, outputs=900)
                t0 = time.perf_counter()
                history.penalties(plan, rows)
                t1 = time.perf_counter()
                history.record(plan, rows, sampled)
                pen.append(t1 - t0)
                rec.append(time.perf_counter() - t1)
            torch.cuda.synchronize()
            cells.append((statistics.median(pen) * 1e6, statistics.median(rec) * 1e6))
        (up_p, up_r), (adv_p, adv_r) = cells
        lines.append(f"host B={batch}: penalties {up_p:.1f} (upload) -> {adv_p:.1f} us (moved on the device), "
                     f"record {up_r:.1f} / {adv_r:.1f} us")  # fmt: skip
        tokens = torch.zeros(batch, 2048, dtype=torch.int32, device=device)
        meta = torch.stack([torch.arange(batch), torch.full((batch,), 5), torch.arange(batch) * 2048 + 5]).to(device)
        put_old = _host_us(functools.partial(_index_put, tokens, meta, sampled), iters)
        put_new = _host_us(functools.partial(_put, tokens, meta, sampled), iters)
        lines.append(f"host B={batch}: token write index_put_ {put_old:.1f} -> put_ {put_new:.1f} us")
    case = make_case(8, False, False, VOCAB, 2, "cuda")
    logits, tokens, meta, factors = case["logits"], case["tokens"], case["meta"], case["factors"]
    counts = torch.zeros(8, VOCAB, dtype=torch.int32, device=device)
    two = _host_us(lambda: penalize_(float_rows(logits), tokens, meta, factors, counts), iters)
    one = _host_us(lambda: penalised_rows(logits, None, tokens, meta, factors), iters)
    rep = _host_us(
        lambda: penalize_from_(float_rows(logits), logits, None, tokens, meta, factors, counts, None, False), iters
    )
    lines.append(
        f"host: penalised copy float_rows + penalize_ {two:.1f}, float_rows + penalize_from_ (repetition alone) "
        f"{rep:.1f}, penalised_rows {one:.1f} us per call"
    )
    for line in lines:
        print(line, flush=True)
    return lines


def cpu_check() -> None:
    """Tiny shapes under the interpreter: every path's rows against the old path's."""
    for name, num_rows, counted, repeats in CASES:
        case = make_case(min(num_rows, 4), counted, repeats, 300, 1, "cpu")
        print(name, check_equal(case))


def main() -> None:
    """Parse the arguments and run the cases (and the sweep)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="graph replays per measurement (median)")
    parser.add_argument("--sweep", action="store_true", help="time the fused kernel's tiles on the 256-row cases")
    parser.add_argument(
        "--budget", type=float, default=70.0, help="seconds since the start after which the sweep stops"
    )
    parser.add_argument("--sampler", action="store_true", help="the whole sampling call, PENALISED_COPY_FUSED off/on")
    parser.add_argument("--host", action="store_true", help="the host's us per step of the penalised path's calls")
    parser.add_argument("--check", action="store_true", help="CPU: bit-equality on tiny shapes (interpreter)")
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        cpu_check()
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    cases = {}
    for name, num_rows, counted, repeats in CASES:
        case = make_case(num_rows, counted, repeats, VOCAB, 0, "cuda")
        cases[name] = case
        row: dict[str, Any] = {"case": name, "ctx": case["mean_ctx"], "eq": guarded(lambda c=case: check_equal(c))}
        for path, call in paths(case).items():
            row[path] = guarded(lambda c=call: device_us(c, args.iters), float("nan"))
        rows.append(row)
        print(f"{name}: {({k: v for k, v in row.items() if k not in ('case', 'ctx')})} "
              f"[{time.perf_counter() - STARTED:.0f} s]", flush=True)  # fmt: skip
    print_table(rows)
    sampler_lines = guarded(host_costs, []) if args.host else []
    if args.sampler:
        for name in ("256 rep", "256 rep+pres+freq"):
            sampler_lines += guarded(lambda c=cases[name]: sampler_ab(c, args.iters), [])
    if args.sweep:
        best = {}
        for name in ("256 rep", "64 rep"):
            print(f"\nrepetition kernel sweep, {name} (float_rows + penalize_from_):")
            found = guarded(lambda c=cases[name]: repetition_sweep(c, args.iters), [])
            if found:
                best[f"{name}, parts / block"] = found[0]
        for name in ("256 rep", "256 rep+pres+freq"):
            print(f"\nsweep {name}:")
            found = guarded(lambda c=cases[name]: sweep(c, args.iters, args.budget), [])
            if found:
                best[f"{name}, fused tile (block, history block, warps)"] = found[0]
        print_table(rows)
        for name, (us, tile) in best.items():
            print(f"best {name}: {tile}: {us:.1f} us")
    print("\n".join(sampler_lines))
    print(f"[{time.perf_counter() - STARTED:.0f} s]")


if __name__ == "__main__":
    main()

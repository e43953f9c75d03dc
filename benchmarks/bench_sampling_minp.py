"""Min-p-only rows: ``filtered_pick``'s one program per row (old) vs ``minp_pick``'s (rows, chunks) grid (new).

    PYTHONPATH=$PWD python3 benchmarks/bench_sampling_minp.py [--iters 20] [--quick] [--budget S]

For flat (std 0.64, a random-weight checkpoint's spread) and std-3 bf16 logits of 151,936 tokens, at 256 and 64
rows: first the tokens of 3 seeded steps (min_p 0.02 / 0.05 / 0.1 at T 0.6 and 1, a few greedy rows) by the new
route (its default 4 warps per program, and 8) against the old route's (>= 99 % equal: a uniform within float32
rounding of a CDF step may differ) and the float64 reference's; then device time per sampling call
(``Sampler.sample`` on a prepared batch) of temperature 0.6 alone and of min_p 0.05 by each route:

    queued: the calls queued behind a GPU sleep, so the host's launch time is hidden: device time alone;
    events: CUDA events around each call as ``bench_sampling.device_ms`` takes them (host-bound calls included);
    step:   ``bench_sampling.step_function`` (prepare_sampling from SamplingParams + the sample) by events.

At 256 flat rows also the kernels of each route (torch.profiler, us per call). A table is printed after each
run (flat 256 rows, std-3 256 rows, then 64 rows of each) and again last. --quick: 256 rows only. --budget: no run
starts after that many seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import bench_sampling as bs  # the bench's inputs, step and timers

STARTED = time.perf_counter()
ROUTES = {  # (fused_sampling.MIN_P_BY_CHUNKS, sampling_minp.NUM_WARPS)
    "old (filtered_pick)": (False, 4),
    "new (minp_pick)": (True, 4),
    "new, 8 warps": (True, 8),
}
T_ONLY = {"temperature": 0.6}
MIN_P = {"temperature": 0.6, "min_p": 0.05}
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU sleep: time for the host to queue every timed call behind it


def route(name: str) -> None:
    """Set the min-p switches of route ``name``."""
    from fnvllm.executor import fused_sampling
    from fnvllm.kernels import sampling_minp

    fused_sampling.MIN_P_BY_CHUNKS, sampling_minp.NUM_WARPS = ROUTES[name]


def check_params(num_rows: int) -> list[Any]:
    """Seeded min-p-only rows of varied min_p and temperature, every 16th row greedy."""
    from fnvllm.state import SamplingParams

    mins, temps = (0.02, 0.05, 0.1), (0.6, 1.0)
    return [
        SamplingParams(temperature=0.0, seed=1000 + i)
        if i % 16 == 5
        else SamplingParams(temperature=temps[i % 2], min_p=mins[i % 3], seed=1000 + i)
        for i in range(num_rows)
    ]


def check_tokens(logits: torch.Tensor) -> list[str]:
    """Per new route, the share of the old route's tokens it draws over 3 seeded steps (and the old route's share
    of the float64 reference's); lines, each PASS or FAIL."""
    from fnvllm.executor.sampler import Sampler, prepare_sampling

    num_rows, vocab = logits.shape
    params = check_params(num_rows)
    batches = [prepare_sampling(params, [3 + s] * num_rows, [None] * num_rows, vocab, logits.device) for s in range(3)]
    drawn = {}
    for name in ROUTES:
        route(name)
        sampler = Sampler(0)
        drawn[name] = torch.stack([sampler.sample(logits, b).token_ids for b in batches])  # (3, R)
    route("old (filtered_pick)")
    ref = torch.stack([Sampler(kernels=False).sample(logits, b).token_ids for b in batches])
    old = drawn["old (filtered_pick)"]
    lines = []
    for name, tokens in [*drawn.items(), ("float64 reference", ref)]:
        if name.startswith("old"):
            continue
        share = (tokens == old).float().mean().item()
        verdict = "PASS" if share >= 0.99 else "FAIL"
        lines.append(f"{verdict} {name} == old route on {share:.2%} of {tokens.numel()} seeded draws")
    return lines


def queued_us(fn: Callable[[], Any], calls: int = 20, repeats: int = 3) -> float:
    """Device us per call of ``fn``, the calls queued behind a GPU sleep (the host's time hidden); median."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def time_case(logits: torch.Tensor, histories: list[Any], name: str, iters: int) -> dict[str, float]:
    """queued / events / step us per call of one route (``name``: a route, or "temperature only")."""
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams

    num_rows, vocab = logits.shape
    rows = [T_ONLY if name == "temperature only" else MIN_P] * num_rows
    route("old (filtered_pick)" if name == "temperature only" else name)
    params = [SamplingParams(**r) for r in rows]
    batch = prepare_sampling(params, [0] * num_rows, [None] * num_rows, vocab, logits.device)
    sampler = Sampler(0)
    call = lambda: sampler.sample(logits, batch)  # noqa: E731
    bs.ROWS = num_rows  # step_function's plan has ROWS rows
    step = bs.step_function(rows, logits, histories[:num_rows])
    return {
        "queued": queued_us(call),
        "events": 1e3 * bs.device_ms(call, iters),
        "step": 1e3 * bs.device_ms(step, iters),
    }


def profile_line(logits: torch.Tensor, name: str) -> str:
    """The kernels of one min-p sampling call by route ``name`` (torch.profiler, us per call)."""
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams

    num_rows, vocab = logits.shape
    route(name)
    batch = prepare_sampling([SamplingParams(**MIN_P)] * num_rows, [0] * num_rows, [None] * num_rows, vocab, "cuda")
    sampler = Sampler(0)
    return bs.guarded_text(lambda: bs.kernel_sums(lambda: sampler.sample(logits, batch)))


def table(results: list[tuple[str, int, str, dict[str, float]]]) -> str:
    """Per spread, rows and route: us per call (queued, events, step) and queued time vs temperature only."""
    head = f"{'logits':<9} {'rows':>4} {'route':<20} {'queued':>8} {'events':>8} {'step':>8} {'vs T-only':>9}"
    lines = [head, "-" * len(head)]
    base = {(s, r): t["queued"] for s, r, name, t in results if name == "temperature only"}
    for spread, rows, name, t in results:
        if "queued" not in t:  # the case failed: its error in place of the numbers
            lines.append(f"{spread:<9} {rows:>4} {name:<20} {next(iter(t))}")
            continue
        ratio = t["queued"] / base[spread, rows] if (spread, rows) in base else float("nan")
        lines.append(
            f"{spread:<9} {rows:>4} {name:<20} {t['queued']:>8.1f} {t['events']:>8.1f} {t['step']:>8.1f} {ratio:>9.2f}"
        )
    lines.append("(us per sampling call, medians; queued = device time alone, events/step include host-bound gaps)")
    return "\n".join(lines)


def main() -> None:
    """Token checks, then times, per spread and row count; the table after each spread and last."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case for events / step (default 20)")
    parser.add_argument("--quick", action="store_true", help="256 rows only")
    parser.add_argument("--budget", type=float, default=1e9, help="start no run (spread, rows) after this many s")
    args = parser.parse_args()
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("bench_sampling_minp needs a CUDA GPU")
    bs.ROWS = 256
    steep, histories = bs.make_inputs()  # (256, 151,936) bf16, std 3
    flat = (steep.float() * (0.64 / 3)).to(torch.bfloat16)
    runs = [("std 0.64", 256), ("std 3", 256)] + ([] if args.quick else [("std 0.64", 64), ("std 3", 64)])
    results, failures = [], []
    for spread, num_rows in runs:
        if time.perf_counter() - STARTED > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {spread}, {num_rows} rows and later runs skipped", flush=True)
            break
        logits = (flat if spread == "std 0.64" else steep)[:num_rows]
        for line in check_tokens(logits):
            print(f"[{time.perf_counter() - STARTED:.0f} s] {spread}, {num_rows} rows: {line}", flush=True)
            failures += [line] if line.startswith("FAIL") else []
        for name in ("temperature only", *ROUTES):
            t = bs.guarded(lambda n=name, x=logits: time_case(x, histories, n, args.iters))
            results.append((spread, num_rows, name, t))
            print(f"  {num_rows} rows {name:<20} " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
        if spread == "std 0.64" and num_rows == 256:
            for name in ROUTES:
                print(f"    kernels of {name} (us/call): {profile_line(logits, name)}", flush=True)
        print(table(results), flush=True)
    route("old (filtered_pick)")
    print("tokens: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    print(table(results), flush=True)


if __name__ == "__main__":
    main()

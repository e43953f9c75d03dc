"""Sampling at the batch users run: 256 rows x 151,936-token bf16 logits, the sampler of this tree vs a baseline.

    PYTHONPATH=$PWD python3 benchmarks/bench_sampling.py [--baseline DIR] [--iters 40] [--json PATH]

DIR: the root of an older checkout (its ``fnvllm/`` package), e.g. made on the development machine with
``git archive <commit> fnvllm | tar -x -C .bench_base`` and carried to the GPU machine. Its sampler is timed in a
subprocess (``PYTHONPATH=DIR``), the way its executor dispatched: the fused temperature kernel when every row
qualified, else the general sampler for the whole batch. Without DIR only this tree's sampler is timed.

Cases (issue 19's table, plus the mix that used to send the batch to the general sampler, seeds and greedy):
temperature 0.6; + top_p 0.95 / top_k 20; + repetition_penalty 1.05 with ~1000-token histories; min_p 0.05;
logprobs 5; 255 temperature rows + 1 top-p row; every row seeded; greedy.

1. Correctness first (this tree): for each case with every row seeded, the Triton kernels and the torch
   references pick the same token in >= 99 % of rows (a uniform within float32 rounding of a CDF step may differ),
   filtered rows pick inside their top-k, and logprobs equal log_softmax of the logits.
2. Timing: per step = host preparation (``prepare_sampling`` from SamplingParams and histories) + the device
   work, as the executor runs it; ``host`` is the time until the calls return (no sync), ``step`` the synchronized
   wall time per step (whichever of host and device is longer), medians over --iters steps after a warm-up.
A table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROWS, VOCAB, HISTORY_LEN = 256, 151936, 1000


def cases() -> dict[str, list[dict[str, Any]]]:
    """Per case, the SamplingParams keyword arguments of each of the 256 rows."""
    t = {"temperature": 0.6}
    qwen = {**t, "top_p": 0.95, "top_k": 20}
    return {
        "temperature 0.6": [t] * ROWS,
        "+ top_p 0.95, top_k 20": [qwen] * ROWS,
        "+ repetition_penalty 1.05": [{**qwen, "repetition_penalty": 1.05}] * ROWS,
        "temperature 0.6, min_p 0.05": [{**t, "min_p": 0.05}] * ROWS,
        "temperature 0.6, logprobs 5": [{**t, "logprobs": 5}] * ROWS,
        "1 of 256 rows top_p 0.95": [t] * (ROWS - 1) + [{**t, "top_p": 0.95}],
        "temperature 0.6, every row seeded": [{**t, "seed": i} for i in range(ROWS)],
        "greedy": [{"temperature": 0.0}] * ROWS,
    }


def make_inputs(seed: int = 0) -> tuple[torch.Tensor, list[Any]]:
    """bf16 logits (ROWS, VOCAB) with a model-like spread, and ~HISTORY_LEN-token histories per row."""
    from fnvllm.state.plan import TokenHistory

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(ROWS, VOCAB, generator=gen) * 3).to(torch.bfloat16).cuda()
    ids = torch.randint(0, VOCAB, (ROWS, HISTORY_LEN), generator=gen).tolist()
    half = HISTORY_LEN // 2
    return logits, [TokenHistory(prompt=tuple(r[:half]), output=tuple(r[half:])) for r in ids]


def step_function(rows: list[dict[str, Any]], logits: torch.Tensor, histories: list[Any]) -> Callable[[], Any]:
    """One sampling step as the executor of the imported fnvllm runs it (new: one path; old: the dispatch)."""
    from fnvllm.executor import fused_sampling
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams

    params = [SamplingParams(**r) for r in rows]
    hist = [h if p.needs_history else None for p, h in zip(params, histories, strict=True)]
    num_generated = [HISTORY_LEN // 2] * ROWS
    sampler = Sampler(0)
    fused = fused_sampling.FusedSampler(0) if hasattr(fused_sampling, "FusedSampler") else None

    def step() -> Any:
        if fused is not None:
            temperatures = fused_sampling.fused_temperatures(params)
            if temperatures is not None:
                return fused.sample(logits, temperatures)
        batch = prepare_sampling(params, num_generated, hist, VOCAB, logits.device)
        return sampler.sample(logits, batch)

    return step


def time_step(step: Callable[[], Any], iters: int) -> dict[str, float]:
    """Median host (launch) and synchronized step times in ms."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        host.append(launched - start)
        wall.append(time.perf_counter() - start)
    return {"host_ms": statistics.median(host) * 1e3, "step_ms": statistics.median(wall) * 1e3}


def check_correctness(logits: torch.Tensor, histories: list[Any]) -> list[str]:
    """This tree's kernels vs references on every case with seeded rows; returns failure lines (empty = PASS)."""
    import attrs

    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams

    failures = []
    for name, rows in cases().items():
        params = [attrs.evolve(SamplingParams(**r), seed=1000 + i) for i, r in enumerate(rows)]
        hist = [h if p.needs_history else None for p, h in zip(params, histories, strict=True)]
        batch = prepare_sampling(params, [3] * ROWS, hist, VOCAB, logits.device)
        got = Sampler(kernels=True).sample(logits, batch)
        ref = Sampler(kernels=False).sample(logits, batch)
        agree = (got.token_ids == ref.token_ids).float().mean().item()
        line = f"{name}: kernels == references on {agree:.1%} of rows"
        if agree < 0.99 or bool(got.non_finite.any()):
            failures.append(line)
        if params[0].top_k is not None and not params[0].needs_history:
            top = logits.topk(params[0].top_k, dim=-1).values[:, -1]
            if bool((logits.gather(1, got.token_ids[:, None])[:, 0] < top).any()):
                failures.append(f"{name}: a token outside its row's top-k")
        if got.logprobs is not None:
            want = logits.float().log_softmax(dim=-1).gather(1, got.token_ids[:, None])[:, 0]
            if not torch.allclose(got.logprobs.sampled_logprobs, want, atol=1e-3):
                failures.append(f"{name}: sampled logprobs differ from log_softmax")
        print(("ok   " if line not in failures else "FAIL ") + line, flush=True)
    return failures


def measure(iters: int) -> dict[str, dict[str, float]]:
    """Times of every case for the imported fnvllm."""
    logits, histories = make_inputs()
    return {name: time_step(step_function(rows, logits, histories), iters) for name, rows in cases().items()}


def baseline(directory: str, iters: int) -> dict[str, dict[str, float]] | None:
    """The baseline's times, measured by this script in a subprocess importing fnvllm from ``directory``."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(directory)}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--iters", str(iters)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"baseline failed:\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(new: dict[str, dict[str, float]], old: dict[str, dict[str, float]] | None) -> str:
    """The summary: per case, baseline and new step / host ms, and new step time relative to temperature only."""
    ref = new["temperature 0.6"]["step_ms"]
    head = f"{'case (256 rows, V 151936, bf16)':<36} {'old step':>9} {'old host':>9} {'new step':>9} {'new host':>9}"
    lines = [head + f" {'new vs T-only':>13}", "-" * (len(head) + 14)]
    for name, t in new.items():
        o = old.get(name) if old else None
        old_cols = f"{o['step_ms']:>9.3f} {o['host_ms']:>9.3f}" if o else f"{'-':>9} {'-':>9}"
        lines.append(f"{name:<36} {old_cols} {t['step_ms']:>9.3f} {t['host_ms']:>9.3f} {t['step_ms'] / ref:>13.2f}")
    return "\n".join(lines) + "\n(ms per sampling step, medians; host = until the calls return)"


def main() -> None:
    """Correctness, then the times of this tree (and of --baseline), then the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="root of an older fnvllm checkout to time beside this one")
    parser.add_argument("--iters", type=int, default=40, help="timed steps per case (default 40)")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("bench_sampling needs a CUDA GPU")
    if args.worker:
        print(json.dumps(measure(args.iters)))
        return
    logits, histories = make_inputs()
    failures = check_correctness(logits, histories)
    del logits
    old = baseline(args.baseline, args.iters) if args.baseline else None
    new = measure(args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"new": new, "old": old, "failures": failures}, f, indent=1)
    print("correctness: " + ("PASS" if not failures else "FAIL\n  " + "\n  ".join(failures)))
    print(table(new, old))


if __name__ == "__main__":
    main()

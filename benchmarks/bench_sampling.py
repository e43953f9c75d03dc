"""Sampling at the batch users run: 256 rows x 151,936-token bf16 logits, the sampler of this tree vs a baseline.

    PYTHONPATH=$PWD python3 benchmarks/bench_sampling.py [--baseline DIR] [--iters 40] [--json PATH]
    PYTHONPATH=$PWD python3 benchmarks/bench_sampling.py --topk [--iters 20]

--topk: only the A/B of the top-k rows' route (``segmented_pick`` vs ``filtered_pick``) and the penalised rows'
copy (torch or ``float_rows``), on flat (std 0.64) and std-3
logits, preset and preset + repetition_penalty: device us per sampling call and whether the tokens of 3 seeded
steps equal the old route's; a table last.

DIR: the root of an older checkout (its ``fnvllm/`` package), e.g. made on the development machine with
``git archive <commit> fnvllm | tar -x -C .bench_base`` and carried to the GPU machine. Its sampler is timed in a
subprocess (``PYTHONPATH=DIR``) by the same step function (it needs ``SlotHistory.penalties`` and
``prepare_sampling(..., penalties)``, as in commit db8d7ec). Without DIR only this tree's sampler is timed.

Cases (issue 19's table at the bench batch, plus the mix that used to send the batch to the general sampler,
seeds and greedy): temperature 0.6; + top_p 0.95 / top_k 20 (Qwen3's preset); + repetition_penalty 1.05 with
~600-token histories; min_p 0.05; logprobs 5; all of them together; 255 temperature rows + 1 top-p row; every row
seeded; greedy. Penalised rows go the executor's way: their tokens live in a per-slot device buffer
(``fnvllm.executor.history.SlotHistory``, written once at admission) and each step reads them from there.

1. Correctness first (this tree): for each case with every row seeded, the Triton kernels and the torch
   references pick the same token in >= 99 % of rows (a uniform within float32 rounding of a CDF step may differ),
   filtered rows pick inside their top-k, logprobs equal log_softmax of the logits, and the penalty kernel's
   logits equal its reference's.
2. Timing: per step = host preparation (``prepare_sampling`` from SamplingParams, the penalised rows' slot
   lookup) + the device work, as the executor runs it; ``host`` is the time until the calls return (no sync),
   ``step`` the synchronized wall time per step (whichever of host and device is longer), medians over --iters
   steps after a warm-up. Then the device time of a few parts (CUDA events), to see where a case's time goes.
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

ROWS, VOCAB, HISTORY_LEN = 256, 151936, 600
MAX_LEN = 4096  # the slot buffer's row length (max_model_len)
STARTED = time.perf_counter()  # --topk prints seconds since the start beside each case


def cases() -> dict[str, list[dict[str, Any]]]:
    """Per case, the SamplingParams keyword arguments of each of the 256 rows."""
    t = {"temperature": 0.6}
    qwen = {**t, "top_p": 0.95, "top_k": 20}
    return {
        "temperature 0.6": [t] * ROWS,
        "+ top_p 0.95, top_k 20": [qwen] * ROWS,
        "+ repetition_penalty 1.05": [{**t, "repetition_penalty": 1.05}] * ROWS,
        "temperature 0.6, min_p 0.05": [{**t, "min_p": 0.05}] * ROWS,
        "temperature 0.6, logprobs 5": [{**t, "logprobs": 5}] * ROWS,
        "all: top-p/k, rep. penalty, logprobs": [{**qwen, "repetition_penalty": 1.05, "logprobs": 5}] * ROWS,
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


def decode_plan(params: list[Any], histories: list[Any], admitted: bool) -> Any:
    """A decode StepPlan of every row (slot i = row i), each having generated its history's output; ``admitted``:
    the rows are new, and carry their histories (the executor writes them into its slot buffer)."""
    from fnvllm.state import StepPlan

    return StepPlan(
        step=0,
        block_size=16,
        seq_ids=tuple(f"r{i}" for i in range(ROWS)),
        input_tokens=tuple(h.output[-1:] for h in histories),
        start_positions=tuple(len(h.prompt) + len(h.output) - 1 for h in histories),
        block_tables=tuple((0,) * (MAX_LEN // 16) for _ in range(ROWS)),
        sample=(True,) * ROWS,
        params=tuple(params),
        num_generated=tuple(len(h.output) for h in histories),
        histories=tuple(h if admitted and p.needs_history else None for p, h in zip(params, histories, strict=True)),
        num_admitted=ROWS if admitted else 0,
        slots=tuple(range(ROWS)),
    )


def slot_history(params: list[Any], histories: list[Any], device: torch.device) -> tuple[Any, Any]:
    """A SlotHistory holding every penalised row's tokens (admitted once) and the decode plan of the next steps."""
    from fnvllm.executor.history import SlotHistory

    history = SlotHistory(ROWS, MAX_LEN, VOCAB, device)
    history.admit(decode_plan(params, histories, admitted=True))
    return history, decode_plan(params, histories, admitted=False)


def step_function(rows: list[dict[str, Any]], logits: torch.Tensor, histories: list[Any]) -> Callable[[], Any]:
    """One sampling step as the executor of the imported fnvllm runs it (penalised rows read the slot buffer)."""
    from fnvllm.executor.sampler import Sampler, prepare_sampling
    from fnvllm.state import SamplingParams

    params = [SamplingParams(**r) for r in rows]
    history, plan = slot_history(params, histories, logits.device)
    num_generated = [HISTORY_LEN // 2] * ROWS
    every_row = list(range(ROWS))
    sampler = Sampler(0)

    def step() -> Any:
        penalties = history.penalties(plan, every_row)
        batch = prepare_sampling(params, num_generated, [None] * ROWS, VOCAB, logits.device, penalties)
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
        history, plan = slot_history(params, histories, logits.device)
        penalties = history.penalties(plan, list(range(ROWS)))
        batch = prepare_sampling(params, [3] * ROWS, [None] * ROWS, VOCAB, logits.device, penalties)
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
    return failures + check_penalty_kernel(logits, histories)


def check_penalty_kernel(logits: torch.Tensor, histories: list[Any]) -> list[str]:
    """The penalty kernel's penalised logits vs its torch reference on the bench's rows; failure lines."""
    from fnvllm.kernels.sampling_ref import penalize_ref
    from fnvllm.state import SamplingParams

    params = [SamplingParams(repetition_penalty=1.05, frequency_penalty=0.3, presence_penalty=0.2)] * ROWS
    history, plan = slot_history(params, histories, logits.device)
    pen = history.penalties(plan, list(range(ROWS)))
    if not hasattr(pen, "meta"):  # an older tree: no penalty kernel to check
        return []
    got = pen.apply_(logits.float())
    want = penalize_ref(logits.float(), pen.tokens, pen.meta, pen.factors)
    worst = (got - want).abs().max().item()
    line = f"penalty kernel == reference: max |difference| {worst:.2e}, {int((got != logits.float()).sum())} edited"
    print(("ok   " if worst <= 1e-5 else "FAIL ") + line, flush=True)
    return [] if worst <= 1e-5 else [line]


def device_ms(fn: Callable[[], Any], iters: int = 20) -> float:
    """Median device time of ``fn`` in ms (CUDA events around each call, after a warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def guarded(experiment: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The experiment's numbers, or one line naming its error (an experiment must not lose the others)."""
    try:
        return experiment()
    except Exception as error:  # reported in the table, not raised
        return {f"FAILED: {type(error).__name__}: {str(error)[:60]}": float("nan")}


def logprob_chunks(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> dict[str, float]:
    """Device ms of ``compute_logprobs`` (n 5) with each largest candidate chunk (``LOGPROB_MAX_CHUNK``), each
    checked against torch.topk over whole rows first (the same top values within 1e-4)."""
    from fnvllm.executor import sampler

    want = sampler.compute_logprobs(logits, tokens, rows, 5, False)
    default, out = sampler.LOGPROB_MAX_CHUNK, {}
    cap, sampler.LOGPROB_MAX_CANDIDATES = sampler.LOGPROB_MAX_CANDIDATES, 1 << 30  # the chunk as given
    for chunk in (256, 512, 1024):  # 128: more than 1024 chunks of a 151,936 row, so torch.topk on rows
        sampler.LOGPROB_MAX_CHUNK = chunk
        got = sampler.compute_logprobs(logits, tokens, rows, 5, True)
        same = torch.allclose(got.top_logprobs, want.top_logprobs, atol=1e-4)  # ids may differ only at ties
        label = f"logprobs 5, candidates of chunks <= {chunk}" + ("" if same else " (MISMATCH vs torch.topk)")
        out[label] = device_ms(lambda: sampler.compute_logprobs(logits, tokens, rows, 5, True))
    sampler.LOGPROB_MAX_CHUNK, sampler.LOGPROB_MAX_CANDIDATES = default, cap
    return out


def parts(logits: torch.Tensor, histories: list[Any]) -> dict[str, float]:
    """Device ms of the pieces the cases are made of, at 256 rows (to see where a case's time goes). "flat": the
    logits of a random-weight checkpoint (std ~0.64, many bf16 ties), where the filter kernel's search can be slow."""
    from fnvllm.executor.sampler import Sampler, compute_logprobs, prepare_sampling
    from fnvllm.kernels.sampling import logprob_candidates
    from fnvllm.kernels.sampling_filters import log_partition
    from fnvllm.state import SamplingParams

    rows = torch.arange(ROWS, device=logits.device, dtype=torch.int32)
    tokens = logits.argmax(dim=-1)
    flat = (logits.float() * (0.64 / 3)).to(torch.bfloat16)
    qwen = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20)] * ROWS
    qwen_batch = prepare_sampling(qwen, [0] * ROWS, [None] * ROWS, VOCAB, logits.device)
    seeded = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=i) for i in range(ROWS)]
    seeded_qwen = prepare_sampling(seeded, [0] * ROWS, [None] * ROWS, VOCAB, logits.device)
    pen = [SamplingParams(temperature=0.6, repetition_penalty=1.05)] * ROWS
    history, plan = slot_history(pen, histories, logits.device)
    penalties = history.penalties(plan, list(range(ROWS)))
    assert penalties is not None
    work = logits.float()
    out = {
        "float32 copy of the logits": device_ms(lambda: logits.float()),
        "penalties on the float32 copy": device_ms(lambda: penalties.apply_(work)),
        "log-partition, row kernel": device_ms(lambda: log_partition(logits, rows)),
        "logprob candidates (lse + top-5 chunks)": device_ms(lambda: logprob_candidates(logits, rows, 5)),
        "logprobs 5, chunk candidates (default)": device_ms(lambda: compute_logprobs(logits, tokens, rows, 5, True)),
        "logprobs 5, torch.topk on rows": device_ms(lambda: compute_logprobs(logits, tokens, rows, 5, False)),
        **guarded(lambda: logprob_chunks(logits, tokens, rows)),
        "torch.topk 5": device_ms(lambda: logits.topk(5, dim=-1)),
        "torch.topk 84 (top-k 20 candidates)": device_ms(lambda: logits.topk(84, dim=-1)),
    }
    from fnvllm.executor import fused_sampling

    for name, source in (("", logits), (", flat", flat)):
        for by_kernel in (True, False):
            fused_sampling.TOP_K_BY_FILTER_KERNEL = by_kernel
            label = f"preset{name}, " + ("filter kernel (default)" if by_kernel else "torch.topk candidates")
            out[label] = device_ms(lambda s=source: Sampler(0).sample(s, qwen_batch))
        fused_sampling.TOP_K_BY_FILTER_KERNEL = True
        out |= guarded(lambda s=source, n=name: filter_chunks(s, n, qwen_batch, seeded_qwen))
    return out


def filter_chunks(source: torch.Tensor, name: str, batch: Any, seeded: Any) -> dict[str, float]:
    """Device ms of the preset's sampling with the filter kernel skipping by finer chunk maxima (FILTER_CHUNK),
    each checked first: the seeded rows draw the default path's tokens."""
    from fnvllm.executor import fused_sampling
    from fnvllm.executor.sampler import Sampler

    out = {}
    want = Sampler(0).sample(source, seeded).token_ids
    try:
        for chunk in (512, 1024, 2048):
            fused_sampling.FILTER_CHUNK = chunk
            same = torch.equal(Sampler(0).sample(source, seeded).token_ids, want)
            label = f"preset{name}, filter kernel, maxima of {chunk}" + ("" if same else " (TOKENS DIFFER)")
            out[label] = device_ms(lambda: Sampler(0).sample(source, batch))
    finally:
        fused_sampling.FILTER_CHUNK = None
    return out


# ---- --topk: the top-k rows' parallel candidate pass and the penalised rows' copy kernel, old route vs new -------

TOPK_HISTORY_LEN = 1100  # tokens per penalised row's history (prompt + output), as in the bench workload's decode
TOPK_CASES = {
    "preset": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    "preset + rep 1.05": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05},
    "top_k 50, top_p 0.95": {"temperature": 0.6, "top_p": 0.95, "top_k": 50},  # above the 38 chunks: finer maxima
}
TOPK_RUNS = [(0.64, "preset"), (0.64, "preset + rep 1.05"), (3.0, "preset"), (3.0, "preset + rep 1.05")]
TOPK_RUNS += [(0.64, "top_k 50, top_p 0.95")]
QUICK = False  # --quick: the flat preset and preset + repetition cases only, routes old / new (+ its A/B switch)
_SWITCHES = ("TOP_K_BY_SEGMENTS", "PENALISED_COPY_BY_KERNEL", "PENALTIES_FROM_SOURCE")
TOPK_ROUTES = {  # fused_sampling's switches per route (those on); "old": main before them, "new": the defaults
    "old": (),
    "new": ("TOP_K_BY_SEGMENTS", "PENALISED_COPY_BY_KERNEL"),
    "segments only": ("TOP_K_BY_SEGMENTS",),
    "new + pen. from source": ("TOP_K_BY_SEGMENTS", "PENALISED_COPY_BY_KERNEL", "PENALTIES_FROM_SOURCE"),
    "copy kernel only": ("PENALISED_COPY_BY_KERNEL",),
}


def routed(on: tuple[str, ...], segment: int = 16) -> None:
    """Set fused_sampling's route switches (those in ``on`` True, the others False) and sampling_segments.SEGMENT."""
    from fnvllm.executor import fused_sampling
    from fnvllm.kernels import sampling_segments

    for name in _SWITCHES:
        setattr(fused_sampling, name, name in on)
    sampling_segments.SEGMENT = segment


def topk_batches(kwargs: dict[str, Any], logits: torch.Tensor, steps: int) -> list[Any]:
    """``steps`` SamplingBatches of 256 seeded rows with these settings (draw counters 3, 4, ...: other uniforms),
    penalised rows reading ~TOPK_HISTORY_LEN-token histories from a SlotHistory as the executor does."""
    from fnvllm.executor.sampler import prepare_sampling
    from fnvllm.state import SamplingParams
    from fnvllm.state.plan import TokenHistory

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, TOPK_HISTORY_LEN), generator=gen).tolist()
    half = TOPK_HISTORY_LEN // 2
    histories = [TokenHistory(prompt=tuple(r[:half]), output=tuple(r[half:])) for r in ids]
    params = [SamplingParams(**kwargs, seed=1000 + i) for i in range(ROWS)]
    history, plan = slot_history(params, histories, logits.device)
    penalties = history.penalties(plan, list(range(ROWS)))
    return [
        prepare_sampling(params, [3 + step] * ROWS, [None] * ROWS, VOCAB, logits.device, penalties)
        for step in range(steps)
    ]


def overflow_stats(logits: torch.Tensor, batch: Any) -> str:
    """Candidates per row at or above the floor (k-th largest chunk maximum) and the rows whose fullest chunk holds
    more than a segment of them (those fall back to the per-row path), from the logits the filter reads, at the
    chunk and segment the segments route takes for these rows."""
    from fnvllm.executor import fused_sampling
    from fnvllm.executor.fused_sampling import penalised_copy
    from fnvllm.kernels import sampling_segments
    from fnvllm.kernels.sampling import CHUNK

    chunk, segment = CHUNK, sampling_segments.SEGMENT
    if int(batch.top_k.max()) > -(-VOCAB // CHUNK):
        chunk, segment = fused_sampling.SEGMENTS_FINE_CHUNK, fused_sampling.SEGMENTS_FINE_SEGMENT
    source = penalised_copy(logits, batch)
    source = (logits if source is None else source).float() * batch.scale[:, None]
    num_chunks = -(-VOCAB // chunk)
    s = torch.nn.functional.pad(source, (0, num_chunks * chunk - VOCAB), value=float("-inf"))
    s = s.view(ROWS, num_chunks, chunk)
    maxima = s.amax(dim=-1)  # (R, C)
    floor = maxima.sort(dim=-1, descending=True).values.gather(1, (batch.top_k.long() - 1)[:, None])  # (R, 1)
    counts = (s >= floor[:, :, None]).sum(dim=-1)  # (R, C)
    over = int((counts.amax(dim=-1) > segment).sum())
    mean = counts.sum(dim=-1).float().mean().item()
    return f"chunks of {chunk}: {mean:.1f} candidates/row, {over} rows with over {segment} in a chunk"


def kernel_sums(fn: Callable[[], Any], calls: int = 5) -> str:
    """The kernels of ``fn`` by torch.profiler: us per call each, largest first (one line)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if total > 0:
            rows.append((total / calls, event.key))
    rows.sort(reverse=True)
    return ", ".join(f"{name[:40]} {us:.1f}" for us, name in rows[:6])


def topk_route(
    logits: torch.Tensor, batches: list[Any], on: tuple[str, ...], segment: int, iters: int
) -> tuple[Any, float]:
    """(tokens (3, R) of the seeded steps, device us per call of the first) with fused_sampling's switches set."""
    from fnvllm.executor.sampler import Sampler

    routed(on, segment)
    sampler = Sampler(0)
    tokens = torch.stack([sampler.sample(logits, b).token_ids for b in batches])  # (3, R)
    return tokens, 1e3 * device_ms(lambda: sampler.sample(logits, batches[0]), iters)


def topk_case(spread: str, case: str, logits: torch.Tensor, iters: int) -> list[tuple[str, str, str, float, str]]:
    """One spread and case of ``topk_ab``: every route (segment 8 and 32 too), printed as measured."""
    from fnvllm.executor.sampler import Sampler

    batches = topk_batches(TOPK_CASES[case], logits, steps=3)
    stats = guarded_text(lambda: overflow_stats(logits, batches[0]))
    print(f"[{time.perf_counter() - STARTED:.0f} s] {spread}, {case}: {stats}", flush=True)
    penalty_routes = [name for name in TOPK_ROUTES if "copy" in name or "pen." in name]
    variants = [(name, on, 16) for name, on in TOPK_ROUTES.items() if "rep" in case or name not in penalty_routes]
    if QUICK:
        variants = [v for v in variants if v[0] in ("old", "new", "new + pen. from source")]
    elif "top_k 50" in case:
        variants = variants[:3]  # old, new, segments only
    elif spread == "std 0.64" and "rep" not in case:  # the bench checkpoint's spread: the one to tune on
        variants += [(f"new, segment {seg}", TOPK_ROUTES["new"], seg) for seg in (8, 32)]
    results, want = [], None
    for route, on, segment in variants:
        tokens, us = topk_route(logits, batches, on, segment, iters)
        want = tokens if want is None else want
        differ = int((tokens != want).sum())
        verdict = "PASS" if differ == 0 else f"FAIL ({differ} of {tokens.numel()} differ)"
        results.append((spread, case, route, us, verdict))
        print(f"  {route:<22} {us:>8.1f} us  tokens == old: {verdict}", flush=True)
        if route in ("old", "new"):
            sampler, batch = Sampler(0), batches[0]
            sums = guarded_text(lambda: kernel_sums(lambda: sampler.sample(logits, batch)))  # noqa: B023
            print(f"    kernels (us/call): {sums}", flush=True)
    routed(TOPK_ROUTES["old"])
    assert want is not None
    agree = (Sampler(kernels=False).sample(logits, batches[0]).token_ids == want[0]).float().mean().item()
    print(f"  old route == float64 reference on {agree:.1%} of rows (a CDF step within rounding may differ)")
    return results


def topk_ab(iters: int) -> list[tuple[str, str, str, float, str]]:
    """Per logits spread (flat std 0.64, std 3) and case (preset, + repetition): device us per sampling call of
    each route (CUDA events), and whether its tokens on 3 seeded steps equal the old route's."""
    results = []
    runs = TOPK_RUNS[:2] if QUICK else TOPK_RUNS
    for run, (spread, case) in enumerate(runs):
        gen = torch.Generator().manual_seed(0)
        logits = (torch.randn(ROWS, VOCAB, generator=gen) * spread).to(torch.bfloat16).cuda()
        results += topk_case(f"std {spread}", case, logits, iters)
        if run in (1, len(runs) - 1):  # so far (a kill at the budget keeps it), and all of it last
            print(topk_table(results), flush=True)
    return results


def guarded_text(fn: Callable[[], str]) -> str:
    """fn's text, or its error in one line."""
    try:
        return fn()
    except Exception as error:  # a diagnostic must not stop the A/B
        return f"FAILED: {type(error).__name__}: {str(error)[:80]}"


def topk_table(results: list[tuple[str, str, str, float, str]]) -> str:
    """The --topk summary: per spread, case and route, device us per call, vs the old route, token equality."""
    head = f"{'logits':<9} {'case':<20} {'route':<22} {'us/call':>8} {'vs old':>7}  tokens == old (3 seeded steps)"
    lines = [head, "-" * len(head)]
    old = {(a, b): us for a, b, route, us, _ in results if route == "old"}
    for spread, case, route, us, verdict in results:
        lines.append(f"{spread:<9} {case:<20} {route:<22} {us:>8.1f} {us / old[spread, case]:>7.2f}  {verdict}")
    note = "(256 rows x 151,936 bf16, one Sampler.sample call, device time by CUDA events, medians)"
    return "\n".join([*lines, note])


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
    parser.add_argument("--topk", action="store_true", help="only the top-k / penalised-copy A/B (old vs new route)")
    parser.add_argument("--quick", action="store_true", help="with --topk: flat logits, old and new routes only")
    args = parser.parse_args()
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("bench_sampling needs a CUDA GPU")
    if args.topk:
        global QUICK
        QUICK = args.quick
        topk_ab(args.iters)  # prints the table after each spread, the whole one last
        return
    if args.worker:
        print(json.dumps(measure(args.iters)))
        return
    logits, histories = make_inputs()
    failures = check_correctness(logits, histories)
    del logits
    old = baseline(args.baseline, args.iters) if args.baseline else None
    new = measure(args.iters)
    print("correctness: " + ("PASS" if not failures else "FAIL\n  " + "\n  ".join(failures)))
    print(table(new, old), flush=True)  # first: the parts below are experiments, and may fail on their own
    logits, histories = make_inputs()
    pieces = parts(logits, histories)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"new": new, "old": old, "parts": pieces, "failures": failures}, f, indent=1)
    print("\n".join(f"{name:<48} {ms:>8.3f} ms (device)" for name, ms in pieces.items()))


if __name__ == "__main__":
    main()

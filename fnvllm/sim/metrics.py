"""Serving metrics of a simulation, with the definitions vLLM's benchmarks use.

Per request: TTFT = first token - arrival; TPOT = (finish - first token) / (tokens - 1), for requests with at
least 2 tokens; end-to-end latency = finish - arrival; queueing time = first scheduled - arrival. Per token:
inter-token latency (ITL) = time since the same request's previous token. Throughput = tokens / duration, where
duration runs from the first arrival to the last finish. Percentiles interpolate linearly between order
statistics (numpy's default). KV usage = blocks held by requests / all blocks, after each step; its mean is
weighted by step duration (idle time between arrivals excluded). Prefix-cache hit rate = tokens found in the
cache / tokens to compute, over every admission (a preempted request that is admitted again counts again).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence
from itertools import accumulate
from operator import mul
from typing import Any

from fnvllm.sim.recorder import Recorder

STATS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending values, linearly interpolated (NaN when empty)."""
    n = len(sorted_values)
    if not n:
        return math.nan
    rank = q / 100 * (n - 1)
    lo = int(rank)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def weighted_percentile(pairs: Iterable[tuple[float, int]], q: float) -> float:
    """``percentile`` of the multiset in which each value appears ``count`` times (NaN when empty)."""
    items = sorted(p for p in pairs if p[1] > 0)
    if not items:
        return math.nan
    ends = list(accumulate(count for _, count in items))  # ends[i]: ranks < ends[i] hold items[i]'s value
    rank = q / 100 * (ends[-1] - 1)
    lo = int(rank)

    def at(k: int) -> float:
        return items[bisect.bisect_right(ends, k)][0]

    low = at(lo)
    return low + (at(min(lo + 1, ends[-1] - 1)) - low) * (rank - lo)


def _stats(values: list[float]) -> dict[str, float]:
    """Mean and percentiles of values (NaNs dropped)."""
    clean = sorted(v for v in values if not math.isnan(v))
    mean = sum(clean) / len(clean) if clean else math.nan
    return {"mean": mean, "p50": percentile(clean, 50), "p90": percentile(clean, 90), "p99": percentile(clean, 99)}


def _weighted_stats(pairs: list[tuple[float, int]]) -> dict[str, float]:
    """Mean and percentiles of a (value, count) multiset."""
    total = sum(c for _, c in pairs)
    mean = sum(v * c for v, c in pairs) / total if total else math.nan
    return {"mean": mean, **{f"p{q}": weighted_percentile(pairs, q) for q in (50, 90, 99)}}


def request_latencies(rec: Recorder) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT (NaN under 2 tokens), end-to-end and queueing times, in seconds."""
    arrival = rec.arrival
    tpot = [
        (f - t) / (n - 1) if n > 1 else math.nan
        for f, t, n in zip(rec.finish, rec.first_token, rec.num_output, strict=True)
    ]
    return {
        "ttft": [t - a for t, a in zip(rec.first_token, arrival, strict=True)],
        "tpot": tpot,
        "e2e": [f - a for f, a in zip(rec.finish, arrival, strict=True)],
        "queue": [s - a for s, a in zip(rec.first_scheduled, arrival, strict=True)],
    }


def summarize(rec: Recorder, end_s: float) -> dict[str, float]:
    """Every metric as a flat name -> number dict (latencies in milliseconds, throughputs per second)."""
    finished = [f for f in rec.finish if not math.isnan(f)]
    start = min(rec.arrival) if rec.arrival else 0.0
    duration = (max(finished) if finished else end_s) - start
    out_tokens, in_tokens = sum(rec.num_output), sum(rec.prompt_len)
    summary: dict[str, float] = {
        "num_requests": len(rec.arrival),
        "num_finished": len(finished),
        "num_steps": len(rec.step_end),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / duration if duration > 0 else math.nan,
        "total_tok_per_s": (out_tokens + in_tokens) / duration if duration > 0 else math.nan,
        "requests_per_s": len(finished) / duration if duration > 0 else math.nan,
    }
    latencies = {name: _stats(values) for name, values in request_latencies(rec).items()}
    latencies["itl"] = _weighted_stats(rec.itl)
    for name in LATENCIES:
        summary.update({f"{name}_{stat}_ms": latencies[name][stat] * 1e3 for stat in STATS})
    summary.update(_engine_stats(rec))
    return summary


def _engine_stats(rec: Recorder) -> dict[str, float]:
    """Preemptions, prefix-cache hit rate, batch size and KV usage over the run's steps."""
    busy = [n for n in rec.num_seqs if n]
    durations = [e - s for s, e in zip(rec.step_start, rec.step_end, strict=True)]
    busy_s = sum(durations)
    return {
        "preemptions": rec.num_preemptions,
        "prefix_hit_rate": rec.num_hit_tokens / rec.num_admitted_tokens if rec.num_admitted_tokens else 0.0,
        "mean_batch_seqs": sum(busy) / len(busy) if busy else 0.0,
        "mean_batch_tokens": sum(rec.num_tokens) / len(busy) if busy else 0.0,
        "mean_kv_usage": sum(map(mul, rec.kv_blocks, durations)) / busy_s / rec.num_blocks if busy_s else 0.0,
        "peak_kv_usage": max(rec.kv_blocks, default=0) / rec.num_blocks,
        "peak_waiting": max(rec.num_waiting, default=0),
    }


def json_text(value: Any, **dumps_options: Any) -> str:
    """``value`` as standard JSON: a metric that is undefined (NaN: TPOT when every request made one token) or
    infinite is ``null``, not Python's ``NaN`` / ``Infinity``, which strict parsers (jq, ``JSON.parse``) refuse."""
    return json.dumps(_finite(value), allow_nan=False, **dumps_options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_table(summary: dict[str, float]) -> str:
    """A human-readable table of ``summarize``'s output."""
    s = summary
    lines = [
        f"requests {s['num_finished']:.0f}/{s['num_requests']:.0f} in {s['duration_s']:.3f} s simulated "
        f"({s['num_steps']:.0f} steps)",
        f"throughput: {s['output_tok_per_s']:,.1f} output tok/s, {s['total_tok_per_s']:,.1f} total tok/s, "
        f"{s['requests_per_s']:.2f} req/s",
        f"{'latency (ms)':<14}" + "".join(f"{stat:>12}" for stat in STATS),
    ]
    for name in LATENCIES:
        lines.append(f"{name:<14}" + "".join(f"{s[f'{name}_{stat}_ms']:>12.2f}" for stat in STATS))
    lines.append(
        f"preemptions {s['preemptions']:.0f}, prefix-cache hit rate {s['prefix_hit_rate']:.1%}, "
        f"batch {s['mean_batch_seqs']:.1f} seqs / {s['mean_batch_tokens']:.0f} tokens, "
        f"KV usage mean {s['mean_kv_usage']:.1%} peak {s['peak_kv_usage']:.1%}, peak waiting {s['peak_waiting']:.0f}"
    )
    return "\n".join(lines)

"""Metric definitions on hand-computed tiny simulations, and the percentile helpers against numpy."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from fnvllm.sim import SimExecutor, SimRequest, percentile, simulate, summarize, weighted_percentile
from fnvllm.sim.cost import StepShape
from fnvllm.state import CoreConfig


class _Hardware:
    graph_max_seqs = 0


class UnitCost:
    """Every non-empty step takes exactly 1 simulated second (no gap)."""

    hardware = _Hardware()

    def device_s(self, shape: StepShape) -> float:
        return 1.0 if shape.num_seqs else 0.0

    def gap_s(self, shape: StepShape) -> float:
        return 0.0


CONFIG = CoreConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, vocab_size=100)


def _summary(requests: list[SimRequest]) -> dict[str, float]:
    result = simulate(requests, CONFIG, SimExecutor(UnitCost()))  # type: ignore[arg-type]
    return summarize(result.recorder, result.end_s)


def test_latencies_of_two_overlapping_requests() -> None:
    """A (t=0, 3 tokens) and B (t=0.5, 2 tokens) on 1-second steps: TTFT 1 and 1.5, TPOT 1, E2E 3 and 2.5."""
    s = _summary([SimRequest(0.0, 4, 3), SimRequest(0.5, 4, 2)])
    # step [0,1]: A prefills, token 1 at 1. step [1,2]: A decodes (token 2), B (added at 1) prefills (token 1).
    # step [2,3]: both decode; A has 3 tokens, B 2: both finish at 3.
    assert s["num_steps"] == 3 and s["duration_s"] == 3.0
    assert s["output_tokens"] == 5 and s["output_tok_per_s"] == pytest.approx(5 / 3)
    assert s["ttft_mean_ms"] == pytest.approx(1250) and s["ttft_p90_ms"] == pytest.approx(1450)
    assert s["tpot_mean_ms"] == pytest.approx(1000) and s["itl_p99_ms"] == pytest.approx(1000)
    assert s["e2e_mean_ms"] == pytest.approx(2750) and s["e2e_p50_ms"] == pytest.approx(2750)
    assert s["queue_mean_ms"] == pytest.approx(250) and s["queue_p99_ms"] == pytest.approx(495)
    assert s["requests_per_s"] == pytest.approx(2 / 3)


def test_idle_clock_jumps_to_the_next_arrival() -> None:
    """A request arriving at t=10 after the engine went idle at t=2 starts at 10: TTFT 1, finish 11."""
    s = _summary([SimRequest(0.0, 4, 2), SimRequest(10.0, 4, 1)])
    assert s["num_steps"] == 3 and s["duration_s"] == 11.0
    assert s["ttft_p50_ms"] == pytest.approx(1000) and s["queue_mean_ms"] == 0
    assert s["tpot_mean_ms"] == pytest.approx(1000)  # only the 2-token request has a TPOT
    assert s["e2e_mean_ms"] == pytest.approx((2000 + 1000) / 2)


def test_prefix_hit_rate_counts_cached_tokens_at_admission() -> None:
    """Two identical 9-token prompts, the second arriving later: 8 of its 9 tokens hit (2 full blocks of 4)."""
    prompt = tuple(range(1, 10))
    s = _summary([SimRequest(0.0, 9, 1, prompt=prompt), SimRequest(5.0, 9, 1, prompt=prompt)])
    assert s["prefix_hit_rate"] == pytest.approx(8 / 18)


def test_kv_usage_and_batch_size() -> None:
    """One 8-token prompt with 4 outputs holds 3 blocks then none: KV peak 3/64; every step has batch 1."""
    s = _summary([SimRequest(0.0, 8, 4)])
    assert s["peak_kv_usage"] == pytest.approx(3 / 64)
    assert s["mean_batch_seqs"] == 1.0 and s["mean_batch_tokens"] == pytest.approx((8 + 3) / 4)


def test_percentile_matches_numpy() -> None:
    """percentile() equals numpy's default (linear) percentile on random data; empty input gives NaN."""
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = sorted(rng.random() for _ in range(n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))


def test_weighted_percentile_equals_the_repeated_list() -> None:
    """weighted_percentile of (value, count) pairs equals numpy's percentile of the expanded multiset."""
    rng = random.Random(1)
    for _ in range(20):
        pairs = [(rng.random(), rng.randint(1, 5)) for _ in range(rng.randint(1, 8))]
        expanded = [v for v, c in pairs for _ in range(c)]
        for q in (0, 25, 50, 90, 99, 100):
            assert weighted_percentile(pairs, q) == pytest.approx(np.percentile(expanded, q))

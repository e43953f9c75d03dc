"""Prometheus metrics of one server, in its own registry (two servers in one process do not collide).

Gauges and totals are read from the engine's latest ``EngineSnapshot`` at scrape time; latency histograms and the
per-step batch size are observed as the engine's step reports arrive (requests finished, steps run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fnvllm.engine import RequestOutput
from fnvllm.serve.async_engine import EngineSnapshot

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _SnapshotCollector(Collector):
    """Engine gauges and counters from the latest snapshot."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        """One metric family per engine gauge or total."""
        s = self._snapshot()
        yield GaugeMetricFamily("fnvllm_num_requests_running", "Requests running (holding KV blocks).", s.num_running)
        yield GaugeMetricFamily("fnvllm_num_requests_waiting", "Requests waiting to be admitted.", s.num_waiting)
        yield GaugeMetricFamily("fnvllm_kv_cache_used_blocks", "KV blocks held by live requests.", s.num_used_blocks)
        yield GaugeMetricFamily("fnvllm_kv_cache_num_blocks", "KV blocks in the pool.", s.num_blocks)
        yield GaugeMetricFamily(
            "fnvllm_kv_cache_usage_ratio", "Fraction of KV blocks in use (0 to 1).", s.num_used_blocks / s.num_blocks
        )
        hits, prompts = s.stats.num_cached_tokens, s.num_prompt_tokens
        yield GaugeMetricFamily(
            "fnvllm_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens admitted.",
            min(1.0, hits / prompts) if prompts else 0.0,
        )
        yield CounterMetricFamily("fnvllm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", hits)
        yield CounterMetricFamily("fnvllm_prompt_tokens", "Prompt tokens of admitted requests.", prompts)
        yield CounterMetricFamily("fnvllm_generation_tokens", "Tokens generated.", s.stats.num_generated_tokens)
        yield CounterMetricFamily("fnvllm_num_preemptions", "Sequences preempted.", s.stats.num_preemptions)
        yield CounterMetricFamily("fnvllm_engine_steps", "Engine steps run.", s.stats.num_steps)
        yield CounterMetricFamily("fnvllm_engine_failed_steps", "Engine steps that raised.", s.num_failed_steps)


class ServerMetrics:
    """The server's registry: engine snapshot gauges, request latency histograms, finished-request counts.

    Implements ``EngineObserver`` (``on_step``, ``on_finish``); ``render()`` is the ``/metrics`` body.
    """

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot))
        r = self.registry
        self.ttft = Histogram(
            "fnvllm_time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "fnvllm_time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "fnvllm_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.batch = Histogram(
            "fnvllm_step_num_sequences", "Sequences scheduled in one step.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.finished = Counter(
            "fnvllm_requests_finished", "Finished requests by reason.", ["finish_reason"], registry=r
        )

    def on_step(self, num_seqs: int) -> None:
        """Record one step's batch size."""
        self.batch.observe(num_seqs)

    def on_finish(self, output: RequestOutput) -> None:
        """Count a finished request; observe its latencies unless it was aborted."""
        self.finished.labels(finish_reason=output.finish_reason or "abort").inc()
        metrics = output.metrics
        if metrics is None or output.finish_reason == "abort":
            return
        for histogram, value in (
            (self.ttft, metrics.ttft),
            (self.e2e, metrics.e2e_latency),
            (self.tpot, metrics.tpot(len(output.token_ids))),
        ):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

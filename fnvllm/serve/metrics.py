"""Prometheus metrics of one server, in its own registry (two servers in one process do not collide).

Gauges and totals are read from the engine's latest ``EngineSnapshot`` at scrape time; per-request histograms and
the per-step batch size are observed as the engine's step reports arrive (requests finished, steps run).

Per-request histograms (vLLM's ``vllm:request_*`` and latency families, under ``fnvllm_``), from what a finished
``RequestOutput`` carries: prompt and generated token counts, time to first token, time per output token, decode
time (first token to finish), queue time (arrival to the plan that first admitted it), prefill time (that plan
to the first token), inference time (that plan to finish) and end-to-end latency. An aborted request (a client
that left, a shutdown) is counted in ``fnvllm_requests_finished_total{finish_reason="abort"}`` and observed in none
of them, tokens included, so every per-request histogram counts the same requests (those that finished "stop" or
"length"). Prompt tokens served from the prefix cache are the counter
``fnvllm_prefix_cache_hit_tokens_total`` (not repeated here).
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
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(18))  # 1, 2, 4, ..., 131072 tokens
# A request's decode phase can run for minutes (thousands of tokens behind a big batch): longer tail than latency.
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


# (RequestMetrics property, metric name, help, buckets) of the per-request time histograms
_REQUEST_TIMES = (
    ("ttft", "fnvllm_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
    ("e2e_latency", "fnvllm_e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS),
    ("decode_time", "fnvllm_request_decode_time_seconds", "First token to finish (the decode phase) of a request.",
     _DURATION_BUCKETS),
    ("queue_time", "fnvllm_request_queue_time_seconds",
     "Arrival to first admission (waiting in the queue) of a request.", _DURATION_BUCKETS),
    ("prefill_time", "fnvllm_request_prefill_time_seconds",
     "First admission to first token (the prefill phase) of a request.", _DURATION_BUCKETS),
    ("inference_time", "fnvllm_request_inference_time_seconds", "First admission to finish (running) of a request.",
     _DURATION_BUCKETS),
)  # fmt: skip


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
    """The server's registry: engine snapshot gauges, per-request token and latency histograms, finished-request
    counts.

    Implements ``EngineObserver`` (``on_step``, ``on_finish``); ``render()`` is the ``/metrics`` body.
    prompt_tokens / generation_tokens: per finished request, its prompt length and the tokens the engine generated
    for it (an EOS or stop token that ended it included; the same count as ``usage.completion_tokens``, except
    that a ``max_tokens: 0`` scoring request generates one token its answer drops). times: by ``RequestMetrics``
    property (ttft, e2e_latency, decode_time, queue_time, prefill_time, inference_time), its histogram (seconds).
    """

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(snapshot))
        r = self.registry
        # one histogram per RequestMetrics time of a finished request (its property of the same name)
        self.times = {
            attribute: Histogram(name, description, buckets=buckets, registry=r)
            for attribute, name, description, buckets in _REQUEST_TIMES
        }
        self.tpot = Histogram(
            "fnvllm_time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch = Histogram(
            "fnvllm_step_num_sequences", "Sequences scheduled in one step.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.prompt_tokens = Histogram(
            "fnvllm_request_prompt_tokens", "Prompt length of a finished request, in tokens.",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.generation_tokens = Histogram(
            "fnvllm_request_generation_tokens", "Tokens generated for a finished request.",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "fnvllm_requests_finished", "Finished requests by reason.", ["finish_reason"], registry=r
        )

    def on_step(self, num_seqs: int) -> None:
        """Record one step's batch size."""
        self.batch.observe(num_seqs)

    def on_finish(self, output: RequestOutput) -> None:
        """Count a finished request; observe its token counts and latencies unless it was aborted."""
        self.finished.labels(finish_reason=output.finish_reason or "abort").inc()
        if output.finish_reason in (None, "abort"):
            return
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(len(output.token_ids))
        metrics = output.metrics
        if metrics is None:
            return
        for attribute, histogram in self.times.items():
            value = getattr(metrics, attribute)
            if value is not None:
                histogram.observe(value)
        tpot = metrics.tpot(len(output.token_ids))
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

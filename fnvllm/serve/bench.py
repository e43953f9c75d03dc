"""Load benchmark of a running ``fnvllm serve``: replay the nano-vllm bench workload as streaming completions.

    fnvllm serve MODEL --port 8000 &
    python -m fnvllm.serve.bench --url http://127.0.0.1:8000 --num-requests 256            # all at once
    python -m fnvllm.serve.bench --url ... --request-rate 20                                # Poisson arrivals

Each request sends token ids (``fnvllm.benchmark.bench_workload``: temperature 0.6, ignore_eos) with
``stream: true`` and ``stream_options.include_usage``; we time the first streamed chunk (TTFT), the last (e2e),
and count output tokens from the usage chunk. Reports output tok/s over the whole run and p50/p90/p99 of TTFT,
TPOT ((e2e - TTFT) / (tokens - 1)) and e2e latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

from fnvllm.benchmark import bench_workload
from fnvllm.state import SamplingParams


@attrs.frozen
class RequestTiming:
    """One request's latencies (seconds) and output length."""

    ttft: float
    e2e: float
    num_tokens: int

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return (self.e2e - self.ttft) / (self.num_tokens - 1) if self.num_tokens > 1 else None


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 (milliseconds) of ``values`` (seconds)."""
    if len(values) < 2:
        return {p: 1000 * (values[0] if values else float("nan")) for p in ("p50", "p90", "p99")}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": 1000 * cuts[49], "p90": 1000 * cuts[89], "p99": 1000 * cuts[98]}


async def _one(client: httpx.AsyncClient, body: dict[str, Any], start_at: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    sent = time.perf_counter()
    first, num_tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    return RequestTiming((first or done) - sent, done - sent, num_tokens)


def _body(model: str | None, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature, "stream": True}
    body |= {"ignore_eos": params.ignore_eos, "stream_options": {"include_usage": True}}
    return body | ({"model": model} if model else {})


async def run_load(
    url: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    request_rate: float = float("inf"),
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> tuple[list[RequestTiming], float]:
    """Send every request (all at once, or Poisson arrivals at ``request_rate`` per second); returns each
    request's timing and the run's wall time in seconds."""
    rng, offset = random.Random(seed), 0.0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=None) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, p in zip(prompts, params, strict=True):
            tasks.append(asyncio.create_task(_one(client, _body(model, prompt, p), start + offset)))
            offset += rng.expovariate(request_rate) if request_rate != float("inf") else 0.0
        timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


def report(timings: Sequence[RequestTiming], seconds: float) -> str:
    """A few lines: throughput, then TTFT / TPOT / e2e percentiles."""
    num_tokens = sum(t.num_tokens for t in timings)
    rate = num_tokens / seconds
    lines = [f"{len(timings)} requests, {num_tokens} output tokens in {seconds:.2f} s = {rate:.1f} tok/s"]
    tpots = [t.tpot for t in timings if t.tpot is not None]
    for name, values in (("TTFT", [t.ttft for t in timings]), ("TPOT", tpots), ("e2e", [t.e2e for t in timings])):
        p = percentiles(values)
        lines.append(f"{name:>5} ms: p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  p99 {p['p99']:.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fnvllm.serve.bench``."""
    parser = argparse.ArgumentParser(prog="python -m fnvllm.serve.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: none, the server's)")
    parser.add_argument("--api-key")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, help="fold prompt ids into [0, vocab) (for tiny models)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    args = parser.parse_args(argv)
    prompts, params = bench_workload(args.num_requests, args.max_input_len, args.max_output_len)
    if args.vocab_size:
        prompts = [[t % args.vocab_size for t in prompt] for prompt in prompts]
    timings, seconds = asyncio.run(run_load(args.url, prompts, params, args.request_rate, args.model, args.api_key))
    print(report(timings, seconds))


if __name__ == "__main__":
    main()

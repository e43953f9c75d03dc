"""Load benchmark of a running ``fnvllm serve``: replay the nano-vllm bench workload as streaming completions.

    fnvllm serve MODEL --port 8000 &
    python -m fnvllm.serve.bench --url http://127.0.0.1:8000 --num-requests 256            # all at once
    python -m fnvllm.serve.bench --url ... --request-rate 20                                # Poisson arrivals

Each request sends token ids (``fnvllm.benchmark.bench_workload``: temperature 0.6, ignore_eos) with
``stream: true`` and ``stream_options.include_usage``; we time the first streamed chunk (TTFT), the last (e2e),
and count output tokens from the usage chunk. Reports output tok/s over the whole run and p50/p90/p99 of TTFT,
TPOT ((e2e - TTFT) / (tokens - 1)) and e2e latency.

The client speaks HTTP/1.1 over plain asyncio streams (one connection per request, ``Connection: close``) and
only stores what arrives until the response ends; it parses the events afterwards. An HTTP library that parses
every event as it comes costs ~5x more CPU per token, and at 256 streams that made the client, not the server,
the bottleneck the benchmark measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attrs

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


@attrs.frozen
class Target:
    """Where requests go: host, port, and the request head (everything but Content-Length and the body)."""

    host: str
    port: int
    head: bytes

    @classmethod
    def of(cls, url: str, api_key: str | None) -> Target:
        """The target of ``url`` (``http://host:port``), sending ``Authorization: Bearer api_key`` if given."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--url: expected http://HOST:PORT, got {url!r}")
        port = parts.port or 80
        lines = [
            f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1",
            f"Host: {parts.hostname}:{port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            "Connection: close",
        ]
        if api_key:
            lines.append(f"Authorization: Bearer {api_key}")
        return cls(parts.hostname, port, "\r\n".join(lines).encode() + b"\r\n")


def _dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out, at = [], 0
    while True:
        line_end = body.index(b"\r\n", at)
        size = int(body[at:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[line_end + 2 : line_end + 2 + size])
        at = line_end + 2 + size + 2


def parse_response(raw: bytes) -> tuple[int, list[dict[str, Any]]]:
    """(status, the JSON events) of a whole streamed response as received (headers included)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body.decode(errors='replace')[:500]}")
    events = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return status, events


async def _one(target: Target, body: bytes, start_at: float) -> RequestTiming:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection(target.host, target.port)
    writer.write(target.head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    parts, first = [], None
    while data := await reader.read(1 << 16):
        parts.append(data)
        if first is None and b"data: " in data:  # the first event (headers come in an earlier read)
            first = time.perf_counter()
    done = time.perf_counter()
    writer.close()
    _, events = parse_response(b"".join(parts))
    usages = [e["usage"] for e in events if e.get("usage")]
    num_tokens = usages[-1]["completion_tokens"] if usages else 0
    return RequestTiming((first or done) - sent, done - sent, num_tokens)


def _body(model: str | None, prompt: list[int], params: SamplingParams) -> bytes:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature, "stream": True}
    body |= {"ignore_eos": params.ignore_eos, "stream_options": {"include_usage": True}}
    return json.dumps(body | ({"model": model} if model else {})).encode()


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
    rng, offset, target = random.Random(seed), 0.0, Target.of(url, api_key)
    bodies = [_body(model, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    offsets = []
    for _ in bodies:
        offsets.append(offset)
        offset += rng.expovariate(request_rate) if request_rate != float("inf") else 0.0
    start = time.perf_counter()
    timings = await asyncio.gather(*(_one(target, body, start + at) for body, at in zip(bodies, offsets, strict=True)))
    return list(timings), time.perf_counter() - start


def summary(timings: Sequence[RequestTiming], seconds: float) -> dict[str, Any]:
    """The run as one JSON-ready record: requests, output tokens, seconds, tok/s, TTFT/TPOT/e2e percentiles (ms)."""
    num_tokens = sum(t.num_tokens for t in timings)
    tpots = [t.tpot for t in timings if t.tpot is not None]
    record: dict[str, Any] = {
        "requests": len(timings),
        "output_tokens": num_tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(num_tokens / seconds, 1),
    }
    for name, values in (("ttft", [t.ttft for t in timings]), ("tpot", tpots), ("e2e", [t.e2e for t in timings])):
        record[f"{name}_ms"] = {p: round(v, 2) for p, v in percentiles(values).items()}
    return record


def report(record: dict[str, Any]) -> str:
    """A few lines from a ``summary`` record: throughput, then TTFT / TPOT / e2e percentiles."""
    lines = [
        f"{record['requests']} requests, {record['output_tokens']} output tokens in {record['seconds']:.2f} s "
        f"= {record['tok_per_s']:.1f} tok/s"
    ]
    for name in ("ttft", "tpot", "e2e"):
        p = record[f"{name}_ms"]
        lines.append(f"{name.upper():>5} ms: p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  p99 {p['p99']:.1f}")
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
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests of 8 tokens sent first (default 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    prompts, params = bench_workload(args.num_requests, args.max_input_len, args.max_output_len)
    if args.vocab_size:
        prompts = [[t % args.vocab_size for t in prompt] for prompt in prompts]
    if args.warmup:  # like ``fnvllm bench``: the first steps of a fresh engine compile and allocate
        warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)
        asyncio.run(
            run_load(args.url, prompts[: args.warmup], [warm] * args.warmup, model=args.model, api_key=args.api_key)
        )
    timings, seconds = asyncio.run(run_load(args.url, prompts, params, args.request_rate, args.model, args.api_key))
    record = summary(timings, seconds)
    print(json.dumps(record) if args.json else report(record))


if __name__ == "__main__":
    main()

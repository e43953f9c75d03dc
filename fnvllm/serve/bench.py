"""Load benchmark of a running ``fnvllm serve``: replay the nano-vllm bench workload as streaming completions.

    fnvllm serve MODEL --port 8000 &
    python -m fnvllm.serve.bench --url http://127.0.0.1:8000 --num-requests 256            # all at once
    python -m fnvllm.serve.bench --url ... --request-rate 20                                # Poisson arrivals

Each request sends token ids (``fnvllm.workloads.bench_workload``: temperature 0.6, ignore_eos) with
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
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any, TextIO

import attrs

from fnvllm.state import SamplingParams
from fnvllm.workloads import bench_workload


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


class Progress:
    """Counts finished requests and their tokens; ``line()`` says how far the run is. Printed every
    ``every_s`` seconds while the run lasts (on a terminal one line rewritten in place, else plain lines) and
    once at the end."""

    def __init__(self, num_requests: int, every_s: float | None, out: TextIO | None = None) -> None:
        self.num_requests, self.every_s = num_requests, every_s
        self.out = out if out is not None else sys.stderr
        self.num_done, self.num_tokens = 0, 0
        self.start = time.perf_counter()
        self._in_place = self.out.isatty()

    def finished(self, timing: RequestTiming) -> None:
        """One request finished."""
        self.num_done += 1
        self.num_tokens += timing.num_tokens

    def line(self) -> str:
        """``bench: 37/256 requests done, 9,871 output tokens, 12.3 s (802.5 tok/s)``."""
        seconds = time.perf_counter() - self.start
        rate = self.num_tokens / seconds if seconds > 0 else 0.0
        return (
            f"bench: {self.num_done}/{self.num_requests} requests done, {self.num_tokens:,} output tokens, "
            f"{seconds:.1f} s ({rate:.1f} tok/s)"
        )

    def show(self, final: bool = False) -> None:
        """Print the line (rewritten in place on a terminal; the final one ends it)."""
        if self._in_place:
            print("\r" + self.line(), end="\n" if final else "", file=self.out, flush=True)
        else:
            print(self.line(), file=self.out, flush=True)

    async def report_periodically(self) -> None:
        """Show the line every ``every_s`` seconds until cancelled."""
        while self.every_s:
            await asyncio.sleep(self.every_s)
            self.show()


async def _one(target: Target, body: bytes, start_at: float, progress: Progress | None = None) -> RequestTiming:
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
    timing = RequestTiming((first or done) - sent, done - sent, num_tokens)
    if progress is not None:
        progress.finished(timing)
    return timing


def _body(model: str | None, prompt: list[int], params: SamplingParams) -> bytes:
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature, "stream": True}
    body |= {"ignore_eos": params.ignore_eos, "stream_options": {"include_usage": True}}
    return json.dumps(body | ({"model": model} if model else {})).encode()


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: Poisson arrivals at ``request_rate`` per second
    (exponential gaps drawn from ``random.Random(seed)``, the first at 0), or all at 0 when the rate is inf."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    rng, offset, offsets = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        offsets.append(offset)
        offset += rng.expovariate(request_rate) if request_rate != float("inf") else 0.0
    return offsets


async def run_load(
    url: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    request_rate: float = float("inf"),
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[list[RequestTiming], float]:
    """Send every request (all at once, or Poisson arrivals at ``request_rate`` per second: ``arrival_offsets``
    with ``seed``); returns each request's timing and the run's wall time in seconds. ``progress`` counts finished
    requests and reports every ``progress.every_s`` seconds (and once at the end)."""
    target = Target.of(url, api_key)
    bodies = [_body(model, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    offsets = arrival_offsets(len(bodies), request_rate, seed)
    start = time.perf_counter()
    reporter = asyncio.ensure_future(progress.report_periodically()) if progress is not None else None
    try:
        runs = (_one(target, body, start + at, progress) for body, at in zip(bodies, offsets, strict=True))
        timings = await asyncio.gather(*runs)
    finally:
        if reporter is not None:
            reporter.cancel()
    if progress is not None:
        progress.show(final=True)
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


@attrs.frozen
class ServedModel:
    """What the server says about its model (``GET /v1/models``): its id, the most prompt + output tokens of one
    request, and the vocabulary size (None where the server does not say)."""

    id: str
    max_model_len: int | None
    vocab_size: int | None


def served_model(url: str, api_key: str | None, name: str | None = None) -> ServedModel:
    """The entry of ``GET {url}/v1/models`` named ``name`` (default: the first)."""
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        entries = json.loads(response.read())["data"]
    entry = next((e for e in entries if name is None or e["id"] == name), None)
    if entry is None:
        raise ValueError(f"--model: the server serves {[e['id'] for e in entries]}, not {name!r}")
    return ServedModel(entry["id"], entry.get("max_model_len"), entry.get("vocab_size"))


def fit_lengths(max_input_len: int, max_output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """The workload's longest prompt and output, shrunk (in proportion, each at least the workload's 100) so that
    the longest request fits the server's ``max_model_len``."""
    if max_model_len is None or max_input_len + max_output_len <= max_model_len:
        return max_input_len, max_output_len
    if max_model_len < 200:
        raise ValueError(f"the server's max_model_len ({max_model_len}) is under the workload's 100 + 100 tokens")
    scale = max_model_len / (max_input_len + max_output_len)
    max_input = max(100, min(int(max_input_len * scale), max_model_len - 100))
    return max_input, max_model_len - max_input


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fnvllm.serve.bench``: the model's vocabulary size and max length come from the server
    (``/v1/models``) unless given."""
    parser = argparse.ArgumentParser(prog="python -m fnvllm.serve.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: none, the server's)")
    parser.add_argument("--api-key")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024, help="(shrunk to fit the server's max length)")
    parser.add_argument("--max-output-len", type=int, default=1024, help="(shrunk to fit the server's max length)")
    parser.add_argument("--vocab-size", type=int, help="fold prompt ids into [0, vocab) (default: the server's)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests of 8 tokens sent first (default 4)")
    parser.add_argument(
        "--progress-interval-s", type=float, default=5.0, help="progress every N s (0: only at the end)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.progress_interval_s < 0 or not args.request_rate > 0:
        parser.error("--num-requests must be >= 1, --progress-interval-s >= 0 and --request-rate > 0 (inf: at once)")
    model = served_model(args.url, args.api_key, args.model)
    max_input, max_output = fit_lengths(args.max_input_len, args.max_output_len, model.max_model_len)
    if (max_input, max_output) != (args.max_input_len, args.max_output_len):
        print(f"bench: the server's max_model_len is {model.max_model_len}: prompts up to {max_input} tokens, "
              f"outputs up to {max_output}", file=sys.stderr, flush=True)  # fmt: skip
    prompts, params = bench_workload(args.num_requests, max_input, max_output)
    vocab_size = args.vocab_size or model.vocab_size
    if vocab_size:
        prompts = [[t % vocab_size for t in prompt] for prompt in prompts]
    if args.warmup:  # like ``fnvllm bench``: the first steps of a fresh engine compile and allocate
        warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)
        num_warm = min(args.warmup, len(prompts))
        asyncio.run(run_load(args.url, prompts[:num_warm], [warm] * num_warm, model=args.model, api_key=args.api_key))
    progress = Progress(len(prompts), args.progress_interval_s or None)
    timings, seconds = asyncio.run(
        run_load(args.url, prompts, params, args.request_rate, args.model, args.api_key, progress=progress)
    )
    record = summary(timings, seconds)
    print(json.dumps(record) if args.json else report(record))


if __name__ == "__main__":
    main()

"""Workloads: who arrives when, with how long a prompt and how many tokens to generate.

A workload is a list of ``SimRequest`` sorted by arrival time. Prompt token ids are only materialised when the
simulator adds a request (``prompt_tokens``), so 100,000 requests cost a few numbers each until they arrive.
Materialised prompts start with a head unique to the request (or to its shared prefix), so the prefix cache hits
exactly where requests really share a prefix (block sizes of 1-3 tokens aside, where heads can coincide).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from fnvllm.sim.checks import (
    MAX_MODEL_LEN,
    MAX_REQUESTS,
    SimInputError,
    check_count,
    check_mapping,
    check_optional_count,
    check_real_in,
)
from fnvllm.state.config import MAX_SIZE
from fnvllm.workloads import bench_workload

_FILL = 3  # the token every materialised prompt is padded with after its unique head


@attrs.frozen(slots=True)
class SimRequest:
    """One request of a workload.

    arrival_s: when it arrives (simulated seconds). prompt_len / output_len: tokens in and tokens to generate
    (max_tokens). prefix_id / prefix_len: requests with the same prefix_id share their first prefix_len prompt
    tokens (None: no shared prefix). priority: for the priority policy (lower first). prompt: explicit token ids
    (the bench workload), else materialised on arrival.
    """

    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_id: int | None = None
    prefix_len: int = 0
    priority: int = 0
    prompt: tuple[int, ...] | None = None


def bench_prompts(
    num_requests: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts and max_tokens of the nano-vllm bench (``fnvllm.workloads.bench_workload``, torch-free)."""
    prompts, params = bench_workload(num_requests, max_input_len, max_output_len, seed)
    return prompts, [p.max_tokens for p in params]


def bench_requests(num_requests: int = 256, seed: int = 0) -> list[SimRequest]:
    """The nano-vllm bench: every request at t=0 with its explicit prompt (temperature 0.6 and ignore_eos do not
    change the simulated cost)."""
    prompts, max_tokens = bench_prompts(num_requests, seed=seed)
    return [SimRequest(0.0, len(p), n, prompt=tuple(p)) for p, n in zip(prompts, max_tokens, strict=True)]


def _lognormal_int(rng: random.Random, mean: float, sigma: float, upper: int) -> int:
    """A log-normal length with the given mean (mu = ln(mean) - sigma^2 / 2), rounded, in [1, upper]."""
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) if sigma > 0 else mean
    return min(max(round(value), 1), upper)


def _arrivals(rng: random.Random, num_requests: int, rate: float) -> list[float]:
    """Poisson arrival times at ``rate`` requests/s, starting at 0 (rate = inf: all at t=0)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def poisson_requests(
    num_requests: int,
    rate: float,
    prompt_mean: float = 512,
    output_mean: float = 256,
    sigma: float = 0.8,
    seed: int = 0,
    max_len: int = 4096,
    num_priorities: int = 1,
) -> list[SimRequest]:
    """Poisson arrivals at ``rate`` requests/s with log-normal prompt and output lengths (prompt + output <=
    max_len) and priorities uniform in [0, num_priorities)."""
    _check_lengths(num_requests, rate, prompt_mean, output_mean, max_len)
    rng = random.Random(seed)
    requests = []
    for t in _arrivals(rng, num_requests, rate):
        prompt = _lognormal_int(rng, prompt_mean, sigma, max_len - 1)
        output = _lognormal_int(rng, output_mean, sigma, max_len - prompt)
        requests.append(SimRequest(t, prompt, output, priority=rng.randrange(num_priorities)))
    return requests


def shared_prefix_requests(
    num_requests: int,
    rate: float,
    num_prefixes: int = 8,
    prefix_len: int = 1024,
    prompt_mean: float = 256,
    output_mean: float = 256,
    sigma: float = 0.8,
    seed: int = 0,
    max_len: int = 4096,
) -> list[SimRequest]:
    """Poisson arrivals whose prompts are one of ``num_prefixes`` system prompts (``prefix_len`` tokens, chosen
    uniformly) followed by a log-normal suffix of mean ``prompt_mean``."""
    _check_lengths(num_requests, rate, prompt_mean, output_mean, max_len)
    if num_prefixes < 1 or not 0 < prefix_len < max_len - 1:
        raise ValueError(f"need num_prefixes >= 1 and 0 < prefix_len < {max_len - 1}; got {num_prefixes}, {prefix_len}")
    rng = random.Random(seed)
    requests = []
    for t in _arrivals(rng, num_requests, rate):
        suffix = _lognormal_int(rng, prompt_mean, sigma, max_len - prefix_len - 1)
        output = _lognormal_int(rng, output_mean, sigma, max_len - prefix_len - suffix)
        requests.append(SimRequest(t, prefix_len + suffix, output, rng.randrange(num_prefixes), prefix_len))
    return requests


def _check_lengths(num_requests: int, rate: float, prompt_mean: float, output_mean: float, max_len: int) -> None:
    """ValueError naming the first out-of-range workload parameter."""
    for name, value, ok in (
        ("num_requests", num_requests, num_requests >= 1),
        ("rate", rate, rate > 0),
        ("prompt_mean", prompt_mean, prompt_mean >= 1),
        ("output_mean", output_mean, output_mean >= 1),
        ("max_len", max_len, max_len >= 2),
    ):
        if not ok:
            raise ValueError(f"{name} is out of range: {value!r}")


_TRACE_FIELDS = ("arrival_s", "prompt_len", "output_len", "prefix_id", "prefix_len", "priority")


def read_trace(path: str | Path, default_prefix_len: int = 256, max_len: int = MAX_MODEL_LEN) -> list[SimRequest]:
    """Requests of a JSONL trace, sorted by arrival: ``{"arrival_s", "prompt_len", "output_len"}`` per line, and
    optionally ``prefix_id`` (with ``prefix_len``, default ``default_prefix_len`` capped below the prompt length)
    and ``priority``. Raises SimInputError naming the line and field of a bad record, e.g. a request longer than
    ``max_len`` (prompt_len + output_len), checked before anything is simulated."""
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                requests.append(_trace_record(line, number, default_prefix_len, max_len))
            if len(requests) > MAX_REQUESTS:
                raise SimInputError(f"trace {path} holds more than {MAX_REQUESTS} requests")
    if not requests:
        raise SimInputError(f"trace {path} holds no requests")
    return sorted(requests, key=lambda r: r.arrival_s)


def _trace_record(line: str, number: int, default_prefix_len: int, max_len: int) -> SimRequest:
    """One trace line as a SimRequest."""
    try:
        record = check_mapping(json.loads(line), "a trace line")
        unknown = sorted(set(record) - set(_TRACE_FIELDS))
        if unknown:
            raise SimInputError(f"unknown field(s) {unknown}; known: {list(_TRACE_FIELDS)}")
        missing = [k for k in _TRACE_FIELDS[:3] if k not in record]
        if missing:
            raise SimInputError(f"lacks {missing}")
        arrival = check_real_in(record["arrival_s"], "arrival_s", 0.0, 1e12)
        prompt_len = check_count(record["prompt_len"], "prompt_len", 1, max_len - 1)
        output_len = check_count(record["output_len"], "output_len", 1, max_len - 1)
        if prompt_len + output_len > max_len:
            raise SimInputError(
                f"prompt_len + output_len = {prompt_len + output_len} exceeds max_model_len ({max_len})"
            )
        prefix = check_optional_count(record.get("prefix_id"), "prefix_id", 0, MAX_SIZE)
        prefix_len = 0
        if prefix is not None:
            given = check_count(record.get("prefix_len", default_prefix_len), "prefix_len", 1, MAX_MODEL_LEN)
            prefix_len = min(given, prompt_len - 1)
        priority = check_count(record.get("priority", 0), "priority", -MAX_SIZE, MAX_SIZE)
        return SimRequest(arrival, prompt_len, output_len, prefix, prefix_len, priority)
    except ValueError as e:  # a SimInputError, or the JSON parser's
        raise SimInputError(f"trace line {number}: {e!s} in {line.strip()[:80]!r}") from None


def write_trace(requests: Iterable[SimRequest], path: str | Path) -> None:
    """Write ``requests`` as a JSONL trace (explicit prompts are not written, only their lengths)."""
    lines = []
    for r in requests:
        record = {"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len}
        if r.prefix_id is not None:
            record.update(prefix_id=r.prefix_id, prefix_len=r.prefix_len)
        if r.priority:
            record["priority"] = r.priority
        lines.append(json.dumps(record))
    Path(path).write_text("\n".join(lines) + "\n")


def _head(kind: int, index: int, vocab: int) -> tuple[int, ...]:
    """Three tokens unique to (kind, index) for index < vocab**2: kind 1 = a request, 2 = a shared prefix."""
    return (index % vocab, index // vocab % vocab, kind)


def prompt_tokens(request: SimRequest, index: int, vocab: int) -> tuple[int, ...]:
    """The prompt ids of ``request`` (the ``index``-th of its workload): its explicit prompt, else its shared
    prefix (if any) then a head unique to the request, padded to prompt_len with a filler token."""
    if request.prompt is not None:
        return request.prompt
    head: Sequence[int] = _head(1, index, vocab)
    if request.prefix_id is not None and request.prefix_len:
        prefix_head = _head(2, request.prefix_id, vocab)
        shared = prefix_head + (_FILL,) * (request.prefix_len - len(prefix_head))
        prompt = shared[: request.prefix_len] + tuple(head)
    else:
        prompt = tuple(head)
    prompt = prompt[: request.prompt_len]
    return prompt + (_FILL,) * (request.prompt_len - len(prompt))

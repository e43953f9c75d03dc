"""Served Poisson check: `fnvllm serve` under Poisson load against the simulator fed the same requests.

    PYTHONPATH=$PWD python3 benchmarks/sim_serve_check.py                                   # H200, Qwen3-0.6B shape
    PYTHONPATH=$PWD python3 benchmarks/sim_serve_check.py --model-shape tiny --quick        # CPU smoke test

Starts ``fnvllm serve`` on a random checkpoint of the shape (``fnvllm bench``'s engine options: 256-token blocks,
a 16384-token budget, 512 sequences), sends N streaming requests of the bench workload (prompts and outputs
U(100, max), temperature 0.6, ignore_eos) with Poisson arrivals (``fnvllm.serve.bench``, the load client) after
an untimed warm-up, and records each request's TTFT and TPOT. Then it simulates the SAME requests (their arrival
times, prompt lengths and max_tokens, written as a trace: ``fnvllm simulate --workload trace.jsonl``) under the
same engine options with a hardware profile, and prints measured vs simulated p50/p90 of TTFT and TPOT and the
error (target: p50 within 15 %). The default load (50/s, outputs U(100, 400)) keeps 16-64 requests running on an
H200; the run takes about a minute plus the server's start-up. Needs the [serve] extra (fastapi, uvicorn).

Out of sample: the same server then serves the same request mix at each of ``--check-rates`` (default 25 and 75
per second; as many requests as keep the load as long as the fitted run's), each after an idle pause. The serving
section is fitted on the first run only (``--request-rate``), and the check runs are simulated with it: their TTFT /
TPOT errors are the out-of-sample numbers. Each check run is written to ``--out``/rate-R/ (the same files as the
fitted run; its timeline is its own segment of the server's), and a last table gives every rate's errors.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

ENGINE = {"block_size": 256, "max_num_batched_tokens": 16384, "max_num_seqs": 512}
QUICK = {"num_requests": 24, "request_rate": 8.0, "max_input_len": 128, "max_output_len": 110, "check_rates": "12"}
PAUSE_S = 2.0  # idle time before each timed load: the server's timeline is split at these pauses
CHECK_PREFIX = "rate-"  # the check runs' folders: --out/rate-25, --out/rate-75 ...


def start_server(checkpoint: Path, max_model_len: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``fnvllm serve`` on a free port, recording its per-step timeline beside ``log`` (server_timeline.jsonl);
    returns the process and its URL once /health answers."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE, "max_model_len": max_model_len}.items()]
    command = [sys.executable, "-m", "fnvllm.cli", "serve", str(checkpoint), "--host", "127.0.0.1", "--port", "0"]
    command += ["--served-model-name", "bench", "--stream-interval-ms", "0", *flags]
    env = {**os.environ, "FNVLLM_TIMELINE": str(log.with_name("server_timeline.jsonl"))}
    server = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log.read_text()[-3000:]}")
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        if found and _healthy(found.group(1)):
            return server, found.group(1)
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"the server did not start in 300 s:\n{log.read_text()[-3000:]}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def warm_up(url: str, prompts: list[list[int]]) -> None:
    """Four short requests, untimed (the server's first requests pay compiles and connection set-up)."""
    from fnvllm.serve.bench import run_load
    from fnvllm.state import SamplingParams

    warm = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)
    asyncio.run(run_load(url, prompts[:4], [warm] * min(4, len(prompts))))


def serve_run(
    url: str, prompts: list[list[int]], params: list[Any], offsets: Sequence[float]
) -> tuple[list[Any], list[float]]:
    """After an idle pause (PAUSE_S: where the server's timeline is split), send the load at ``offsets`` (seconds
    from its start); returns each request's RequestTiming and when it was actually sent (seconds from the start: a
    busy client sends late, and the simulation is fed the requests as the server got them)."""
    time.sleep(PAUSE_S)
    return asyncio.run(_timed_load(url, prompts, params, offsets))


async def _timed_load(
    url: str, prompts: Sequence[list[int]], params: Sequence[Any], offsets: Sequence[float]
) -> tuple[list[Any], list[float]]:
    """``fnvllm.serve.bench.run_load`` with the send time of each request recorded (the same client)."""
    from fnvllm.serve.bench import RequestTiming, Target, parse_response

    target, start = Target.of(url, None), time.perf_counter()

    async def one(prompt: list[int], p: Any, at: float) -> tuple[Any, float]:
        body = {"prompt": prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "stream": True}
        body |= {"ignore_eos": p.ignore_eos, "stream_options": {"include_usage": True}}
        data = json.dumps(body).encode()
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        reader, writer = await asyncio.open_connection(target.host, target.port)
        writer.write(target.head + b"Content-Length: %d\r\n\r\n" % len(data) + data)
        parts, first = [], None
        while chunk := await reader.read(1 << 16):
            parts.append(chunk)
            if first is None and b"data: " in chunk:
                first = time.perf_counter()
        done = time.perf_counter()
        writer.close()
        _, events = parse_response(b"".join(parts))
        usages = [e["usage"] for e in events if e.get("usage")]
        num_tokens = usages[-1]["completion_tokens"] if usages else 0
        return RequestTiming((first or done) - sent, done - sent, num_tokens), sent - start

    results = await asyncio.gather(*(one(*r) for r in zip(prompts, params, offsets, strict=True)))
    return [timing for timing, _ in results], [sent for _, sent in results]


def simulate_same(trace: Path, options: dict[str, Any]) -> tuple[list[float], list[float], list[int]]:
    """Simulate the requests of ``trace`` (their arrivals, prompt lengths and max_tokens) under the served engine's
    options; returns per-request TTFT, TPOT and requests in flight at its arrival (``in_flight_at_arrival``)."""
    from fnvllm.sim import SimSpec, run_spec

    result, _ = run_spec(SimSpec(workload=str(trace), **ENGINE, **options))
    rec = result.recorder
    ttft = [first - arrival for first, arrival in zip(rec.first_token, rec.arrival, strict=True)]
    tpot = [
        (finish - first) / (n - 1) if n > 1 else math.nan
        for finish, first, n in zip(rec.finish, rec.first_token, rec.num_output, strict=True)
    ]
    return ttft, tpot, rec.in_flight_at_arrival()


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of the values that are numbers, interpolated (NaN when none)."""
    from fnvllm.sim.metrics import percentile

    return percentile(sorted(v for v in values if v is not None and not math.isnan(v)), q * 100)


QUANTILES = (0.5, 0.9)


def quantiles_of(values: dict[str, Sequence[float]]) -> dict[str, dict[float, float]]:
    """Per metric, its QUANTILES (seconds) over the requests."""
    return {metric: {q: quantile(v, q) for q in QUANTILES} for metric, v in values.items()}


def compare(measured: dict[str, dict[float, float]], simulated: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Rows of (metric, percentile, measured ms, simulated ms, relative error); ``measured``: quantiles_of."""
    rows = []
    for metric in ("ttft", "tpot"):
        for q in QUANTILES:
            m, s = measured[metric][q] * 1e3, quantile(simulated[metric], q) * 1e3
            rows.append({"metric": metric, "p": f"p{round(q * 100)}", "measured_ms": m, "simulated_ms": s,
                         "error": (s - m) / m if m else math.nan})  # fmt: skip
    return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """The comparison, one line per metric and percentile, and the p50 verdict."""
    print(f"{'metric':<6} {'p':>4} {'measured ms':>12} {'simulated ms':>13} {'error':>8}")
    for r in rows:
        print(f"{r['metric']:<6} {r['p']:>4} {r['measured_ms']:>12.2f} {r['simulated_ms']:>13.2f} {r['error']:>+8.1%}")
    worst = max(abs(r["error"]) for r in rows if r["p"] == "p50")
    print(f"worst p50 |error|: {worst:.1%} (target <= 15 %: {'met' if worst <= 0.15 else 'NOT met'})")


def main(argv: Sequence[str] | None = None) -> int:
    """Serve, load, simulate, compare (or, with --refit, only fit and compare a saved run)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-0.6b", choices=["tiny", "qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--request-rate", type=float, default=50.0, help="Poisson arrivals per second")
    parser.add_argument("--max-input-len", type=int, default=512, help="prompts U(100, this)")
    parser.add_argument("--max-output-len", type=int, default=400, help="outputs U(100, this)")
    parser.add_argument(
        "--check-rates",
        default="25,75",
        help="comma-separated rates served after the fitted run, checked out of sample ('' for none)",
    )
    parser.add_argument("--hardware", default="h200", help="the profile to simulate with (a name or a JSON file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=f"a small CPU smoke run ({QUICK})")
    parser.add_argument("--out", default=None, help="folder for the server log, trace and report (default: temp)")
    parser.add_argument(
        "--refit", action="store_true", help="no server: fit and compare the run saved in --out (on the CPU)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fnvllm-sim-serve-"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.refit:
        serve_and_record(args, out)
    analyse(out, args.hardware)
    return 0


@attrs.frozen
class Load:
    """One timed load of a served run: its Poisson rate, request count, workload seed and output folder."""

    rate: float
    num_requests: int
    seed: int
    folder: Path


def loads_of(args: argparse.Namespace, out: Path) -> list[Load]:
    """The fitted load (``--request-rate``, in ``out``), then one per check rate (in ``out``/rate-R, the same
    mix drawn with another seed, as many requests as keep the load as long as the fitted one's, at least 8)."""
    loads = [Load(args.request_rate, args.num_requests, args.seed, out)]
    for i, rate in enumerate(check_rates(args.check_rates)):
        n = max(8, round(args.num_requests * rate / args.request_rate))
        loads.append(Load(rate, n, args.seed + 1 + i, out / f"{CHECK_PREFIX}{rate:g}"))
    return loads


def check_rates(text: str) -> list[float]:
    """The rates of ``--check-rates`` ("25,75"; "" for none); ValueError naming a bad one."""
    rates = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        try:
            rate = float(word)
        except ValueError:
            raise ValueError(f"--check-rates: {word!r} is not a number") from None
        if not 0 < rate < math.inf:
            raise ValueError(f"--check-rates: {word} must be a rate > 0 per second")
        rates.append(rate)
    return rates


def serve_and_record(args: argparse.Namespace, out: Path) -> None:
    """Serve each load (``loads_of``) on one server and write, per load, what the analysis reads: trace.jsonl (the
    requests, arriving when they were sent), measured.jsonl (each request's client-side TTFT, TPOT and end-to-end
    latency, planned and actual send time), served_timeline.jsonl (the engine's steps during that load: a segment
    of the server's timeline, server_timeline.jsonl) and run.json (device, engine options, the model's shape)."""
    import torch

    from fnvllm.bench import write_checkpoint

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}; writing to {out}", flush=True)
    loads = loads_of(args, out)
    max_model_len = max(512, args.max_input_len + args.max_output_len)
    with tempfile.TemporaryDirectory(prefix="fnvllm-sim-serve-ckpt-") as folder:
        checkpoint = write_checkpoint(args.model_shape, Path(folder))
        config = json.loads((checkpoint / "config.json").read_text())
        start = time.perf_counter()
        server, url = start_server(checkpoint, max_model_len, out / "serve.log")
        print(f"server up at {url} in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            for i, load in enumerate(loads):
                prompts, params, offsets = _load_requests(args, load, _vocab(checkpoint))
                if i == 0:
                    warm_up(url, prompts)
                start = time.perf_counter()
                timings, sent = serve_run(url, prompts, params, offsets)
                print(f"served {len(timings)} requests at {load.rate:g}/s in {time.perf_counter() - start:.1f} s",
                      flush=True)  # fmt: skip
                load.folder.mkdir(parents=True, exist_ok=True)
                _write_load(load, prompts, params, offsets, timings, sent)
        finally:
            server.terminate()
            server.wait(timeout=60)
    engine = {**ENGINE, "max_model_len": max_model_len}
    for load in loads:
        run = {"device": device, "args": {**vars(args), "request_rate": load.rate, "num_requests": load.num_requests}}
        run.update(engine=engine, model=config, overlap=torch.cuda.is_available())  # overlapped on CUDA only
        (load.folder / "run.json").write_text(json.dumps({**run, "timeline": "segment"}, indent=1) + "\n")
    split_timeline(out / "server_timeline.jsonl", [load.folder for load in loads])


def _load_requests(args: argparse.Namespace, load: Load, vocab: int) -> tuple[list[list[int]], list[Any], list[float]]:
    """The prompts, sampling params and planned send offsets of one load."""
    from fnvllm.serve.bench import arrival_offsets
    from fnvllm.workloads import bench_workload

    prompts, params = bench_workload(load.num_requests, args.max_input_len, args.max_output_len, load.seed)
    return [[t % vocab for t in p] for p in prompts], params, arrival_offsets(len(prompts), load.rate, load.seed)


def _write_load(
    load: Load,
    prompts: Sequence[list[int]],
    params: Sequence[Any],
    offsets: Sequence[float],
    timings: Sequence[Any],
    sent: Sequence[float],
) -> None:
    """trace.jsonl and measured.jsonl of one load."""
    write_trace(load.folder / "trace.jsonl", sent, [len(p) for p in prompts], [p.max_tokens for p in params])
    late = sorted(s - o for s, o in zip(sent, offsets, strict=True))
    print(f"requests sent late by p50 {quantile(late, 0.5) * 1e3:.2f} ms, max {late[-1] * 1e3:.2f} ms", flush=True)
    with (load.folder / "measured.jsonl").open("w") as f:
        for t, at, s in zip(timings, offsets, sent, strict=True):
            row = {"ttft": t.ttft, "tpot": t.tpot, "e2e": t.e2e, "num_tokens": t.num_tokens}
            f.write(json.dumps({**row, "offset_s": at, "sent_s": s}) + "\n")


def split_timeline(path: Path, folders: Sequence[Path]) -> None:
    """Split the server's timeline at its len(folders) longest idle gaps (the PAUSE_S before each timed load; the
    steps before the first are the warm-up's) and write each load's steps, with the header, to its folder's
    served_timeline.jsonl."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    header = [line for line in lines[:1] if '"model"' in line and '"step"' not in line]
    steps = lines[len(header) :]
    ends = [float(json.loads(line).get("end_s", 0.0)) for line in steps]
    gaps = sorted(range(1, len(ends)), key=lambda i: ends[i] - ends[i - 1], reverse=True)[: len(folders)]
    cuts = [*sorted(gaps), len(steps)]
    for folder, begin, end in zip(folders, cuts, cuts[1:], strict=False):
        (folder / "served_timeline.jsonl").write_text("\n".join([*header, *steps[begin:end]]) + "\n")


def write_trace(path: Path, offsets: Sequence[float], prompt_lens: Sequence[int], output_lens: Sequence[int]) -> None:
    """The requests as a simulator trace (``fnvllm simulate --workload trace.jsonl``)."""
    lines = [
        json.dumps({"arrival_s": at, "prompt_len": p, "output_len": o})
        for at, p, o in zip(offsets, prompt_lens, output_lens, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")


def load_served(out: Path) -> tuple[dict[str, Any], dict[str, dict[float, float]], list[float] | None]:
    """A saved served run: its run.json, the measured quantiles, and each request's measured TTFT (None when the
    run kept only the quantiles: a report.json written before measured.jsonl existed, whose engine options and
    model are then the defaults and the timeline header's)."""
    if (out / "measured.jsonl").exists():
        run = json.loads((out / "run.json").read_text())
        rows = [json.loads(line) for line in (out / "measured.jsonl").read_text().splitlines() if line]
        values = {k: [r[k] if r[k] is not None else math.nan for r in rows] for k in ("ttft", "tpot")}
        return run, quantiles_of(values), values["ttft"]
    report = json.loads((out / "report.json").read_text())
    header = json.loads((out / "served_timeline.jsonl").open().readline())
    measured: dict[str, dict[float, float]] = {}
    for row in report["rows"]:
        measured.setdefault(row["metric"], {})[int(row["p"][1:]) / 100] = row["measured_ms"] / 1e3
    engine = {**ENGINE, "max_model_len": header["max_model_len"]}
    run = {"device": report["device"], "args": report["args"], "engine": engine, "model": header["model"]}
    run.update(overlap=str(header.get("device", "")).startswith("cuda"))
    return run, measured, None


def analyse(out: Path, hardware: str) -> dict[str, list[dict[str, Any]]]:
    """Compare the measured latencies with the simulation of the same requests: with ``hardware`` as given, then
    with a serving section fitted on this run's timeline (``fit_serving``) and the server's latency fitted on the
    clients' TTFT, timed cycle by cycle and step by step (``Serving.cycle``); writes the fitted profile with the
    timing that predicts the run better (worst p50 error; cycle by cycle on a tie) to profile_served.json, and
    analysis.json, and prints the tables ("served_fit" in the returned tables: the chosen one). With check runs
    beside it (``check_folders``), it checks that profile on them, out of sample ("rate-R"), then refits the
    latency on every run (``pool_latency``: profile_served.json is then that one, "all_rates" in the tables)."""
    import attrs

    from fnvllm.sim import load_profile, save_profile
    from fnvllm.sim.calibrate import fit_serving
    from fnvllm.sim.timeline import header_model, read_timeline

    run, measured, measured_ttft = load_served(out)
    options = {"model": _model_file(out, run["model"]), "max_model_len": run["engine"]["max_model_len"]}
    options.update(overlap=run["overlap"], serve=True)
    given = load_profile(hardware)
    tables = {"given": _compare_with(out, given, measured, options)}
    timeline = out / "served_timeline.jsonl"
    if timeline.exists():
        header, records = read_timeline(timeline)
        model = header_model(header, name=str(run["args"].get("model_shape", "served")))
        steps = records if run.get("timeline") == "segment" else served_load(records)  # older: warm-up in it
        serving = fit_serving(steps, model, given, source=str(timeline))
        candidates = []
        for cycle in (True, False):
            fitted = attrs.evolve(given, serving=attrs.evolve(serving, cycle=cycle), **graph_limits(records, given))
            ttft, _, in_flight = simulate_profile(out, fitted, options)
            latency, per_stream = fit_latency(measured, measured_ttft, ttft, in_flight)
            latencies = {"latency_us": latency * 1e6, "latency_stream_us": per_stream * 1e6}
            fitted = attrs.evolve(fitted, serving=attrs.evolve(fitted.serving, **latencies))
            rows = _compare_with(out, fitted, measured, options)
            tables[f"served_fit ({'cycle by cycle' if cycle else 'step by step'})"] = rows
            candidates.append((max(abs(r["error"]) for r in rows if r["p"] == "p50"), not cycle, fitted))
        worst, _, fitted = min(candidates, key=lambda c: c[:2])
        save_profile(fitted, out / "profile_served.json")
        tables["served_fit"] = tables[f"served_fit ({'cycle by cycle' if fitted.serving.cycle else 'step by step'})"]
        timing = "cycle by cycle" if fitted.serving.cycle else "step by step"
        print(
            f"\nfitted serving section: {out / 'profile_served.json'} (timed {timing}: worst p50 error {worst:.1%}; "
            f"server latency {fitted.serving.latency_us / 1e3:.2f} ms + "
            f"{fitted.serving.latency_stream_us / 1e3:.3f} ms per request in flight)"
        )
    chosen = load_profile(out / "profile_served.json") if "served_fit" in tables else given
    checks = {f"{CHECK_PREFIX}{folder.name.removeprefix(CHECK_PREFIX)}": folder for folder in check_folders(out)}
    for name, folder in checks.items():
        tables[name] = check_served(folder, chosen)
    (out / "analysis.json").write_text(json.dumps({**run, "tables": tables}, indent=1))
    for name, rows in tables.items():
        if name != "served_fit" and name not in checks:  # the chosen one of the two is printed under its own name
            print(f"\nprofile: {name}")
            print_table(rows)
    print_served_steps(timeline, str(out / "profile_served.json") if "served_fit" in tables else hardware)
    for name, rows in tables.items():
        if name in checks:
            print(f"\nout of sample: {checks[name]} (the served profile fitted on {out})")
            print_table(rows)
    print_rates(out, tables, checks)
    if checks and "served_fit" in tables:
        pool_latency(out, chosen, list(checks.values()), tables)
    return tables


def pool_latency(out: Path, fitted: Any, folders: Sequence[Path], tables: dict[str, list[dict[str, Any]]]) -> None:
    """The profile to ship: ``fitted`` (the serving section fitted on the run in ``out``) with the server's
    latency fitted again on every served run, ``out`` and the check runs in ``folders`` together (the latency
    outside the engine grows with the load across runs faster than within one: a line through the medians of all
    of them spans the loads a capacity plan asks about). Writes it to profile_served.json (the fit on ``out``
    alone stays in profile_fit_run.json), adds its rows to ``tables`` ("all_rates", "all_rates rate-R") and prints
    the per-rate table of it (in sample)."""
    import attrs

    from fnvllm.sim import save_profile

    runs = [out, *folders]
    zero = attrs.evolve(fitted, serving=attrs.evolve(fitted.serving, latency_us=0.0, latency_stream_us=0.0))
    diffs: list[float] = []
    loads: list[float] = []
    for folder in runs:
        run, _, measured_ttft = load_served(folder)
        if measured_ttft is None:
            return
        options = {"model": _model_file(folder, run["model"]), "max_model_len": run["engine"]["max_model_len"]}
        ttft, _, in_flight = simulate_profile(folder, zero, {**options, "overlap": run["overlap"], "serve": True})
        pairs = [(m - t, float(n)) for m, t, n in zip(measured_ttft, ttft, in_flight, strict=True) if m == m]
        diffs += [d for d, _ in pairs]
        loads += [n for _, n in pairs]
    latency, per_stream = median_line(loads, diffs)
    latencies = {"latency_us": latency * 1e6, "latency_stream_us": per_stream * 1e6}
    pooled = attrs.evolve(fitted, serving=attrs.evolve(fitted.serving, **latencies))
    save_profile(fitted, out / "profile_fit_run.json")
    save_profile(pooled, out / "profile_served.json")
    entries = []
    for folder in runs:
        name = "all_rates" if folder == out else f"all_rates {CHECK_PREFIX}{folder.name.removeprefix(CHECK_PREFIX)}"
        tables[name] = check_served(folder, pooled)
        entries.append(("in sample", folder, tables[name]))
    (out / "analysis.json").write_text(json.dumps({**load_served(out)[0], "tables": tables}, indent=1))
    print(
        f"\nthe profile to ship: {out / 'profile_served.json'}: the serving section fitted on {out.name}, the server "
        f"latency on every rate: {latency * 1e3:.2f} ms + {per_stream * 1e3:.3f} ms per request in flight"
    )
    _rate_lines(entries)


def check_folders(out: Path) -> list[Path]:
    """The check runs saved beside a fitted served run (``out``/rate-R with a measured.jsonl), by rate."""
    found = [f for f in out.glob(f"{CHECK_PREFIX}*") if (f / "measured.jsonl").exists() and (f / "run.json").exists()]
    return sorted(found, key=lambda f: float(_run_args(f).get("request_rate", 0.0)))


def _run_args(folder: Path) -> dict[str, Any]:
    """The ``args`` of a served run's run.json ({} when it has none)."""
    path = folder / "run.json"
    return dict(json.loads(path.read_text()).get("args", {})) if path.exists() else {}


def check_served(folder: Path, profile: Any) -> list[dict[str, Any]]:
    """The measured latencies of the check run in ``folder`` against its simulation with ``profile`` (whose
    serving section was fitted on another run: out of sample)."""
    run, measured, _ = load_served(folder)
    options = {"model": _model_file(folder, run["model"]), "max_model_len": run["engine"]["max_model_len"]}
    return _compare_with(folder, profile, measured, {**options, "overlap": run["overlap"], "serve": True})


def print_rates(out: Path, tables: dict[str, list[dict[str, Any]]], checks: dict[str, Path]) -> None:
    """One line per served rate: the served profile's TTFT and TPOT p50 / p90 errors, in sample (the run it was
    fitted on) or out of sample (the check runs), and the worst out-of-sample p50 error."""
    if "served_fit" not in tables:
        return
    runs = [("fitted", out, tables["served_fit"])] + [("out of sample", f, tables[n]) for n, f in checks.items()]
    _rate_lines(runs)
    outside = [abs(r["error"]) for n in checks for r in tables[n] if r["p"] == "p50"]
    if outside:
        verdict = "met" if max(outside) <= 0.15 else "NOT met"
        print(f"worst out-of-sample p50 |error|: {max(outside):.1%} (target <= 15 %: {verdict})")


def _rate_lines(runs: Sequence[tuple[str, Path, Sequence[dict[str, Any]]]]) -> None:
    """The per-rate table: one line per (sample label, run folder, comparison rows)."""
    print(f"\n{'rate/s':>7} {'requests':>8} {'sample':<14} {'TTFT p50':>9} {'p90':>7} {'TPOT p50':>9} {'p90':>7}")
    for kind, folder, rows in runs:
        rate = _run_args(folder).get("request_rate")
        n = sum(1 for line in (folder / "trace.jsonl").read_text().splitlines() if line.strip())
        err = {(r["metric"], r["p"]): r["error"] for r in rows}
        print(
            f"{'-' if rate is None else f'{float(rate):g}':>7} {n:>8} {kind:<14} {err['ttft', 'p50']:>+9.1%} "
            f"{err['ttft', 'p90']:>+7.1%} {err['tpot', 'p50']:>+9.1%} {err['tpot', 'p90']:>+7.1%}"
        )


def graph_limits(records: Sequence[dict[str, Any]], given: Any) -> dict[str, int]:
    """The CUDA-graph limits the served steps show, widening ``given``'s (a served run can replay larger graphs than
    the calibration regimes reached); both 0 when no step ran as a graph (an engine without graphs: a CPU run)."""
    graphs = [r for r in records if r["graph"]]
    if not graphs:
        return {"graph_max_seqs": 0, "graph_mixed_tokens": 0}
    mixed = [int(r["num_tokens"]) for r in graphs if int(r["num_prefill_tokens"]) > 0]
    return {
        "graph_max_seqs": max(given.graph_max_seqs, *(int(r["num_seqs"]) for r in graphs)),
        "graph_mixed_tokens": max(given.graph_mixed_tokens, *mixed, 0),
    }


def served_load(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timeline's steps of the timed load: those after the warm-up (the first steps up to the longest idle
    gap in the first tenth of the run, where the warm-up ends and the load begins)."""
    head = max(len(records) // 10, 1)
    ends = [float(r.get("end_s", 0.0)) for r in records[: head + 1]]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return list(records[gaps.index(max(gaps)) + 1 :]) if gaps else list(records)


def fit_latency(
    measured: dict[str, dict[float, float]],
    measured_ttft: Sequence[float] | None,
    simulated_ttft: Sequence[float],
    in_flight: Sequence[int] | None = None,
) -> tuple[float, float]:
    """The server's own latency per request (seconds, >= 0): a + b x (requests in flight at its arrival, in the
    simulation), fitted on the median of measured - simulated TTFT over the same requests (``median_line``);
    without ``in_flight``, b = 0 and a is the median difference; with only the measured quantiles, the difference
    of the medians."""
    if measured_ttft is None:
        return max(measured["ttft"][0.5] - quantile(simulated_ttft, 0.5), 0.0), 0.0
    pairs = [
        (m - s, float(n))
        for m, s, n in zip(measured_ttft, simulated_ttft, in_flight or [0] * len(simulated_ttft), strict=True)
        if not math.isnan(m - s)
    ]
    if not pairs:
        return 0.0, 0.0
    if in_flight is None:
        return max(quantile([d for d, _ in pairs], 0.5), 0.0), 0.0
    return median_line([n for _, n in pairs], [d for d, _ in pairs])


def median_line(x: Sequence[float], y: Sequence[float], iterations: int = 100) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum |y - a - b x| (a line through the medians, which the tails of a latency
    distribution do not pull), by iteratively reweighted least squares; b = 0 when x does not vary or the slope
    would be negative, a = 0 when the intercept would be."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    median = max(float(np.median(ys)), 0.0)
    if len(xs) < 2 or float(np.ptp(xs)) == 0.0:
        return median, 0.0
    a, b = median, 0.0
    scale = max(float(np.median(np.abs(ys - median))), 1e-9)
    for _ in range(iterations):
        w = 1.0 / np.maximum(np.abs(ys - a - b * xs), 1e-3 * scale)
        design = np.column_stack([np.ones_like(xs), xs]) * np.sqrt(w)[:, None]
        a, b = np.linalg.lstsq(design, ys * np.sqrt(w), rcond=None)[0]
    if b < 0:
        return median, 0.0
    if a < 0:
        return 0.0, max(float(np.median(ys / np.maximum(xs, 1.0))), 0.0)
    return float(a), float(b)


def simulate_profile(out: Path, profile: Any, options: dict[str, Any]) -> tuple[list[float], list[float], list[int]]:
    """Per-request TTFT, TPOT and requests in flight at arrival of the saved trace simulated with ``profile``
    (written beside it)."""
    from fnvllm.sim import save_profile

    path = out / "profile_simulated.json"
    save_profile(profile, path)
    return simulate_same(out / "trace.jsonl", {**options, "hardware": str(path)})


def _compare_with(
    out: Path, profile: Any, measured: dict[str, dict[float, float]], options: dict[str, Any]
) -> list[dict[str, Any]]:
    ttft, tpot, _ = simulate_profile(out, profile, options)
    return compare(measured, {"ttft": ttft, "tpot": tpot})


def _model_file(out: Path, config: dict[str, Any]) -> str:
    """The served model's config.json, saved in ``out`` (the simulator reads the shape from it)."""
    path = out / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def print_served_steps(path: Path, hardware: str) -> None:
    """Where the served steps' time goes: per kind of step (decode-only, mixed), the measured device, host and gap
    ms per step against what the profile predicts for the same step shapes (``CostModel``), so a gap between the
    served and simulated latencies can be traced to the device, the host or the idle time between steps."""
    from fnvllm.sim import load_profile
    from fnvllm.sim.cost import CostModel
    from fnvllm.sim.timeline import header_model, read_timeline, record_new_seqs, record_overlap, record_shape

    if not path.exists():
        print(f"no served timeline at {path}")
        return
    header, records = read_timeline(path)
    cost = CostModel(header_model(header), load_profile(hardware), serving=True)
    kinds: dict[str, list[list[float]]] = {}
    for record in records:
        shape = record_shape(record)
        if not shape.num_seqs:
            continue
        kind = "decode" if shape.num_tokens == shape.num_seqs else "mixed"
        new = record_new_seqs(record)
        predicted = (
            cost.device_s(shape) * 1e3,
            cost.host_s(shape, new) * 1e3,
            cost.wall_s(shape, new, record_overlap(record)) * 1e3,
        )
        measured = (float(record["gpu_ms"]), float(record.get("cpu_ms", 0.0)), float(record.get("gap_ms", 0.0)))
        kinds.setdefault(kind, []).append([shape.num_seqs, *measured, *predicted])
    print("\nserved steps (timeline) vs the profile on the same shapes, mean ms per step:")
    columns = ("gpu", "host", "gap", "| sim gpu", "sim host", "sim wall")
    print(f"{'kind':<7} {'steps':>6} {'seqs':>6} " + " ".join(f"{c:>8}" for c in columns))
    for kind, rows in kinds.items():
        n = len(rows)
        mean = [sum(r[i] for r in rows) / n for i in range(7)]
        print(f"{kind:<7} {n:>6} {mean[0]:>6.1f} {mean[1]:>7.3f} {mean[2]:>7.3f} {mean[3]:>6.3f} | "
              f"{mean[4]:>6.3f} {mean[5]:>8.3f} {mean[6]:>8.3f}")  # fmt: skip


def _vocab(checkpoint: Path) -> int:
    """The checkpoint's vocabulary size (config.json)."""
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""Throughput under the sampling settings users send, and decode-step latency at small batches, in one process.

The bench workload (``fnvllm.workloads.bench_workload``) is generated once per sampling variant with one warm
``LLM`` (the checkpoint is written once to ``--checkpoint`` and reused by later runs, e.g. of another commit's
code with ``PYTHONPATH=that/tree``). Then the latency runs: N requests with prompts of 100-128 tokens and 256
output tokens each, warm (run once untimed), reported as milliseconds per decode step (wall / output tokens per
request). Uses only the public API, so it runs against older trees too. A variant may be named more than once
(``--variants temperature,logprobs,temperature,logprobs``: alternated, for the ratio of two in one process); each
variant first runs a short untimed warm-up with its own settings (``warm``), so no variant times a first use;
``--timeline`` adds each variant's decode steps' mean device and host ms per step (``FNVLLM_TIMELINE``). The prefix
cache is off unless ``--prefix-caching``: the variants share the workload's prompts, and a variant that found an
earlier one's prompts cached would skip their prefills (measured on the H200: temperature 26,169 tok/s as the
first variant, 27,538 as the last).

    PYTHONPATH=$PWD python3 benchmarks/bench_settings.py --label head --json $OUT/settings_head.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

try:
    from fnvllm.bench import write_checkpoint
except ImportError:  # a tree older than the module's rename (fnvllm.benchmark), measured for comparison
    from fnvllm.benchmark import write_checkpoint  # type: ignore[import-not-found,no-redef]
try:
    from fnvllm.workloads import bench_workload
except ImportError:  # a tree older than fnvllm.workloads, measured for comparison
    from fnvllm.benchmark import bench_workload  # type: ignore[attr-defined,no-redef]

VARIANTS: dict[str, dict[str, Any]] = {
    "temperature": {},
    "top_p_top_k": {"top_p": 0.95, "top_k": 20},
    "repetition": {"top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05},
    "min_p": {"min_p": 0.05},
    "logprobs": {"logprobs": 5},
}


def warm(llm: LLM, extra: dict[str, Any], num_requests: int) -> None:
    """A short untimed run with ``extra`` first, so that each variant's first uses (a kernel variant compiled, a
    path's first launch at some batch size) fall outside its timed run: ``num_requests`` 16-token prompts ending
    four at a time, so the batch shrinks from ``num_requests`` rows to a few, one step after another."""
    prompts = [[(7 * i + j) % 10000 for j in range(16)] for i in range(num_requests)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2 + i // 4, **extra) for i in range(num_requests)
    ]
    llm.generate(prompts, params, use_tqdm=False)


class CompileLog:
    """Triton kernel compiles (name, ms) that happen while ``active``: a compile inside a timed run stalls the
    device for its whole duration (0.1-1 s each on the H200), so ``--log-compiles`` lists them per variant."""

    def __init__(self) -> None:
        self.active = False
        self.events: list[tuple[str, float]] = []

    def install(self) -> bool:
        """Wrap Triton's compile entry point (``JITFunction._do_compile``); False where this Triton lacks it."""
        from triton.runtime import jit

        original = getattr(jit.JITFunction, "_do_compile", None)
        if original is None:
            return False
        log = self

        def logged(fn: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(fn, *args, **kwargs)
            if log.active:
                log.events.append((fn.__name__, round((time.perf_counter() - start) * 1e3, 1)))
            return out

        jit.JITFunction._do_compile = logged
        return True


def throughput(
    llm: LLM, extra: dict[str, Any], num_requests: int, compiles: CompileLog | None = None
) -> dict[str, Any]:
    """Output tok/s of the bench workload with ``extra`` added to every request's sampling params; with logprobs,
    also what reading every output's logprobs afterwards costs (they may be built only when read: ``read_ms``,
    and tok/s counting that time too); with a timeline (``--timeline``), the decode steps' mean device and host
    ms per step and the share of decode steps whose host time exceeded their device time."""
    prompts, params = bench_workload(num_requests)
    params = [attrs.evolve(p, **extra) for p in params]
    timeline = getattr(getattr(llm, "executor", None), "timeline", None)
    if timeline is not None:
        timeline.records.clear()
    if compiles is not None:
        compiles.events.clear()
        compiles.active = True
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    result: dict[str, Any] = {"tok_s": round(tokens / seconds)}
    if compiles is not None:
        compiles.active = False
        result["compiles"] = list(compiles.events)  # (kernel, ms) compiled inside the timed run
    if extra.get("logprobs") is not None:
        start = time.perf_counter()
        entries = sum(len(tuple(o.logprobs or ())) for o in outs)
        read_s = time.perf_counter() - start
        result.update(
            read_ms=round(1e3 * read_s, 1), entries=entries, tok_s_with_read=round(tokens / (seconds + read_s))
        )
    if timeline is not None:
        decode = [r for r in timeline.records if r["num_prefill_tokens"] == 0]
        if decode:
            result.update(
                decode_steps=len(decode),
                gpu_ms=round(sum(r["gpu_ms"] for r in decode) / len(decode), 3),
                cpu_ms=round(sum(r["cpu_ms"] for r in decode) / len(decode), 3),
                host_bound=round(sum(r["cpu_ms"] > r["gpu_ms"] for r in decode) / len(decode), 3),
            )
    return result


def step_ms(llm: LLM, batch: int, output_len: int = 256) -> float:
    """Milliseconds per decode step with ``batch`` requests (warm: the same run once untimed)."""
    rng = random.Random(batch)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 128))] for _ in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3 / output_len


def median(values: list[float]) -> float:
    """The middle value (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def print_ratios(results: list[dict[str, Any]]) -> None:
    """A table per sampling variant: the median over its runs of tok/s (and, with --timeline, of the decode steps'
    device ms per step), each as a ratio to temperature-only's median; one run's tok/s moves 3-5 % from run to run
    on the H200, so ratios are read over alternated rounds (``--rounds``)."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["what"] in VARIANTS:
            by_variant.setdefault(r["what"], []).append(r)
    base = by_variant.get("temperature")
    if not base:
        return
    base_tok = median([r["tok_s"] for r in base])
    base_gpu = median([r["gpu_ms"] for r in base]) if all("gpu_ms" in r for r in base) else None
    print("| variant | runs | median tok/s | ratio | tok/s of each run | median decode device ms | ratio (time) |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in by_variant.items():
        tok = median([r["tok_s"] for r in runs])
        each = " / ".join(str(r["tok_s"]) for r in runs)
        gpu = median([r["gpu_ms"] for r in runs]) if all("gpu_ms" in r for r in runs) else None
        gpu_cols = f"{gpu:.3f} | {base_gpu / gpu:.3f}" if gpu and base_gpu else "- | -"
        print(f"| {name} | {len(runs)} | {tok:,.0f} | {tok / base_tok:.3f} | {each} | {gpu_cols} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="head")
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--checkpoint", default="/tmp/fnvllm-settings-ckpt")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=1, help="run the variant list this many times, alternated")
    parser.add_argument("--timeline", action="store_true", help="per variant: decode steps' device and host ms")
    parser.add_argument("--json", default=None, help="append one JSON line per result here")
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep the prefix cache on (off by default: every variant runs the same prompts, so with it on a later "
        "variant would skip the prefills an earlier one did, and beat it by ~5 %%)",
    )
    parser.add_argument(
        "--log-compiles", action="store_true", help="list the Triton compiles inside each variant's timed run"
    )
    args = parser.parse_args()
    compiles = CompileLog() if args.log_compiles else None
    if compiles is not None and not compiles.install():
        parser.error("--log-compiles: this Triton has no JITFunction._do_compile to wrap")
    if args.timeline and "FNVLLM_TIMELINE" not in os.environ:  # before the engine is built: it opens the timeline
        os.environ["FNVLLM_TIMELINE"] = os.path.join(tempfile.mkdtemp(prefix="fnvllm-settings-tl-"), "steps.jsonl")
    folder = Path(args.checkpoint)
    if not (folder / "config.json").exists():
        write_checkpoint(args.model_shape, folder)
    llm = LLM(folder, load_tokenizer=False, max_model_len=2048, enable_prefix_caching=args.prefix_caching)
    prompts, params = bench_workload(4)  # warm-up: graphs, kernels, allocator
    llm.generate(prompts, params, use_tqdm=False)
    results = []
    for name in [v for _ in range(args.rounds) for v in filter(None, args.variants.split(","))]:
        warm(llm, VARIANTS[name], args.num_requests)  # the same warm-up before each variant, untimed
        results.append(
            {"label": args.label, "what": name, **throughput(llm, VARIANTS[name], args.num_requests, compiles)}
        )
        print(json.dumps(results[-1]), flush=True)
    for batch in map(int, filter(None, args.batches.split(","))):
        results.append({"label": args.label, "what": f"step_ms_{batch}", "ms": round(step_ms(llm, batch), 3)})
        print(json.dumps(results[-1]), flush=True)
    print_ratios(results)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    main()

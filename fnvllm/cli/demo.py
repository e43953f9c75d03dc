"""``fnvllm demo``: the embedded demo model (a tiny Qwen3 that writes Python) end to end, in seconds, on any machine."""

from __future__ import annotations

import argparse
import time
from typing import Any

from fnvllm.cli._common import (
    RunStats,
    add_engine_args,
    add_sampling_args,
    engine_options,
    load_llm,
    one_line_errors,
    print_summary,
    print_text_outputs,
    run_requests,
    sampling_params,
    summary_line,
    tolerating_closed_stdout,
)

# Prompts end mid-line: the tokenizer merges a newline with the indentation after it, so a prompt ending in "\n"
# would cut that token in two and read oddly to the model.
DEMO_PROMPTS = (
    "def fib(n):",
    "import os\nimport sys\n\n\ndef",
    "class Stack:\n    def __init__(self",
    "if __name__ == '__main__':",
    "    with open(path",
)
# Greedy (reproducible) with a light repetition penalty: a 4.5M-parameter model's greedy text loops without it.
DEMO_SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.1, "max_tokens": 48}


def describe(llm: Any) -> str:
    """One line saying which model runs: the embedded demo model, its shape and where it lives."""
    cfg = llm.model_config
    return (
        f"Using the embedded demo model ({cfg.num_hidden_layers}-layer Qwen3, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, trained on Python's standard library) from {llm.model_path}\n"
        "(`fnvllm generate MODEL PROMPT` runs any Hugging Face checkpoint folder instead)"
    )


def run(args: argparse.Namespace) -> int:
    """Generate from the embedded model for a few Python-ish prompts; print them and a summary."""
    return tolerating_closed_stdout(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """``run``'s body."""
    params = sampling_params(args)
    llm = load_llm(None, engine_options(args))
    print(describe(llm), flush=True)
    stats, start = RunStats(llm), time.perf_counter()
    outputs = run_requests(lambda: llm.generate(list(DEMO_PROMPTS), params, use_tqdm=False))
    print_text_outputs(outputs, llm.tokenizer)
    ttfts = [o.metrics.ttft for o in outputs if o.metrics is not None and o.metrics.ttft is not None]
    print_summary(summary_line(stats, len(outputs), time.perf_counter() - start, ttfts))
    backend = getattr(llm.executor.backend, "name", llm.executor.backend)
    print_summary(f"device {llm.executor.device}, attention backend {backend}")
    return 0


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    demo = sub.add_parser(
        "demo",
        help="the embedded demo model writes some Python (CPU or GPU, seconds)",
        description="Load the embedded demo model (a tiny Qwen3 trained on Python's standard library) and "
        "continue a few Python prompts with it. Every generate flag for sampling and the engine applies.",
    )
    one_line_errors(demo)
    add_sampling_args(demo, DEMO_SAMPLING)
    add_engine_args(demo)
    demo.set_defaults(func=run)

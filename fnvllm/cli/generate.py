"""``fnvllm generate MODEL --prompt TEXT``: generate from a Hugging Face checkpoint folder."""

from __future__ import annotations

import argparse
import time
from typing import Any

from fnvllm.cli._common import add_sampling_args, print_outputs, sampling_params


def run(args: argparse.Namespace) -> int:
    """Generate from a checkpoint folder and print the outputs."""
    from fnvllm.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, sampling_params(args))
    print_outputs(outputs, time.perf_counter() - start)
    return 0


def register(sub: Any) -> None:
    """Add the ``generate`` subcommand."""
    gen = sub.add_parser("generate", help="generate from a Hugging Face checkpoint folder")
    gen.add_argument("model", help="checkpoint folder (config.json, *.safetensors, tokenizer)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--dtype", default=None, help="override the checkpoint dtype (float32, bfloat16, float16)")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_sampling_args(gen)
    gen.set_defaults(func=run)

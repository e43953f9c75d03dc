"""Options and printing shared by several subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags (a subset of ``SamplingParams``)."""
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")


def sampling_params(args: argparse.Namespace) -> Any:
    """``SamplingParams`` from the flags of ``add_sampling_args``."""
    from fnvllm.state import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )


def print_outputs(outputs: Sequence[Any], seconds: float) -> None:
    """Each prompt with its output, then one summary line."""
    total = 0
    for out in outputs:
        total += len(out.token_ids)
        print(f"--- prompt: {out.prompt!r}")
        print(f"    output: {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
    print(f"{len(outputs)} requests, {total} tokens in {seconds:.2f} s = {total / seconds:.1f} tok/s")

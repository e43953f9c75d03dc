"""``fnvllm demo``: the whole stack end to end in seconds, on any machine."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from fnvllm.cli._common import add_sampling_args, print_outputs, sampling_params


def run(args: argparse.Namespace) -> int:
    """Write a tiny random Qwen3 checkpoint and generate from it."""
    from fnvllm.llm import LLM
    from fnvllm.testing.checkpoints import write_tiny_checkpoint
    from fnvllm.testing.tokenizer import build_test_tokenizer

    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fnvllm-demo-"))
    write_tiny_checkpoint(
        folder,
        "qwen3",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        intermediate_size=256,
        tie_word_embeddings=True,
    )
    build_test_tokenizer(folder, vocab_size=512)
    print(f"tiny random Qwen3 checkpoint written to {folder}")
    llm = LLM(folder, device=args.device, block_size=16, num_blocks=512)
    prompts = ["The engine is pure:", "In the beginning", "A language model reads tokens"] * 4
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params(args))
    print_outputs(outputs, time.perf_counter() - start)
    s = llm.stats
    print(
        f"steps {s.num_steps}, prefix-cache tokens {s.num_cached_tokens}, preemptions {s.num_preemptions}, "
        f"device {llm.executor.device}, attention backend {llm.executor.backend}"
    )
    return 0


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    demo = sub.add_parser("demo", help="a small model end to end (CPU or GPU)")
    demo.add_argument("--out", help="folder for the tiny checkpoint (default: a temp folder)")
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_sampling_args(demo)
    demo.set_defaults(func=run)

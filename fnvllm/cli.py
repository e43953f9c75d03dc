"""Command line: ``fnvllm demo`` (tiny random model, runs anywhere) and ``fnvllm generate`` (a checkpoint folder).

fnvllm demo                                  # writes a tiny Qwen3 checkpoint, generates, prints a summary
fnvllm generate PATH --prompt "Hello" --max-tokens 64 --temperature 0.6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed")


def _sampling(args: argparse.Namespace) -> object:
    from fnvllm.state import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )


def _print_outputs(outputs: Sequence[object], seconds: float) -> None:
    total = 0
    for out in outputs:
        total += len(out.token_ids)  # type: ignore[attr-defined]
        print(f"--- prompt: {out.prompt!r}")  # type: ignore[attr-defined]
        print(f"    output: {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")  # type: ignore[attr-defined]
    print(f"{len(outputs)} requests, {total} tokens in {seconds:.2f} s = {total / seconds:.1f} tok/s")


def cmd_generate(args: argparse.Namespace) -> None:
    """Generate from a checkpoint folder."""
    from fnvllm.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, _sampling(args))  # type: ignore[arg-type]
    _print_outputs(outputs, time.perf_counter() - start)


def cmd_demo(args: argparse.Namespace) -> None:
    """Write a tiny random Qwen3 checkpoint and generate from it (exercises the whole stack in seconds)."""
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
    outputs = llm.generate(prompts, _sampling(args))  # type: ignore[arg-type]
    _print_outputs(outputs, time.perf_counter() - start)
    s = llm.stats
    print(
        f"steps {s.num_steps}, prefix-cache tokens {s.num_cached_tokens}, preemptions {s.num_preemptions}, "
        f"device {llm.executor.device}, attention backend {llm.executor.backend}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``fnvllm`` argument parser."""
    parser = argparse.ArgumentParser(prog="fnvllm", description="fnvllm: LLM inference with a pure scheduler")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="tiny random model end to end (CPU or GPU)")
    demo.add_argument("--out", help="folder for the tiny checkpoint (default: a temp folder)")
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    _add_sampling_args(demo)
    demo.set_defaults(func=cmd_demo)
    gen = sub.add_parser("generate", help="generate from a Hugging Face checkpoint folder")
    gen.add_argument("model", help="checkpoint folder (config.json, *.safetensors, tokenizer)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--dtype", default=None, help="override the checkpoint dtype (float32, bfloat16, float16)")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``fnvllm`` command."""
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

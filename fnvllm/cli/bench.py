"""``fnvllm bench``: output tok/s on the nano-vllm workload, beside the workload's bandwidth floor."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from fnvllm.cli import CLIError


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or one JSON object with ``--json``)."""
    from fnvllm.benchmark import run_bench

    if args.profile and "FNVLLM_TIMELINE" not in os.environ:
        os.environ["FNVLLM_TIMELINE"] = os.path.join(tempfile.mkdtemp(prefix="fnvllm-timeline-"), "steps.jsonl")
    options: dict[str, Any] = {
        "block_size": args.block_size,
        "attention_backend": args.backend,
        "enforce_eager": args.enforce_eager,
        "overlap_steps": not args.no_overlap,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    try:
        result = run_bench(
            args.model,
            args.model_shape,
            args.num_requests,
            args.max_input_len,
            args.max_output_len,
            args.read_tb_s * args.tensor_parallel_size,  # each GPU reads its share of the weights and KV
            use_tqdm=sys.stderr.isatty(),
            **options,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise CLIError(str(e)) from e
    result["tensor_parallel_size"] = args.tensor_parallel_size
    if args.profile:
        result["timeline_file"] = os.environ["FNVLLM_TIMELINE"]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand."""
    p = sub.add_parser("bench", help="throughput on the nano-vllm workload (random weights of a real shape)")
    p.add_argument("--model", default=None, help="a checkpoint folder instead of a random one of --model-shape")
    p.add_argument("--model-shape", default="qwen3-0.6b", choices=["tiny", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
    p.add_argument("--num-requests", type=int, default=256, help="requests in the workload (default 256)")
    p.add_argument("--max-input-len", type=int, default=1024, help="prompt lengths are drawn from [100, this]")
    p.add_argument("--max-output-len", type=int, default=1024, help="max_tokens are drawn from [100, this]")
    p.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton, flash")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-overlap", action="store_true", help="one step at a time (no overlapped steps)")
    p.add_argument("--block-size", type=int, default=256, help="tokens per KV block (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=512, help="cap on running sequences")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="cap on prompt + output tokens (default: 4096 or the model's)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    p.add_argument("--read-tb-s", type=float, default=4.16, help="one device's read ceiling for the floor (TB/s)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over (the floor uses all of them)"
    )
    p.add_argument("--profile", action="store_true", help="record the per-step timeline and print its summary")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)

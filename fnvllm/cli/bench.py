"""``fnvllm bench``: output tok/s on the nano-vllm workload, beside the workload's bandwidth floor (on a GPU).

Defaults by shape: the real shapes (``qwen3-0.6b``, ``qwen3-8b``, ``qwen3-30b-a3b``) run the nano-vllm workload
(256 requests, prompts of 100-1024 ids, 100-1024 output tokens); ``tiny`` (the default on a machine without
CUDA) runs a CPU-sized one (32 requests, prompts of 100-256 ids, 100-128 output tokens, 16-token KV blocks:
seconds on a CPU). Explicit flags override either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from fnvllm.benchmark import SHAPES
from fnvllm.cli import CLIError

# (num_requests, max_input_len, max_output_len, block_size) per shape; other shapes use the nano-vllm workload.
WORKLOAD_DEFAULTS = {"tiny": (32, 256, 128, 16)}
NANO_VLLM_WORKLOAD = (256, 1024, 1024, 256)
WORKLOAD_FLAGS = ("num_requests", "max_input_len", "max_output_len", "block_size")
PROGRESS_EVERY_S = 5.0  # plain progress lines when stderr is not a terminal
# --preset: a checkpoint's own generation_config sampling (on top of the workload's temperature 0.6)
PRESETS = {"qwen3": {"top_p": 0.95, "top_k": 20}}
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the sampling flags set: the preset's, then each flag given."""
    overrides = dict(PRESETS[args.preset]) if args.preset else {}
    overrides.update({name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None})
    return overrides


def resolve_workload(args: argparse.Namespace) -> None:
    """Fill the shape and workload flags left at None: the shape from the machine (tiny without CUDA), the sizes
    from the shape."""
    if args.model_shape is None:
        import torch

        args.model_shape = "qwen3-0.6b" if args.model or torch.cuda.is_available() else "tiny"
    defaults = WORKLOAD_DEFAULTS.get(args.model_shape, NANO_VLLM_WORKLOAD)
    for name, default in zip(WORKLOAD_FLAGS, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or one JSON object with ``--json``)."""
    from fnvllm.benchmark import run_bench

    resolve_workload(args)
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
            progress_every_s=None if sys.stderr.isatty() else PROGRESS_EVERY_S,
            sampling=sampling_overrides(args),
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
    p = sub.add_parser(
        "bench",
        help="throughput on the nano-vllm workload (random weights of a real shape)",
        description=__doc__.split("\n", 1)[1].strip(),
    )
    p.add_argument("--model", default=None, help="a checkpoint folder instead of a random one of --model-shape")
    p.add_argument(
        "--model-shape",
        default=None,
        choices=list(SHAPES),
        help="shape of the random checkpoint (default: qwen3-0.6b with CUDA, tiny without)",
    )
    p.add_argument("--num-requests", type=int, default=None, help="requests in the workload (default 256; tiny: 32)")
    p.add_argument(
        "--max-input-len", type=int, default=None, help="prompt lengths are drawn from [100, this] (1024; tiny: 256)"
    )
    p.add_argument(
        "--max-output-len", type=int, default=None, help="max_tokens are drawn from [100, this] (1024; tiny: 128)"
    )
    p.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton, flash")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-overlap", action="store_true", help="one step at a time (no overlapped steps)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 256; tiny: 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=512, help="cap on running sequences")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="cap on prompt + output tokens (default: 4096 or the model's)"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use")
    p.add_argument(
        "--read-tb-s", type=float, default=4.16, help="one GPU's read ceiling for the floor (TB/s; H200: 4.16)"
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over (the floor uses all of them)"
    )
    sampling = p.add_argument_group("sampling (added to every request; the workload samples at temperature 0.6)")
    sampling.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a checkpoint's own sampling")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--presence-penalty", type=float, default=None)
    sampling.add_argument("--frequency-penalty", type=float, default=None)
    sampling.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token")
    p.add_argument("--profile", action="store_true", help="record the per-step timeline and print its summary")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)

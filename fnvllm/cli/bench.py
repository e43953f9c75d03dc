"""``fnvllm bench``: output tok/s on the nano-vllm workload, beside the workload's bandwidth floor (on a GPU).

Defaults by shape: the real shapes (``qwen3-0.6b``, ``qwen3-8b``, ``qwen3-30b-a3b``, ``qwen1.5-moe-a2.7b``,
``mixtral-8x7b``) run the nano-vllm workload
(256 requests, prompts of 100-1024 ids, 100-1024 output tokens); ``tiny`` (the default on a machine without
CUDA) runs a CPU-sized one (32 requests, prompts of 100-256 ids, 100-128 output tokens, 16-token KV blocks:
seconds on a CPU). Explicit flags override either. The engine flags are ``EngineConfig``'s, as in ``fnvllm
generate`` and ``fnvllm serve`` (``--kv-cache-dtype``, ``--tensor-parallel-size`` …), with the bench's own defaults
for the block size (by shape), the token budget (16384) and the running-sequence cap (512).
``qwen3-30b-a3b`` and ``mixtral-8x7b`` run with ``--load-format dummy`` by default (config.json only, random weights
filled on the device: their 61 and 93 GB checkpoints are not written); ``--load-format auto`` writes the checkpoint
as for the other shapes.
``tiny-moe`` is a tiny Qwen3-MoE for CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from fnvllm.bench import DUMMY_BY_DEFAULT, SHAPES
from fnvllm.cli import CLIError
from fnvllm.cli._common import add_engine_args, engine_options

# (num_requests, max_input_len, max_output_len, block_size) per shape; other shapes use the nano-vllm workload.
WORKLOAD_DEFAULTS = {"tiny": (32, 256, 128, 16), "tiny-moe": (32, 256, 128, 16)}
NANO_VLLM_WORKLOAD = (256, 1024, 1024, 256)
WORKLOAD_FLAGS = ("num_requests", "max_input_len", "max_output_len", "ec_block_size")
# EngineConfig defaults the bench changes (None: from the shape, in resolve_workload).
BENCH_ENGINE_DEFAULTS = {"block_size": None, "max_num_batched_tokens": 16384, "max_num_seqs": 512, "load_format": None}
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
    and the load format (dummy for DUMMY_BY_DEFAULT shapes without --model) from the shape."""
    if args.model_shape is None:
        import torch

        args.model_shape = "qwen3-0.6b" if args.model or torch.cuda.is_available() else "tiny"
    defaults = WORKLOAD_DEFAULTS.get(args.model_shape, NANO_VLLM_WORKLOAD)
    for name, default in zip(WORKLOAD_FLAGS, defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if getattr(args, "ec_load_format", None) is None:
        args.ec_load_format = "dummy" if args.model_shape in DUMMY_BY_DEFAULT and not args.model else "auto"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or one JSON object with ``--json``)."""
    from fnvllm.bench import run_bench

    args.max_output_len_given = args.max_output_len is not None
    resolve_workload(args)
    if args.profile and "FNVLLM_TIMELINE" not in os.environ:
        os.environ["FNVLLM_TIMELINE"] = os.path.join(tempfile.mkdtemp(prefix="fnvllm-timeline-"), "steps.jsonl")
    options = engine_options(args)
    if args.latency is not None:
        return run_latency_mode(args, options)
    try:
        result = run_bench(
            args.model,
            args.model_shape,
            args.num_requests,
            args.max_input_len,
            args.max_output_len,
            args.read_tb_s,  # one GPU's (None: the card's own); run_bench scales them by the tensor-parallel size
            args.peak_tflops,
            use_tqdm=sys.stderr.isatty(),
            progress_every_s=None if sys.stderr.isatty() else PROGRESS_EVERY_S,
            sampling=sampling_overrides(args),
            **options,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise CLIError(str(e)) from e
    result["tensor_parallel_size"] = options.get("tensor_parallel_size", 1)
    if args.profile:
        result["timeline_file"] = os.environ["FNVLLM_TIMELINE"]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0


def run_latency_mode(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``fnvllm bench --latency``: ms per decode step and TPOT / TTFT percentiles at small batches."""
    from fnvllm.bench import run_latency

    try:
        output_tokens = args.max_output_len if args.max_output_len_given else 256
        result = run_latency(
            args.model,
            args.model_shape,
            args.latency,
            sampling_overrides(args),
            announce=not args.json,
            output_tokens=output_tokens,
            read_tb_s=args.read_tb_s,
            **options,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise CLIError(str(e)) from e
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{'requests':>8} {'ms/step':>8} {'floor':>6} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9}"
        "  device / host ms per step"
    )
    for row in result["latency"]:
        timeline = row["decode_timeline"] or {}
        split = f"{timeline.get('mean_gpu_ms', '-')} / {timeline.get('mean_cpu_ms', '-')}" if timeline else "-"
        floor = f"{row['floor_ms_per_step']:.3f}" if "floor_ms_per_step" in row else "-"
        print(
            f"{row['requests']:>8} {row['ms_per_step']:>8.3f} {floor:>6} {row['tpot_p50_ms']:>9.3f} "
            f"{row['tpot_p99_ms']:>9.3f} {row['ttft_p50_ms']:>9.3f}  {split}"
        )
    return 0


def _batches(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> (1, 16, 64)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated request counts, got {text!r}") from None


def _positive_float(text: str) -> float:
    """``"3.1"`` -> 3.1; a value that is not a number > 0 is refused, naming it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


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
        help="shape of the random checkpoint (default: qwen3-0.6b with CUDA, tiny without); qwen3-30b-a3b and "
        "mixtral-8x7b use --load-format dummy unless told otherwise",
    )
    p.add_argument("--num-requests", type=int, default=None, help="requests in the workload (default 256; tiny: 32)")
    p.add_argument(
        "--max-input-len", type=int, default=None, help="prompt lengths are drawn from [100, this] (1024; tiny: 256)"
    )
    p.add_argument(
        "--max-output-len", type=int, default=None, help="max_tokens are drawn from [100, this] (1024; tiny: 128)"
    )
    p.add_argument(
        "--read-tb-s",
        type=_positive_float,
        default=None,
        help="one GPU's read ceiling for the floor (TB/s; default: the card's measured one, H200 4.16, H100 3.117; "
        "H200's for a card without a built-in profile)",
    )
    p.add_argument(
        "--peak-tflops",
        type=_positive_float,
        default=None,
        help="one GPU's bf16 tensor-core peak for the roofline (TFLOP/s; default: the card's measured one, H200 793, "
        "H100 766.8; with FP8 weights the dense linears' GEMMs count at twice it, the experts at it)",
    )
    add_engine_args(p, BENCH_ENGINE_DEFAULTS)
    # Shorter spellings kept from before the engine flags were derived: --backend, --no-overlap.
    p.add_argument("--backend", dest="ec_attention_backend", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--no-overlap", dest="ec_overlap_steps", action="store_false", help=argparse.SUPPRESS)
    sampling = p.add_argument_group("sampling (added to every request; the workload samples at temperature 0.6)")
    sampling.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a checkpoint's own sampling")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--presence-penalty", type=float, default=None)
    sampling.add_argument("--frequency-penalty", type=float, default=None)
    sampling.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token")
    p.add_argument(
        "--latency",
        nargs="?",
        type=_batches,
        const=(1, 16, 64),
        default=None,
        metavar="N[,N...]",
        help="latency mode: N concurrent requests (default 1,16,64; prompts of 100-128 ids, 256 output tokens or "
        "--max-output-len), warm, ms per decode step and TPOT/TTFT p50/p99 (with --profile: device and host ms; "
        "on a GPU: the step's floor at --read-tb-s)",
    )
    p.add_argument("--profile", action="store_true", help="record the per-step timeline and print its summary")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)

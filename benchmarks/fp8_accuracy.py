"""What FP8 costs in accuracy: greedy agreement and next-token KL against the bf16 engine, per option set.

    PYTHONPATH=$PWD python3 benchmarks/fp8_accuracy.py [--device cpu|cuda] [--tokens 32] [--json PATH]

Checkpoints: the embedded demo model (``fnvllm.demo.model_path()``: trained, so its logits carry real margins)
and a random bf16 Qwen3 (hidden 256, 4 layers, 4/2 heads of 64, vocab 4096, init std 0.1) written to a temporary
folder. Prompts: a fixed set of 16 Python openings (the demo model writes Python), tokenized by the demo tokenizer
(the random model reads the same ids).

For each checkpoint the baseline (EngineConfig defaults: bf16 weights, bf16 KV) runs the prompts greedily for
``--tokens`` decode steps through a ModelExecutor (the engine's own model, caches, backend and kernels: one
prefill step of all prompts, then batched decode steps). Each option set in OPTION_SETS then runs twice:
  - teacher-forced on the baseline's greedy continuation (both see the same context): mean and max per-token
    KL(baseline || option) of the next-token distribution, and top-1 agreement (argmax equal);
  - free-running greedy: the share of generated tokens before the first one that differs from the baseline's
    ("greedy prefix"), and of positions with the same token ("greedy same").
Option sets whose keys EngineConfig does not have yet are skipped with a note (e.g. ``quantization`` before the
FP8-weights work lands). A short table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from fnvllm.config import EngineConfig
from fnvllm.executor.device_inputs import build_attention_metadata
from fnvllm.executor.model_executor import ModelExecutor
from fnvllm.kernels import decode_attention as dec
from fnvllm.kernels.fp8 import FP8_DTYPE

# Not an EngineConfig field: the FP8 decode kernel's ``fp8_path`` for this option set. On a GPU it replaces
# DEFAULT_FP8_DECODE_CONFIG's while the set runs; on the CPU (torch backend) the "_qk8" paths are emulated by
# rounding the decode steps' queries to e4m3 (what they do before their K q^T product; their other roundings, P to
# float16, are the same as the "mma" path's).
DECODE_PATH = "fp8_decode_path"
DEFAULT_FP8 = dec.DEFAULT_FP8_DECODE_CONFIG  # the launcher's FP8 knobs as shipped (option sets without DECODE_PATH)
SMALL_BATCH_FP8 = dec.SMALL_BATCH_DECODE_FP8  # and its small-batch entries (this script's 16 prompts take one)

OPTION_SETS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fp8 KV", {"kv_cache_dtype": "fp8"}),
    ("fp8 KV, decode path mma", {"kv_cache_dtype": "fp8", DECODE_PATH: "mma"}),
    ("fp8 KV, decode q e4m3", {"kv_cache_dtype": "fp8", DECODE_PATH: "wgmma_qk8"}),
    ("fp8 weights", {"quantization": "fp8"}),
    ("fp8 weights + KV", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
    ("fp8 weights + KV, decode q e4m3", {"quantization": "fp8", "kv_cache_dtype": "fp8", DECODE_PATH: "wgmma_qk8"}),
)
PROMPTS = (
    "def fib(",
    "import os\nimport sys\n\n\ndef main():\n    ",
    "class Stack:\n    def __init__(self",
    "def read_file(path):\n    ",
    "class Node:\n    ",
    'class Config(object):\n    """',
    "def parse_args(argv",
    "import re\n\n_PATTERN = re.compile(",
    "    def __repr__(self):\n        return ",
    "from collections import defaultdict\n\n\ndef count_words(",
    "try:\n    import json\nexcept ImportError:\n    ",
    "def _get_executable(executable=None):\n    ",
    "class Error(Exception):\n    ",
    "if __name__ == '__main__':\n    ",
    "    for i in range(len(",
    "def test_",
)
BLOCK_SIZE = 16


@attrs.frozen
class Run:
    """One pass over the prompts: each prompt's generated tokens and its per-step next-token log-probabilities
    ((num_tokens, vocab) float32 on the CPU)."""

    tokens: list[list[int]]
    logprobs: list[torch.Tensor]


def supported(options: dict[str, Any]) -> list[str]:
    """The option names EngineConfig does not have (empty when the set can run)."""
    known = {a.name for a in attrs.fields(EngineConfig)} | {DECODE_PATH}
    return sorted(set(options) - known)


def make_executor(path: Path, device: str, options: dict[str, Any], num_blocks: int) -> ModelExecutor:
    """A ModelExecutor for ``path`` with the engine options (eager: the loop below drives the model itself); a
    DECODE_PATH option sets the FP8 decode kernel's path (GPU) or emulates a "_qk8" one (CPU, see DECODE_PATH)."""
    engine_options = {k: v for k, v in options.items() if k != DECODE_PATH}
    config = EngineConfig(
        device=device, block_size=BLOCK_SIZE, num_blocks=num_blocks, enforce_eager=True, max_num_seqs=64,
        **engine_options,
    )  # fmt: skip
    ex = ModelExecutor(path, config)
    path_choice = options.get(DECODE_PATH, DEFAULT_FP8.fp8_path)
    if ex.device.type == "cuda":  # the default and the small-batch entries built from it at import
        dec.DEFAULT_FP8_DECODE_CONFIG = dataclasses.replace(DEFAULT_FP8, fp8_path=path_choice)
        dec.SMALL_BATCH_DECODE_FP8 = {
            rows: None if cfg is None else dataclasses.replace(cfg, fp8_path=path_choice)
            for rows, cfg in SMALL_BATCH_FP8.items()
        }
    elif "_qk8" in path_choice:  # the other paths compute what the torch backend does (up to float32 rounding)
        ex.backend = attrs.evolve(ex.backend, attend=_decode_q_e4m3(ex.backend.attend))
    return ex


def _decode_q_e4m3(attend: Any) -> Any:
    """``attend`` with the queries of all-decode steps rounded to e4m3 first (and back to their dtype)."""

    def wrapped(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any, *args: Any, **kw: Any):
        if meta.max_seqlen_q == 1 and k_cache.dtype == FP8_DTYPE:
            q = q.float().to(FP8_DTYPE).to(q.dtype)
        return attend(q, k_cache, v_cache, meta, *args, **kw)

    return wrapped


@torch.inference_mode()
def run(ex: ModelExecutor, prompts: Sequence[Sequence[int]], num_tokens: int, forced: Run | None = None) -> Run:
    """Prefill every prompt in one step, then ``num_tokens - 1`` batched decode steps; each step feeds the
    argmax (free-running) or ``forced``'s token (teacher-forced). Sequence i owns blocks [i * W, (i + 1) * W)."""
    width = math.ceil((max(map(len, prompts)) + num_tokens) / BLOCK_SIZE)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(prompts))]
    feed = [list(p) for p in prompts]
    starts = [0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(num_tokens):
        lens = [len(f) for f in feed]
        meta = build_attention_metadata(starts, lens, tables, BLOCK_SIZE, ex.device)
        ids = torch.tensor([t for f in feed for t in f], device=ex.device)
        hidden = ex.model(ids, meta.positions, ex.kv_caches, meta, ex.backend)  # (T, H)
        last = torch.tensor(lens, device=ex.device).cumsum(0) - 1  # each sequence's last fed token
        lp = ex.model.compute_logits(hidden[last]).float().log_softmax(-1).cpu()  # (B, V)
        for i in range(len(prompts)):
            logprobs[i].append(lp[i])
            tokens[i].append(int(lp[i].argmax()) if forced is None else forced.tokens[i][step])
        starts = [s + n for s, n in zip(starts, lens, strict=True)]
        feed = [[t[-1]] for t in tokens]
    return Run(tokens, [torch.stack(lps) for lps in logprobs])


def compare(base: Run, forced: Run, free: Run) -> dict[str, float]:
    """KL(base || option) per token (mean, max) and top-1 agreement from the teacher-forced run; greedy prefix
    and same-position agreement from the free-running one."""
    kls, top1 = [], []
    for b, o in zip(base.logprobs, forced.logprobs, strict=True):  # (N, V) each
        kls.append((b.exp() * (b - o)).sum(-1))  # (N,)
        top1.append((b.argmax(-1) == o.argmax(-1)).float())
    kl = torch.cat(kls)
    total = sum(map(len, base.tokens))
    prefix = sum(_common_prefix(b, o) for b, o in zip(base.tokens, free.tokens, strict=True))
    same = sum(x == y for b, o in zip(base.tokens, free.tokens, strict=True) for x, y in zip(b, o, strict=True))
    return {
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
        "top1_agreement": torch.cat(top1).mean().item(),
        "greedy_prefix": prefix / total,
        "greedy_same": same / total,
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def evaluate(name: str, path: Path, prompts: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows of the table for one checkpoint: one per option set that runs here."""
    num_blocks = len(prompts) * math.ceil((max(map(len, prompts)) + args.tokens) / BLOCK_SIZE) + 1
    base = run(make_executor(path, args.device, {}, num_blocks), prompts, args.tokens)
    rows = []
    for label, options in OPTION_SETS:
        missing = supported(options)
        if missing:
            print(f"{name}: skipping {label!r}: EngineConfig has no {missing} yet", file=sys.stderr)
            continue
        ex = make_executor(path, args.device, options, num_blocks)
        stats = compare(base, run(ex, prompts, args.tokens, forced=base), run(ex, prompts, args.tokens))
        rows.append({"checkpoint": name, "options": label, **stats})
        del ex
    return rows


def random_checkpoint(folder: Path) -> Path:
    """A random bf16 Qwen3 with the demo model's vocabulary size (see the module docstring)."""
    from fnvllm.testing.checkpoints import write_tiny_checkpoint

    return write_tiny_checkpoint(
        folder,
        "qwen3",
        vocab_size=4096,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=640,
        dtype="bfloat16",
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The summary table (markdown)."""
    lines = [
        "| checkpoint | options | mean KL (nats) | max KL | top-1 agree (forced) | greedy prefix | greedy same |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['checkpoint']} | {r['options']} | {r['mean_kl']:.5f} | {r['max_kl']:.4f} | "
            f"{r['top1_agreement']:.3f} | {r['greedy_prefix']:.3f} | {r['greedy_same']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Parse the flags, evaluate both checkpoints, print the table (last); returns the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from fnvllm.demo import model_path

    demo = model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(demo))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows = evaluate("demo (trained)", demo, prompts, args)
    with tempfile.TemporaryDirectory(prefix="fnvllm-fp8-acc-") as tmp:
        rows += evaluate("random bf16", random_checkpoint(Path(tmp)), prompts, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"\nFP8 accuracy vs the bf16 engine: {len(PROMPTS)} prompts x {args.tokens} tokens, device {args.device}")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

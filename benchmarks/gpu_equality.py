"""End-to-end backend agreement on the GPU (one command on the H200, part of ``gpu_check.sh``).

On a random Qwen3-0.6B-shape checkpoint in bf16: greedy tokens of each attention backend (CUDA graphs on and
off) must equal the torch reference backend's for the first 32 tokens on >= 95% of 64 prompts, and prefix
caching on/off must give identical outputs. Prints one line per configuration and exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from fnvllm.benchmark import agreement_prompts, write_checkpoint
from fnvllm.kernels.backends import available_backends
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams


def _greedy(folder: Path, prompts: list[list[int]], **options: object) -> tuple[list[tuple[int, ...]], float]:
    llm = LLM(
        folder, load_tokenizer=False, block_size=16, max_model_len=2048, max_num_seqs=64, num_blocks=4096, **options
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.token_ids for o in outs], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-shape", default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    folder = write_checkpoint(args.model_shape, Path(tempfile.mkdtemp(prefix="fnvllm-eq-")))
    prompts = agreement_prompts(args.num_prompts)
    reference, ref_s = _greedy(folder, prompts, attention_backend="torch", enforce_eager=True)
    print(f"torch (reference): {ref_s:.2f} s")
    results, ok = {}, True
    names = [b.name for b in available_backends(torch.device("cuda")) if b.name != "torch"]
    for name in names:
        for eager in (True, False):
            tokens, seconds = _greedy(folder, prompts, attention_backend=name, enforce_eager=eager)
            same = sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(prompts)
            label = f"{name} {'eager' if eager else 'graphs'}"
            results[label] = same
            ok &= same >= 0.95
            print(f"{label:>16}: {same:.1%} of prompts equal the reference over 32 tokens ({seconds:.2f} s)")
    best = names[0] if names else "torch"
    cached, _ = _greedy(folder, prompts + prompts, attention_backend=best)
    uncached, _ = _greedy(folder, prompts + prompts, attention_backend=best, enable_prefix_caching=False)
    same_cache = cached == uncached
    ok &= same_cache
    print(f"prefix caching on == off ({best}): {same_cache}")
    if args.json:
        Path(args.json).write_text(json.dumps({"agreement": results, "prefix_cache_identical": same_cache}))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

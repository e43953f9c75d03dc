"""Where the host waits in prefill (mixed) steps: the bench's 256 prompts with 3 output tokens each (mostly
mixed steps), under torch.profiler; prints the CUDA runtime calls that can block the host (synchronizations,
blocking copies, allocations) with their counts and total host time.

    PYTHONPATH=$PWD python3 benchmarks/profile_mixed.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fnvllm.benchmark import bench_workload, write_checkpoint
from fnvllm.llm import LLM
from fnvllm.state import SamplingParams


def main() -> None:
    folder = write_checkpoint("qwen3-0.6b", Path(tempfile.mkdtemp(prefix="fnvllm-mixed-")))
    llm = LLM(folder, load_tokenizer=False, block_size=256, max_num_batched_tokens=16384, max_num_seqs=512,
              max_model_len=4096)  # fmt: skip
    prompts, _ = bench_workload(256, 1024, 1024)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=3)
    llm.generate(prompts[:64], params, use_tqdm=False)  # warm-up, mixed steps included
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith("cuda") or "Synchronize" in e.key or "Memcpy" in e.key]
    rows.sort(key=lambda e: -e.cpu_time_total)
    print(f"{'runtime call':<48}{'count':>8}{'host ms':>12}")
    for e in rows[:20]:
        print(f"{e.key[:47]:<48}{e.count:>8}{e.cpu_time_total / 1e3:>12.2f}")
    print(f"steps: {llm.stats.num_steps}")


if __name__ == "__main__":
    main()

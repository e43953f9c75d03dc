"""Request workloads shared by the throughput bench, the simulator, the server's load client and the GPU checks.

``bench_workload`` is nano-vllm's bench.py draw, in the same order: ``random.seed(0)``; prompt ids randint(0,
10000) of length randint(100, 1024); max_tokens randint(100, 1024); temperature 0.6; ignore_eos. Pure Python
(no torch): the simulator generates the same requests the GPU bench runs.
"""

from __future__ import annotations

import random

from fnvllm.state import SamplingParams


def bench_workload(
    num_requests: int = 256,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
    seed: int = 0,
    vocab_size: int | None = None,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and sampling params of the nano-vllm bench workload (lengths are drawn from [100, max]).
    ``vocab_size``: the model's; ids are taken modulo it, which changes them only for a vocabulary of 10,000 ids
    or fewer (the draws themselves never change)."""
    for name, value in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if value < 100:
            raise ValueError(f"{name} must be >= 100 (the workload draws lengths from [100, max]), got {value}")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_requests)]
    prompts = within_vocab(prompts, vocab_size)
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, max_output_len))
        for _ in range(num_requests)
    ]
    return prompts, params


def within_vocab(prompts: list[list[int]], vocab_size: int | None) -> list[list[int]]:
    """``prompts`` with each id taken modulo ``vocab_size`` (None: unchanged); the workloads draw ids from
    [0, 10000], so only a vocabulary of 10,000 ids or fewer changes any."""
    if vocab_size is None or vocab_size > 10000:
        return prompts
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return [[t % vocab_size for t in p] for p in prompts]


def agreement_prompts(n: int = 64, seed: int = 1) -> list[list[int]]:
    """Prompts for backend / tensor-parallel agreement checks: n prompts of 20-300 random ids; every fourth is a
    shared 300-token prefix plus its own tail (so the prefix cache is exercised)."""
    rng = random.Random(seed)
    shared = [rng.randint(0, 10000) for _ in range(300)]
    out = []
    for i in range(n):
        tail = [rng.randint(0, 10000) for _ in range(rng.randint(20, 300))]
        out.append(shared + tail if i % 4 == 0 else tail)
    return out

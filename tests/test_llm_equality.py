"""Greedy fnvllm output equals transformers' `generate`, token for token, in fp32, under every scheduling regime."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tiny_models import hf_greedy, hf_model, write_family

from fnvllm.llm import LLM
from fnvllm.state import SamplingParams

MAX_NEW = 16


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    path = write_family(tmp_path_factory.mktemp("ckpt"), request.param)
    return request.param, path, hf_model(path)


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """10 prompts of mixed lengths (1..70 tokens); 6 of them share a 40-token system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(3, 250) for _ in range(n)] for n in (1, 7, 33, 64)]
    return prompts


def references(model: Any, prompts: list[list[int]], eos: list[int]) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_NEW, eos) for p in prompts]


_REFS: dict[str, list[list[int]]] = {}

# Each regime: engine options, and what must have happened so the case is not vacuous.
REGIMES: dict[str, tuple[dict[str, Any], str | None]] = {
    "block16": (dict(block_size=16, num_blocks=256), None),
    "block1": (dict(block_size=1, num_blocks=2048), None),
    "block256": (dict(block_size=256, num_blocks=16), None),
    "chunked_prefill": (dict(block_size=16, num_blocks=256, max_num_batched_tokens=8), None),
    "prefix_cache_hits": (dict(block_size=4, num_blocks=512), "cached"),
    "tiny_pool_preemption": (dict(block_size=4, num_blocks=30, max_num_batched_tokens=64), "preempted"),
    "no_prefix_cache": (dict(block_size=16, num_blocks=256, enable_prefix_caching=False), None),
}


def check_prefix_hits(name: str, path: Path, model: Any, device: str = "cpu") -> None:
    """``check_equal`` of an fp32 LLM of ``path`` under the prefix-cache-hits regime; on a GPU the decode steps
    replay CUDA graphs with the Triton ops, which is checked too."""
    llm = LLM(path, dtype="float32", device=device, **REGIMES["prefix_cache_hits"][0])
    if device == "cuda":
        assert llm.executor.graphs is not None and llm.executor.ops.name == "triton"
    check_equal(name, model, llm, "prefix_cache_hits")


def check_equal(name: str, model: Any, llm: LLM, regime: str) -> None:
    """Generate the mixed prompts with ``llm`` and compare with transformers' greedy tokens (cached per family
    name); the regime's "cached" / "preempted" must have happened, so the case is not vacuous."""
    must = REGIMES[regime][1]
    eos = sorted(llm.engine.config.eos_token_ids)
    prompts = mixed_prompts()
    if name not in _REFS:
        _REFS[name] = references(model, prompts, eos)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if must == "cached":
        outs = llm.generate(prompts, params, use_tqdm=False)  # second pass: whole prompts come from the cache
        assert llm.stats.num_cached_tokens > 200
    if must == "preempted":
        assert llm.stats.num_preemptions > 0
    for prompt, out, ref in zip(prompts, outs, _REFS[name], strict=True):
        assert list(out.token_ids) == ref, f"{name}/{regime}: prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == ("stop" if ref[-1] in eos else "length")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_equals_transformers(family: tuple[str, Path, Any], regime: str) -> None:
    """Greedy tokens equal transformers' generate for 10 mixed prompts under this block size / budget / pool."""
    name, path, model = family
    check_equal(name, model, LLM(path, dtype="float32", **REGIMES[regime][0]), regime)

"""Qwen3-MoE through the public API: greedy tokens equal transformers' Qwen3MoeForCausalLM in fp32 under every
scheduling regime of the dense families (prefix caching, chunked prefill, preemption), with and without
renormalised top-k and with a dense layer; and the Triton fused-MoE path inside the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_llm_equality import REGIMES, check_equal, check_prefix_hits
from tiny_models import MOE_FAMILIES, hf_model, write_family

from fnvllm.llm import LLM


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    path = write_family(tmp_path_factory.mktemp("moe"), request.param)
    return request.param, path, hf_model(path)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_moe_greedy_equals_transformers(moe_family: tuple[str, Path, Any], regime: str) -> None:
    """Greedy Qwen3-MoE tokens equal transformers' generate for 10 mixed prompts under this scheduling regime."""
    name, path, model = moe_family
    check_equal(name, model, LLM(path, dtype="float32", **REGIMES[regime][0]), regime)


# qwen3_moe only (a MoE layer beside a dense one): the interpreter takes ~30 s for the unnormed family's two MoE
# layers, whose routing without renormalisation test_moe_kernel.py checks against transformers' router.
@pytest.mark.parametrize("moe_family", ["qwen3_moe"], indirect=True)
def test_moe_triton_kernel_in_model_equals_transformers(moe_family: tuple[str, Path, Any]) -> None:
    """With model_ops="triton" the model's MoE layers run the fused kernel (interpreted on the CPU) and greedy
    tokens still equal transformers' under chunked prefill."""
    name, path, model = moe_family
    llm = LLM(path, dtype="float32", model_ops="triton", attention_backend="torch", **REGIMES["chunked_prefill"][0])
    assert llm.executor.ops.name == "triton"
    check_equal(name, model, llm, "chunked_prefill")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_with_cuda_graphs_equals_transformers(moe_family: tuple[str, Path, Any]) -> None:
    """On a GPU (Triton ops and attention, decode steps replayed from CUDA graphs) fp32 greedy tokens equal
    transformers' under prefix caching."""
    check_prefix_hits(*moe_family, device="cuda")

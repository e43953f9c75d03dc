"""Qwen2-MoE checkpoints (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): logits and greedy tokens equal transformers'
Qwen2MoeForCausalLM in fp32, with every layer sparse and the top-k not renormalised, and with dense and sparse layers
mixed by decoder_sparse_step and mlp_only_layers and the top-k renormalised; the shared expert is a dense MLP split
like one under tensor parallelism with its gate replicated; TP=2 on gloo equals one process; malformed shared-expert
fields are refused by name (FP8 Qwen2-MoE: tests/test_fp8_moe.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_llm_equality import check_prefix_hits
from test_model import TOL, check_chunked_prefill, hf_logits, prompt, run_schedule
from test_tp import check_tp2_greedy
from tiny_models import QWEN2_MOE_FAMILIES, hf_model, write_qwen2_moe_family

from fnvllm.model import ModelConfig, load_model
from fnvllm.model.models import MLP
from fnvllm.model.moe import SparseMoeBlock
from fnvllm.model.ops import ops_for
from fnvllm.model.sharding import TensorParallel, check_shardable
from fnvllm.state import InvalidConfigError


@pytest.fixture(scope="module", params=list(QWEN2_MOE_FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, checkpoint folder, transformers' model of it) for each tiny Qwen2-MoE."""
    path = write_qwen2_moe_family(tmp_path_factory.mktemp("qwen2_moe"), request.param)
    return request.param, path, hf_model(path)


def test_config_reads_qwen2_moe(family: tuple[str, Path, Any]) -> None:
    """Qwen2-MoE reads as Qwen2 attention (q/k/v biases, no o_proj bias, no q/k norms) with a MoeConfig carrying the
    shared expert's width, and its sparse layers are transformers' (decoder_sparse_step, mlp_only_layers)."""
    name, path, hf = family
    config = ModelConfig.from_pretrained(path)
    assert config.attention_bias and not config.o_proj_bias and not config.qk_norm
    moe = config.moe
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    assert moe.shared_expert_intermediate_size == 48
    assert moe.norm_topk_prob == QWEN2_MOE_FAMILIES[name]["norm_topk_prob"]
    hf_sparse = [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf.model.layers]
    assert hf_sparse == {"qwen2_moe": [True, True], "qwen2_moe_mixed": [False, False, False, True]}[name]
    assert [config.is_sparse_layer(i) for i in range(config.num_hidden_layers)] == hf_sparse


def test_logits_match_transformers(family: tuple[str, Path, Any]) -> None:
    """Prefill in three chunks, then single-token decodes, through the paged cache, give transformers' logits."""
    _, path, hf = family
    check_chunked_prefill(load_model(path, ModelConfig.from_pretrained(path), "cpu"), hf, block_size=4, seed=1)


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
def test_triton_ops_logits_match_transformers(family: tuple[str, Path, Any]) -> None:
    """With the Triton ops (interpreted on the CPU) the fused-MoE kernel and the shared expert's Triton MLP give
    transformers' logits through a chunked prefill and decodes."""
    _, path, hf = family
    ours = load_model(path, ModelConfig.from_pretrained(path), "cpu", ops=ops_for("triton"))
    tokens = prompt(4, length=12)
    (logits,) = run_schedule(ours, [tokens], [[(0, 5)], [(0, 4)]] + [[(0, 1)]] * 3, block_size=4)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_with_cuda_graphs_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """On a GPU (Triton ops and attention, decode steps replayed from CUDA graphs) fp32 greedy tokens equal
    transformers' under prefix caching."""
    check_prefix_hits(*family, device="cuda")


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
@torch.inference_mode()
def test_sparse_block_equals_transformers_block(family: tuple[str, Path, Any]) -> None:
    """One sparse layer's block (routed experts + sigmoid-gated shared expert) equals transformers'
    Qwen2MoeSparseMoeBlock on the same input; without its shared expert it is off by the shared expert's share."""
    _, path, hf = family
    block = load_model(path, ModelConfig.from_pretrained(path), "cpu").model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and isinstance(block.shared_expert, MLP)
    hf_block = hf.model.layers[0].mlp
    x = torch.randn(1, 23, 64, generator=torch.Generator().manual_seed(3))
    expected = hf_block(x)[0]
    torch.testing.assert_close(block(x[0]), expected, atol=1e-5, rtol=1e-5)
    shared = torch.sigmoid(hf_block.shared_expert_gate(x[0])) * hf_block.shared_expert(x[0])
    assert shared.abs().max() > 0.1  # the shared expert matters, so a wrong gate cannot pass the equalities
    shared_expert, block.shared_expert = block.shared_expert, None
    try:
        torch.testing.assert_close(block(x[0]), expected - shared, atol=1e-5, rtol=1e-5)
    finally:
        block.shared_expert = shared_expert


def test_greedy_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """Greedy tokens through LLM equal transformers' generate for 10 mixed prompts, with prefix-cache hits."""
    check_prefix_hits(*family)


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
@pytest.mark.parametrize("rank", [0, 1])
def test_shared_expert_splits_like_a_dense_mlp(family: tuple[str, Path, Any], rank: int) -> None:
    """At world size 2 a rank holds its half of the shared expert's gate/up rows and down columns (as a dense MLP)
    and its half of every routed expert, while the router and the (1, hidden) shared_expert_gate are whole."""
    path = family[1]
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu", tp=TensorParallel(rank=rank, world_size=2))
    shared_half, expert_half = slice(24 * rank, 24 * rank + 24), slice(16 * rank, 16 * rank + 16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for layer in (0, 1):
            block = model.model.layers[layer].mlp
            assert isinstance(block, SparseMoeBlock) and block.shared_expert is not None
            assert block.shared_expert_gate is not None
            p = f"model.layers.{layer}.mlp."
            gate, up, down = (f.get_tensor(f"{p}shared_expert.{n}_proj.weight") for n in ("gate", "up", "down"))
            assert torch.equal(block.shared_expert.gate_up_proj.weight, torch.cat([gate[shared_half], up[shared_half]]))
            assert torch.equal(block.shared_expert.down_proj.weight, down[:, shared_half])
            assert torch.equal(block.shared_expert_gate.weight, f.get_tensor(p + "shared_expert_gate.weight"))
            assert torch.equal(block.gate.weight, f.get_tensor(p + "gate.weight"))
            assert torch.equal(
                block.experts.down_proj[5], f.get_tensor(p + "experts.5.down_proj.weight")[:, expert_half]
            )


def test_tp2_greedy_equals_tp1(family: tuple[str, Path, Any]) -> None:
    """At tensor_parallel_size=2 (gloo) greedy tokens equal one process's, with prefix-cache hits and preemptions
    (each rank adds its gated partial of the shared expert to its partial of the routed experts; one all-reduce)."""
    check_tp2_greedy(family[1]).close()


def config_dict(**overrides: Any) -> dict[str, Any]:
    """A Qwen1.5-MoE-A2.7B-like config.json as published (no qkv_bias field), shrunk, with ``overrides``."""
    hf = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "vocab_size": 256,
        "max_position_embeddings": 128,
    }
    return {**hf, **overrides}


def test_config_fields_are_checked() -> None:
    """qkv_bias defaults to true and false drops the biases; a missing or non-positive
    shared_expert_intermediate_size and an unsplittable one are errors naming it."""
    assert ModelConfig.from_dict(config_dict()).attention_bias
    assert not ModelConfig.from_dict(config_dict(qkv_bias=False)).attention_bias
    hf = config_dict()
    del hf["shared_expert_intermediate_size"]
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_dict(hf)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be a positive int"):
        ModelConfig.from_dict(config_dict(shared_expert_intermediate_size=0))
    config = ModelConfig.from_dict(config_dict(shared_expert_intermediate_size=50))
    check_shardable(config, 2)
    with pytest.raises(InvalidConfigError, match=r"shared_expert_intermediate_size \(50\) must be a multiple"):
        check_shardable(config, 4)


def test_bench_counts_the_shared_expert(family: tuple[str, Path, Any]) -> None:
    """The bench's weight bytes and FLOPs of a token count every sparse layer's shared expert and its gate: the
    checkpoint's own parameter count of those tensors, once per sparse layer, beyond the same config without one."""
    import attrs

    from fnvllm.bench import flops_per_token, weight_bytes

    config = ModelConfig.from_pretrained(family[1])
    assert config.moe is not None
    no_shared = attrs.evolve(config.moe, shared_expert_intermediate_size=None)
    without = attrs.evolve(config, architecture="Qwen3MoeForCausalLM", moe=no_shared)  # the same, minus it
    shared = 0
    with safe_open(str(family[1] / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if ".shared_expert" in name:
                shared += f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1]
    assert weight_bytes(config, dtype_bytes=2) - weight_bytes(without, dtype_bytes=2) == 2 * shared
    assert flops_per_token(config) - flops_per_token(without) == 2 * shared

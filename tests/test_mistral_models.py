"""Mistral and Mixtral checkpoints: logits and greedy tokens equal transformers' MistralForCausalLM /
MixtralForCausalLM in fp32 (an explicit head_dim, a sliding window longer than the positions, a window shorter than
the sequences: tests/test_sliding_window.py has more), Mixtral's block_sparse_moe tensors land in the shared stacked
experts, tensor parallelism on gloo equals one process, quantization="fp8" applies to Mistral's linears (FP8 Mixtral:
tests/test_fp8_moe.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_llm_equality import check_prefix_hits
from test_model import TOL, check_chunked_prefill, hf_logits, prompt, run_schedule
from test_tp import check_tp2_greedy
from tiny_models import MISTRAL_FAMILIES, hf_model, write_mistral_family

from fnvllm.kernels.reference import route_ref
from fnvllm.llm import LLM
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.config import CheckpointError
from fnvllm.model.loader import checkpoint_files
from fnvllm.model.moe import SparseMoeBlock
from fnvllm.model.sharding import TensorParallel
from fnvllm.state import SamplingParams


@pytest.fixture(scope="module", params=list(MISTRAL_FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, checkpoint folder, transformers' model of it) for each tiny Mistral / Mixtral."""
    path = write_mistral_family(tmp_path_factory.mktemp("mistral"), request.param)
    return request.param, path, hf_model(path)


def test_config_reads_mistral_and_mixtral(family: tuple[str, Path, Any]) -> None:
    """Mistral reads as Llama (explicit head_dim kept, no q/k norms, no biases, its window kept); Mixtral gets a
    MoeConfig with every layer sparse, experts of intermediate_size and the top-k weights renormalised."""
    name, path, _ = family
    config = ModelConfig.from_pretrained(path)
    assert not config.qk_norm and not config.attention_bias and not config.o_proj_bias
    assert config.head_dim == {"mistral": 32, "mistral_window": 16, "mixtral": 16}[name]
    assert config.sliding_window == MISTRAL_FAMILIES[name].get("sliding_window")
    if name == "mixtral":
        assert config.moe is not None and (config.moe.num_experts, config.moe.num_experts_per_tok) == (4, 2)
        assert config.moe.moe_intermediate_size == 96 and config.moe.norm_topk_prob
        assert all(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    else:
        assert config.moe is None


def test_logits_match_transformers(family: tuple[str, Path, Any]) -> None:
    """Prefill in three chunks, then single-token decodes, through the paged cache, give transformers' logits."""
    _, path, hf = family
    check_chunked_prefill(load_model(path, ModelConfig.from_pretrained(path), "cpu"), hf, block_size=4, seed=1)


def test_greedy_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """Greedy tokens through LLM equal transformers' generate for 10 mixed prompts, with prefix-cache hits."""
    check_prefix_hits(*family)


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
@pytest.mark.parametrize("rank", [0, 1])
def test_mixtral_expert_tensors_land_in_the_stacked_experts(family: tuple[str, Path, Any], rank: int) -> None:
    """Mixtral's block_sparse_moe.experts.E.w1 / w3 / w2 are expert E's gate rows, up rows and down columns (this
    rank's half of each at world size 2), and block_sparse_moe.gate is the router."""
    path = family[1]
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu", tp=TensorParallel(rank=rank, world_size=2))
    half = slice(48 * rank, 48 * rank + 48)  # intermediate_size 96 over 2 ranks
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for layer in (0, 1):
            mlp = model.model.layers[layer].mlp
            assert isinstance(mlp, SparseMoeBlock)
            p = f"model.layers.{layer}.block_sparse_moe."
            assert torch.equal(mlp.gate.weight, f.get_tensor(p + "gate.weight"))
            for e in range(4):
                w1, w2, w3 = (f.get_tensor(f"{p}experts.{e}.w{i}.weight") for i in (1, 2, 3))
                assert torch.equal(mlp.experts.gate_up_proj[e], torch.cat([w1[half], w3[half]]))
                assert torch.equal(mlp.experts.down_proj[e], w2[:, half])


def test_mixtral_routing_equals_transformers_router() -> None:
    """route(normalize=True) picks transformers' MixtralTopKRouter's experts and weights (float32 softmax, top-k,
    renormalised)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(17, 32, generator=torch.Generator().manual_seed(1))
    logits, hf_weights, hf_ids = router(x)
    weights, ids = route_ref(logits, 2, normalize=True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["mistral", "mixtral"], indirect=True)
def test_tp2_greedy_equals_tp1(family: tuple[str, Path, Any]) -> None:
    """At tensor_parallel_size=2 (gloo) greedy tokens equal one process's, with prefix-cache hits and preemptions
    (Mistral's single KV head of explicit head_dim is replicated; Mixtral's experts split on intermediate_size)."""
    check_tp2_greedy(family[1]).close()


@pytest.mark.parametrize("family", ["mistral_window"], indirect=True)
def test_window_shorter_than_the_sequence_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """A window of w = 24 tokens loads at any max model length and is attended within: our logits equal
    transformers' at every position of a 40-token prompt, past the 24th too, where its window drops the first
    keys (full attention would differ there)."""
    path = family[1]
    hf = hf_model_with(path, sliding_window=24)
    hf_config = {**json.loads((path / "config.json").read_text()), "sliding_window": 24}
    config = ModelConfig.from_dict(hf_config)
    assert config.sliding_window == 24 and config.layer_window(1) == 24
    ours = load_model(path, config, "cpu")
    tokens = prompt(5, length=40)
    (logits,) = run_schedule(ours, [tokens], [[(0, 9)], [(0, 15)], [(0, 1)], [(0, 15)]], block_size=4)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


def hf_model_with(path: Path, **config: Any) -> Any:
    """transformers' fp32 model of ``path`` with config fields overridden."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **config).eval()


@pytest.mark.parametrize("family", ["mistral_window"], indirect=True)
def test_short_sliding_window_loads(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    """A sliding window shorter than the max model length (by default max_position_embeddings, 2048) loads, at the
    default and at any max_model_len, and an engine built with it generates past the window; a malformed window is
    still a CheckpointError naming the field."""
    hf = json.loads((family[1] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "sliding_window": 8}))
    for max_model_len in (None, 9, 2048):
        config = ModelConfig.from_pretrained(tmp_path, max_model_len=max_model_len)
        assert config.sliding_window == 8 and config.has_sliding_window
    for weights in family[1].glob("*.safetensors"):
        shutil.copy(weights, tmp_path)
    llm = LLM(tmp_path, load_tokenizer=False, dtype="float32", block_size=8, num_blocks=16)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 20
    llm.close()
    (tmp_path / "config.json").write_text(json.dumps({**hf, "sliding_window": "4096"}))
    with pytest.raises(CheckpointError, match=r"sliding_window must be a positive int, got '4096'"):
        ModelConfig.from_pretrained(tmp_path)


def test_fp8_quantizes_mistral_linears(tmp_path: Path) -> None:
    """quantization="fp8" turns a Mistral's decoder linears into e4m3 (the generic FP8 path; 128-row-aligned
    shapes) with logits close to fp32's."""
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=256)
    path = write_mistral_family(tmp_path, "mistral", **shape)
    tokens = prompt(3, length=12)
    logits = {}
    for quantization in (None, "fp8"):
        model = load_model(path, ModelConfig.from_pretrained(path, quantization=quantization), "cpu")
        (logits[quantization],) = run_schedule(model, [tokens], [[(0, 12)]], block_size=4)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    full = logits[None]
    # e4m3 rounds each weight by ~3.6 % RMS; 21 GEMMs (3 layers) compound it to a measured 0.16 of the logits'
    # spread, while a mis-mapped weight gives another model's logits, ~1.4 spreads away
    assert (logits["fp8"] - full).pow(2).mean().sqrt() < 0.25 * full.std()


def test_consolidated_safetensors_are_not_read(tmp_path: Path) -> None:
    """Mistral's own-format consolidated.safetensors beside unindexed shards is skipped; alone, it is named."""
    for name in ("consolidated.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / name).touch()
    assert [f.name for f in checkpoint_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]  # fmt: skip
    for f in tmp_path.glob("model-*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="consolidated"):
        checkpoint_files(tmp_path)

"""Checkpoint config parsing and safetensors loading, including the errors for mismatched checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fnvllm.executor.device_inputs import build_attention_metadata
from fnvllm.model import SUPPORTED_ARCHITECTURES, CheckpointMismatchError, ModelConfig, load_model
from fnvllm.model.config import Llama3RopeScaling
from fnvllm.testing.checkpoints import QWEN3_SHAPES, qwen3_tensor_shapes, write_random_checkpoint, write_tiny_checkpoint


def edit_single_file_checkpoint(path: Path, drop: str | None = None, add: str | None = None) -> None:
    """Rewrite model.safetensors without tensor `drop` and/or with an extra tensor `add`."""
    tensors = load_file(path / "model.safetensors")
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_loads_every_tensor(tmp_path: Path) -> None:
    """A sharded checkpoint loads, with q/k/v and gate/up stacked into the fused parameters."""
    path = write_tiny_checkpoint(tmp_path, "qwen2", shard=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    hf = {}
    for file in path.glob("*.safetensors"):
        hf.update(load_file(file))
    attn = model.model.layers[1].self_attn
    p = "model.layers.1."
    qkv = [hf[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
    torch.testing.assert_close(attn.qkv_proj.weight, torch.cat(qkv), atol=0, rtol=0)
    qkv_bias = [hf[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat(qkv_bias), atol=0, rtol=0)
    gate_up = [hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]]
    torch.testing.assert_close(model.model.layers[1].mlp.gate_up_proj.weight, torch.cat(gate_up), atol=0, rtol=0)
    torch.testing.assert_close(model.lm_head.weight, hf["lm_head.weight"], atol=0, rtol=0)


def test_tied_checkpoint_shares_embedding(tmp_path: Path) -> None:
    """With tie_word_embeddings the LM head is the embedding matrix, and a stored lm_head.weight is tolerated."""
    path = write_tiny_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint lacking a tensor is an error naming that tensor."""
    path = write_tiny_checkpoint(tmp_path, "llama")
    edit_single_file_checkpoint(path, drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(CheckpointMismatchError, match=r"missing tensors \['model\.layers\.1\.self_attn\.k_proj"):
        load_model(path, ModelConfig.from_pretrained(path), "cpu")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint with a tensor the model has no place for is an error naming that tensor."""
    path = write_tiny_checkpoint(tmp_path, "qwen3")
    edit_single_file_checkpoint(path, add="model.layers.0.self_attn.extra_proj.weight")
    with pytest.raises(CheckpointMismatchError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.extra"):
        load_model(path, ModelConfig.from_pretrained(path), "cpu")


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    """A tensor of the wrong shape is an error naming it and both shapes."""
    path = write_tiny_checkpoint(tmp_path, "qwen3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=r"'model\.norm\.weight' has shape \(3,\)"):
        load_model(path, ModelConfig.from_pretrained(path), "cpu")


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    """An unknown architecture is a ValueError naming every supported one."""
    path = write_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_pretrained(path)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_rejected() -> None:
    """A rope type outside SUPPORTED_ROPE_TYPES (mrope, Qwen2-VL's) is a ValueError naming it."""
    config = {**_base_config(), "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(ValueError, match="'mrope' is not supported"):
        ModelConfig.from_dict(config)


def test_both_rope_formats_agree() -> None:
    """transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters) configs give the same ModelConfig."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = {**_base_config(), "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    new = {**_base_config(), "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    config = ModelConfig.from_dict(old)
    assert config == ModelConfig.from_dict(new)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
    plain = ModelConfig.from_dict({**_base_config(), "rope_scaling": None, "rope_theta": 1e6})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)


def test_config_derives_family_flags_and_dtype() -> None:
    """head_dim falls back to hidden/heads, Qwen2 gets q/k/v bias, and the dtype can be overridden."""
    qwen2 = ModelConfig.from_dict({**_base_config(), "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16"})
    assert (qwen2.head_dim, qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (16, True, False, False)
    assert qwen2.dtype == "bfloat16"
    qwen3 = ModelConfig.from_dict({**_base_config(), "architectures": ["Qwen3ForCausalLM"]}, dtype=torch.float16)
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.dtype) == (True, False, "float16")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict({**_base_config(), "num_key_value_heads": 3})


def test_load_with_dtype_override(tmp_path: Path) -> None:
    """load_model's dtype argument casts the weights; the rope table stays float32."""
    path = write_tiny_checkpoint(tmp_path, "qwen3")
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_random_qwen3_checkpoint_loads_and_runs(tmp_path: Path) -> None:
    """A shrunk real-shape Qwen3-0.6B random checkpoint is sharded, parsed with the real shapes, and runs."""
    path = write_random_checkpoint(tmp_path, "qwen3-0.6b", num_layers=2, max_shard_bytes=200 * 1024**2)
    assert (
        len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) == 2 + 2 * 11
    )  # embed, norm, 11 per layer (tied)
    config = ModelConfig.from_pretrained(path)
    expected = (1024, 2, 16, 8, 128, 3072, 151936, True, "bfloat16", 1e6, 40960)
    actual = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads)
    actual += (config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size)
    actual += (config.tie_word_embeddings, config.dtype, config.rope_theta, config.max_position_embeddings)
    assert actual == expected
    model = load_model(path, config, "cpu")
    shape = (2, 16, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))] * 2
    meta = build_attention_metadata([0], [3], [(1,)], 16, "cpu")
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor([1, 2, 3]), meta.positions, caches, meta))
    assert logits.shape == (3, 151936) and logits.isfinite().all()


def test_random_qwen3_8b_shapes_count_8b_parameters() -> None:
    """The Qwen3-8B and 0.6B tensor lists hold the real models' parameter counts."""
    count_8b = sum(math.prod(s) for s in qwen3_tensor_shapes(_random_config("qwen3-8b")).values())
    count_06b = sum(math.prod(s) for s in qwen3_tensor_shapes(_random_config("qwen3-0.6b")).values())
    assert 8.18e9 < count_8b < 8.20e9
    assert 0.59e9 < count_06b < 0.61e9


def _random_config(shape_name: str) -> dict:
    """The config dict write_random_checkpoint would write for `shape_name`."""
    return {"head_dim": 128, "vocab_size": 151936, **QWEN3_SHAPES[shape_name]}


def _base_config() -> dict:
    """A minimal Llama config.json dict."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 2048,
    }

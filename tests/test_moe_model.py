"""Qwen3-MoE's config, layer layout and loader: HF's per-expert tensors land in the stacked expert weights
(this rank's intermediate slice under tensor parallelism), and malformed MoE configs are clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tiny_models import write_family

from fnvllm.model import CheckpointMismatchError, ModelConfig, load_model
from fnvllm.model.config import CheckpointError
from fnvllm.model.moe import SparseMoeBlock
from fnvllm.model.sharding import TensorParallel, check_shardable
from fnvllm.state import InvalidConfigError


def moe_dict(**overrides: Any) -> dict[str, Any]:
    """A Qwen3-30B-A3B-like config.json (published field names), shrunk, with ``overrides``."""
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 256,
        "max_position_embeddings": 128,
    }
    return {**hf, **overrides}


def test_config_reads_both_expert_count_names() -> None:
    """num_experts (published checkpoints) and num_local_experts (transformers 5's save_pretrained) both work;
    Qwen3-MoE has q/k norms."""
    a = ModelConfig.from_dict(moe_dict())
    hf = moe_dict()
    hf["num_local_experts"] = hf.pop("num_experts")
    b = ModelConfig.from_dict(hf)
    assert a == b and a.moe is not None and a.moe.num_experts == 8 and a.qk_norm
    assert ModelConfig.from_dict({**moe_dict(), "architectures": ["Qwen3ForCausalLM"]}).moe is None


def test_sparse_layers_follow_hf_rule() -> None:
    """mlp_only_layers and decoder_sparse_step decide which layers get experts, as in transformers."""
    config = ModelConfig.from_dict(moe_dict(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [config.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    with torch.device("meta"):
        from fnvllm.model import build_model

        model = build_model(config)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [False, True, False, False]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(num_experts=0), "num_experts"),
        (dict(moe_intermediate_size=None), "moe_intermediate_size"),
        (dict(mlp_only_layers="1"), "mlp_only_layers"),
        (dict(norm_topk_prob="true"), "norm_topk_prob"),
    ],
)
def test_bad_moe_fields_name_the_field(overrides: dict[str, Any], message: str) -> None:
    """A missing, mistyped or out-of-range MoE field is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(moe_dict(**overrides))


def test_moe_intermediate_size_must_split_over_ranks() -> None:
    """Tensor parallelism splits each expert's intermediate dim, so it must divide by the world size."""
    config = ModelConfig.from_dict(moe_dict(moe_intermediate_size=30, intermediate_size=96))
    check_shardable(config, 2)
    with pytest.raises(InvalidConfigError, match=r"^EngineConfig\.tensor_parallel_size: moe_intermediate_size \(30\)"):
        check_shardable(config, 4)


@pytest.mark.parametrize("rank", [0, 1])
def test_loader_stacks_experts_and_takes_this_ranks_slice(tmp_path: Path, rank: int) -> None:
    """Expert e's gate/up rows and down columns of this rank's half land in expert e of the stacked weights;
    the router and the dense layer load too."""
    path = write_family(tmp_path, "qwen3_moe")
    config = ModelConfig.from_pretrained(path)
    model = load_model(path, config, "cpu", tp=TensorParallel(rank=rank, world_size=2))
    half = slice(16 * rank, 16 * rank + 16)  # moe_intermediate_size 32 over 2 ranks
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SparseMoeBlock) and not isinstance(model.model.layers[1].mlp, SparseMoeBlock)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for e in range(8):
            p = f"model.layers.0.mlp.experts.{e}."
            gate, up = f.get_tensor(p + "gate_proj.weight"), f.get_tensor(p + "up_proj.weight")
            assert torch.equal(mlp.experts.gate_up_proj[e], torch.cat([gate[half], up[half]]))
            assert torch.equal(mlp.experts.down_proj[e], f.get_tensor(p + "down_proj.weight")[:, half])
        assert torch.equal(mlp.gate.weight, f.get_tensor("model.layers.0.mlp.gate.weight"))


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint lacking one expert's tensor is a CheckpointMismatchError naming it, before anything loads."""
    from safetensors.torch import load_file, save_file

    path = write_family(tmp_path, "qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError, match=r"experts\.5\.up_proj"):
        load_model(path, ModelConfig.from_pretrained(path), "cpu")


def test_bad_moe_field_in_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A MoE config.json with a bad field is a CheckpointError naming the file."""
    (tmp_path / "config.json").write_text(json.dumps(moe_dict(num_experts_per_tok=0)))
    with pytest.raises(CheckpointError, match=r"config\.json.*num_experts_per_tok"):
        ModelConfig.from_pretrained(tmp_path)


def test_random_qwen3_30b_a3b_shapes() -> None:
    """The random Qwen3-30B-A3B tensor list holds the real model's ~30.5B parameters, and a decode step at 256
    sequences reads ~60 GB of bf16 weights (every expert) but one sequence only its 8 experts a layer."""
    from fnvllm.bench import weight_bytes
    from fnvllm.testing.checkpoints import _QWEN3_COMMON, QWEN3_MOE_SHAPES, qwen3_tensor_shapes

    hf = {**_QWEN3_COMMON, **QWEN3_MOE_SHAPES["qwen3-30b-a3b"], "torch_dtype": "bfloat16"}
    assert 30.4e9 < sum(math.prod(s) for s in qwen3_tensor_shapes(hf).values()) < 30.6e9
    config = ModelConfig.from_dict(hf)
    assert weight_bytes(config) == weight_bytes(config, num_seqs=256 * 256)
    assert 60.0e9 < weight_bytes(config, num_seqs=256) < 60.5e9
    expert_bytes = 48 * 3 * 2048 * 768 * 2
    assert weight_bytes(config, num_seqs=1) == pytest.approx(weight_bytes(config) - 120 * expert_bytes, rel=1e-6)


def test_random_writer_names_match_transformers(tmp_path: Path) -> None:
    """The random-checkpoint tensor names and shapes of a MoE config with a dense layer are the ones
    transformers' save_pretrained writes for it."""
    from fnvllm.testing.checkpoints import qwen3_tensor_shapes

    path = write_family(tmp_path, "qwen3_moe")
    hf = json.loads((path / "config.json").read_text())
    hf["num_experts"] = hf.get("num_experts", hf.get("num_local_experts"))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert qwen3_tensor_shapes(hf) == stored


def test_all_experts_reference_equals_sparse_reference() -> None:
    """The capturable every-expert reference computes the sparse reference's result (unchosen experts add 0)."""
    from fnvllm.kernels.reference import fused_moe_all_experts_ref, fused_moe_ref, route_ref

    gen = torch.Generator().manual_seed(0)
    x, w_gate_up = torch.randn(9, 32, generator=gen), torch.randn(6, 40, 32, generator=gen)
    w_down = torch.randn(6, 32, 20, generator=gen)
    weights, ids = route_ref(torch.randn(9, 6, generator=gen), 2, normalize=False)
    torch.testing.assert_close(
        fused_moe_all_experts_ref(x, w_gate_up, w_down, weights, ids),
        fused_moe_ref(x, w_gate_up, w_down, weights, ids),
        rtol=1e-4,
        atol=1e-4,  # GEMMs over all 9 rows vs each expert's rows: another blocking of the same float32 sums
    )

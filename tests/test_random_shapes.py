"""The random benchmark checkpoints of the Qwen2-MoE and Mixtral shapes: names and shapes as transformers writes
them, the published parameter counts, and configs the engine loads."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from tiny_models import write_mistral_family, write_qwen2_moe_family

from fnvllm.model import ModelConfig
from fnvllm.testing.checkpoints import OTHER_SHAPES, tensor_shapes, write_random_checkpoint

WRITERS = {"qwen2_moe": write_qwen2_moe_family, "mixtral": write_mistral_family}


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every safetensors file in ``folder``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})  # noqa: SIM118
    return shapes


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_random_layout_is_what_transformers_saves(tmp_path: Path, family: str) -> None:
    """tensor_shapes of a tiny config equals the names and shapes transformers' save_pretrained writes for it."""
    folder = WRITERS[family](tmp_path, family)
    hf = json.loads((folder / "config.json").read_text())
    assert tensor_shapes(hf) == stored_shapes(folder)


@pytest.mark.parametrize(
    ("shape", "total", "active"),
    [("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],
)
def test_published_parameter_counts(shape: str, total: float, active: float) -> None:
    """The shapes hold the published total and active parameter counts (the names' 14.3B / 2.7B and 46.7B / 12.9B;
    active: all but the routed experts, plus top-k of each layer's experts, embeddings included as both count)."""
    hf: dict[str, Any] = dict(OTHER_SHAPES[shape])
    shapes = tensor_shapes(hf)
    assert sum(math.prod(s) for s in shapes.values()) == pytest.approx(total, abs=0.05e9)
    experts = hf.get("num_experts") or hf["num_local_experts"]
    routed = sum(math.prod(s) for name, s in shapes.items() if ".experts." in name)
    rest = sum(math.prod(s) for name, s in shapes.items() if ".experts." not in name)
    assert rest + routed * hf["num_experts_per_tok"] / experts == pytest.approx(active, abs=0.05e9)


@pytest.mark.parametrize("shape", list(OTHER_SHAPES))
def test_shape_config_loads(tmp_path: Path, shape: str) -> None:
    """The written config.json (config_only, as the bench's dummy load writes it) loads as the family's model with
    the published expert counts, and no tensor is written."""
    folder = write_random_checkpoint(tmp_path / shape, shape, config_only=True)  # type: ignore[arg-type]
    config = ModelConfig.from_pretrained(folder)
    hf = OTHER_SHAPES[shape]
    assert config.architecture == hf["architectures"][0]
    assert config.num_hidden_layers == hf["num_hidden_layers"]
    assert config.moe is not None
    assert config.moe.num_experts == (hf.get("num_experts") or hf["num_local_experts"])
    assert config.moe.shared_expert_intermediate_size == hf.get("shared_expert_intermediate_size")
    assert not list(folder.glob("*.safetensors"))

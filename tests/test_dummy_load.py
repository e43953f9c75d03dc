"""load_format="dummy": models built from config.json alone with seeded random weights (no safetensors), through
the loader, the LLM, FP8 quantization, the bench's config-only folders and its CLI defaults."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from fnvllm.bench import run_bench, weight_bytes
from fnvllm.cli.bench import resolve_workload
from fnvllm.config import EngineConfig
from fnvllm.llm import LLM
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.loader import DUMMY_STD, build_on_meta
from fnvllm.model.ops import TORCH_OPS
from fnvllm.model.sharding import SINGLE, TensorParallel
from fnvllm.state import InvalidConfigError, SamplingParams
from fnvllm.testing.checkpoints import write_random_checkpoint, write_tiny_checkpoint

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
# (family, write_tiny_checkpoint options): a tied dense Qwen3, a Qwen2 with q/k/v biases, a Qwen3-MoE
FAMILIES = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),
    "qwen3_moe": ("qwen3_moe", dict(moe=MOE)),
}
OPTIONS = dict(device="cpu", load_tokenizer=False, block_size=4, num_blocks=64, max_num_seqs=4, dtype="float32")
# FP8 needs 128-multiples in every linear (as test_fp8_weights.py's shape)
FP8_SHAPE = dict(hidden_size=320, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, vocab_size=256)


def folders(root: Path, name: str, **extra: object) -> tuple[Path, Path]:
    """(a full tiny checkpoint, a config-only folder) of FAMILIES[name]."""
    family, options = FAMILIES[name]
    options = {**options, **extra}
    full = write_tiny_checkpoint(root / f"{name}-full", family, **options)
    return full, write_tiny_checkpoint(root / f"{name}-config", family, config_only=True, **options)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_dummy_weights_have_the_checkpoint_models_names_shapes_and_dtypes(tmp_path: Path, name: str) -> None:
    """A dummy-loaded model (from a folder holding config.json only) has exactly the parameters, shapes and dtypes
    of the same config loaded from its checkpoint, and finite logits."""
    full, config_only = folders(tmp_path, name)
    assert not list(config_only.glob("*.safetensors"))
    loaded = load_model(full, ModelConfig.from_pretrained(full), "cpu")
    dummy = load_model(config_only, ModelConfig.from_pretrained(config_only), "cpu", load_format="dummy")
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in loaded.named_parameters()}
    assert {n: (tuple(p.shape), p.dtype) for n, p in dummy.named_parameters()} == shapes
    assert not dummy.training and not any(p.requires_grad for p in dummy.parameters())


def test_dummy_values_norms_one_matrices_small_and_seeded(tmp_path: Path) -> None:
    """Norm weights are 1, biases 0, matrices N(0, 0.02); the same seed gives the same weights, another seed
    different ones."""
    _, folder = folders(tmp_path, "qwen2")
    config = ModelConfig.from_pretrained(folder)
    a, b = (load_model(folder, config, "cpu", load_format="dummy", seed=s) for s in (0, 0))
    c = load_model(folder, config, "cpu", load_format="dummy", seed=1)
    params_a, params_b, params_c = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
    for name, p in params_a.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.float().std().item() - DUMMY_STD) < 0.2 * DUMMY_STD, name
            assert not torch.equal(p, params_c[name]), name


def test_dummy_replicated_parameters_equal_on_every_rank(tmp_path: Path) -> None:
    """Under tensor parallelism (two ranks built in one process) the replicated parameters, the router first,
    get the same dummy values on both ranks (so both route alike), while a sharded one is each rank's slice."""
    _, folder = folders(tmp_path, "qwen3_moe")
    config = ModelConfig.from_pretrained(folder)
    ranks = [
        dict(load_model(folder, config, "cpu", tp=TensorParallel(rank, 2), load_format="dummy").named_parameters())
        for rank in (0, 1)
    ]
    routers = [n for n in ranks[0] if n.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(ranks[0][n], ranks[1][n]) for n in routers)
    gate_up = next(n for n in ranks[0] if n.endswith("experts.gate_up_proj"))
    assert ranks[0][gate_up].shape[1] == 2 * MOE["moe_intermediate_size"] // 2


def test_dummy_llm_generates_without_weight_files(tmp_path: Path) -> None:
    """LLM(load_format="dummy") on a config-only Qwen3-MoE folder generates the requested tokens; the default
    load format on the same folder fails, naming the missing safetensors."""
    _, folder = folders(tmp_path, "qwen3_moe")
    llm = LLM(folder, load_format="dummy", **OPTIONS)
    out = llm.generate([[5, 6, 7], [9] * 10], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(folder, **OPTIONS)


def test_dummy_with_fp8_quantization(tmp_path: Path) -> None:
    """quantization="fp8" on dummy weights gives e4m3 linears with their block scales, shaped as quantizing the
    checkpoint gives, and an LLM that generates."""
    family, _ = FAMILIES["qwen3"]
    full = write_tiny_checkpoint(tmp_path / "full", family, **FP8_SHAPE)
    folder = write_tiny_checkpoint(tmp_path / "config", family, config_only=True, **FP8_SHAPE)
    loaded = load_model(full, ModelConfig.from_pretrained(full, quantization="fp8"), "cpu")
    dummy = load_model(folder, ModelConfig.from_pretrained(folder, quantization="fp8"), "cpu", load_format="dummy")
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in loaded.named_parameters()}
    assert {n: (tuple(p.shape), p.dtype) for n, p in dummy.named_parameters()} == shapes
    assert any(p.dtype == torch.float8_e4m3fn for p in dummy.parameters())
    scales = [p for n, p in dummy.named_parameters() if n.endswith("weight_scale_inv")]
    assert scales and all(bool((s > 0).all()) and bool(torch.isfinite(s).all()) for s in scales)
    llm = LLM(folder, load_format="dummy", quantization="fp8", **OPTIONS)
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_load_format_option_checked(tmp_path: Path) -> None:
    """EngineConfig.load_format takes "auto" and "dummy" only, and names the field otherwise; so does load_model."""
    assert EngineConfig(load_format="dummy").load_format == "dummy"
    with pytest.raises(InvalidConfigError, match="load_format"):
        EngineConfig(load_format="safetensors")
    folder = write_tiny_checkpoint(tmp_path, "qwen3", config_only=True)
    with pytest.raises(ValueError, match="load_format"):
        load_model(folder, ModelConfig.from_pretrained(folder), "cpu", load_format="pt")


def test_qwen3_30b_a3b_config_only_sizes(tmp_path: Path) -> None:
    """The qwen3-30b-a3b config-only folder holds two json files (no 61 GB of shards) and its model, built on the
    meta device, has ~61 GB of bf16 parameters: room left for the KV cache in 0.9 of an H200's 139.8 GiB."""
    folder = write_random_checkpoint(tmp_path, "qwen3-30b-a3b", config_only=True)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json"]
    config = ModelConfig.from_pretrained(folder)
    model = build_on_meta(config, TORCH_OPS, SINGLE)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 60e9 < nbytes < 62e9
    assert nbytes < 0.9 * 139.8 * 1024**3 - 20 * 1024**3  # 20 GiB and more left for activations and the cache
    assert 55e9 < weight_bytes(config) < nbytes  # a decode step of 256 sequences reads all experts, not the embedding


def test_bench_defaults_dummy_for_qwen3_30b_a3b_only() -> None:
    """fnvllm bench: qwen3-30b-a3b without --model runs with dummy weights by default; other shapes, a --model
    folder, or an explicit --load-format keep what they get."""

    def resolved(shape: str, model: str | None = None, load_format: str | None = None) -> str:
        args = argparse.Namespace(model=model, model_shape=shape, ec_load_format=load_format)
        args.num_requests = args.max_input_len = args.max_output_len = args.ec_block_size = None
        resolve_workload(args)
        return args.ec_load_format

    assert resolved("qwen3-30b-a3b") == "dummy"
    assert resolved("qwen3-30b-a3b", load_format="auto") == "auto"
    assert resolved("qwen3-30b-a3b", model="/some/folder") == "auto"
    assert resolved("qwen3-0.6b") == "auto"
    assert resolved("tiny", load_format="dummy") == "dummy"


def test_bench_tiny_moe_dummy_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """run_bench on the tiny MoE shape with dummy weights: the whole workload runs on the CPU and the stderr line
    says the weights are dummy."""
    result = run_bench(
        None, "tiny-moe", 2, 100, 100, progress_every_s=60.0, load_format="dummy", device="cpu", num_blocks=128
    )
    assert result["model"] == "tiny-moe" and result["requests"] == 2 and result["output_tokens"] == 200
    assert "dummy weights" in capsys.readouterr().err


def test_tiny_config_only_equals_full_config(tmp_path: Path) -> None:
    """write_tiny_checkpoint(config_only=True) writes the same config.json as the full checkpoint's."""
    full, config_only = folders(tmp_path, "qwen3_moe")
    assert json.loads((full / "config.json").read_text()) == json.loads((config_only / "config.json").read_text())

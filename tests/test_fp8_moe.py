"""FP8 weights for mixtures of experts: official block-quantized Qwen3-MoE / Qwen2-MoE checkpoints load with their
experts in e4m3 and give the logits and greedy tokens of the same model built from their dequantized weights (torch
reference and the fused Triton kernel, interpreted); quantization="fp8" on a float32 Qwen3-MoE or Mixtral checkpoint
quantizes every expert in 128-row groups and equals the model of those dequantized weights; TP=2 (gloo) equals one
process; misaligned shards and unconverted linears are refused by name. The kernel itself: tests/test_moe_kernel.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fp8_weights import GREEDY, OPTIONS, PROMPTS, model_logits, prefill_logits
from tiny_models import write_mistral_family, write_qwen2_moe_family

from fnvllm.llm import LLM
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.config import CheckpointError
from fnvllm.model.loader import build_on_meta, checkpoint_files
from fnvllm.model.ops import TORCH_OPS
from fnvllm.model.quant import dequantize_fp8_blocks, quantize_fp8_row_groups
from fnvllm.model.sharding import TensorParallel
from fnvllm.testing.checkpoints import (
    is_fp8_linear,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
    write_tiny_checkpoint,
)

# head_dim 128 and widths of 256 keep every fused part and every TP=2 shard on 128-row scale blocks (as real models:
# Qwen3-30B-A3B's experts are 768 wide); hidden 320 ends the experts' K (gate/up) and N (down) on a partial block.
# Layer 0 is sparse (8 experts, top-2), layer 1 a dense MLP (mlp_only_layers), which takes the dense FP8 path.
SHAPE: dict[str, Any] = dict(
    hidden_size=320, num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=256, vocab_size=256, num_layers=2
)
MOE: dict[str, Any] = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[1]
)


def greedy(path: Path, **options: Any) -> list[tuple[int, ...]]:
    """Greedy token ids of PROMPTS through LLM (``options`` over test_fp8_weights' CPU OPTIONS)."""
    llm = LLM(path, **{**OPTIONS, **options})
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


def not_converted(num_layers: int) -> list[str]:
    """The ``modules_to_not_convert`` of Qwen3-30B-A3B-FP8's config.json, for ``num_layers`` layers: lm_head and each
    layer's norms and router (mlp.gate)."""
    per_layer = ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    return ["lm_head"] + [f"model.layers.{i}.{name}" for i in range(num_layers) for name in per_layer]


def write_official_fp8(src: Path, dst: Path) -> Path:
    """``src`` in the official FP8 layout (``write_fp8_checkpoint``: decoder linears and experts in e4m3 with
    128 x 128 block scales, routers and shared_expert_gate untouched), its config listing the unconverted modules
    as Qwen's checkpoints do."""
    path = write_fp8_checkpoint(src, dst)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = not_converted(config["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_row_group_reference(src: Path, dst: Path) -> Path:
    """The float32 checkpoint whose decoder linears (experts included) are ``src``'s quantized in 128-row groups and
    dequantized: the weights quantization="fp8" must compute with (each part of a fused layer, and each expert's
    gate, up and down, starts a row group, so quantizing the whole tensor gives the loader's groups)."""
    dst.mkdir(parents=True)
    tensors = {}
    for file in checkpoint_files(src):
        for name, t in load_file(str(file)).items():
            quantized = is_fp8_linear(name) or name.split(".")[-2] in ("w1", "w2", "w3")  # Mixtral's experts
            tensors[name] = dequantize_fp8_blocks(*quantize_fp8_row_groups(t), torch.float32) if quantized else t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for file in src.iterdir():
        if file.suffix == ".json":
            (dst / file.name).write_text(file.read_text())
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny fp32 Qwen3-MoE, its official-layout FP8 copy, that copy's dequantized fp32 checkpoint, and the fp32
    checkpoint of its weights quantized in row groups and dequantized."""
    root = tmp_path_factory.mktemp("fp8_moe")
    src = write_tiny_checkpoint(root / "src", "qwen3_moe", moe=MOE, **SHAPE)
    fp8 = write_official_fp8(src, root / "fp8")
    return {
        "src": src,
        "fp8": fp8,
        "dequantized": write_dequantized_checkpoint(fp8, root / "dequantized"),
        "row_groups": write_row_group_reference(src, root / "row_groups"),
    }


# ---- official FP8 checkpoints ---------------------------------------------------------------------------------


def test_fp8_moe_checkpoint_matches_dequantized_reference(checkpoints: dict[str, Path]) -> None:
    """An official FP8 Qwen3-MoE checkpoint (its modules_to_not_convert listing the norms and routers) keeps its experts
    and linears in e4m3 with per-expert block scales, its router in float32, and gives the logits and greedy tokens of
    the float32 model of its dequantized weights. Both compute with the same float32 weights (e4m3 times its scale,
    rounded once to float32, by the loader's reference and by the dequantized checkpoint alike), so only the order of
    float32 sums may differ: 1e-5."""
    config = ModelConfig.from_pretrained(checkpoints["fp8"])
    assert config.quantization is not None and config.quantization.is_checkpoint_fp8
    model = load_model(checkpoints["fp8"], config, "cpu")
    sparse, dense = model.model.layers[0].mlp, model.model.layers[1].mlp
    experts = sparse.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert tuple(experts.gate_up_proj_scale_inv.shape) == (8, 4, 3)  # (E, 512 / 128, ceil(320 / 128))
    assert tuple(experts.down_proj_scale_inv.shape) == (8, 3, 2)  # (E, ceil(320 / 128), 256 / 128)
    assert sparse.gate.weight.dtype == torch.float32 and dense.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    ours, reference = prefill_logits(checkpoints["fp8"]), prefill_logits(checkpoints["dequantized"])
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert greedy(checkpoints["fp8"]) == greedy(checkpoints["dequantized"])


def test_fp8_moe_checkpoint_through_the_triton_kernel(checkpoints: dict[str, Path]) -> None:
    """With the fused-MoE Triton kernel as the model's MoE op (interpreted on the CPU; the other ops torch), the FP8
    experts' logits are the dequantized float32 model's: the kernel dequantizes each e4m3 tile with its block scale
    in float32, as the checkpoint's dequantization does; its float32 sums run in another order (measured 7e-6 of
    logits spread 1.8), hence 1e-4."""
    pytest.importorskip("triton")
    from fnvllm.kernels.fused_moe import fused_moe

    config = ModelConfig.from_pretrained(checkpoints["fp8"])
    ops = attrs.evolve(TORCH_OPS, name="torch+fused_moe", fused_moe=fused_moe)
    ours = model_logits(load_model(checkpoints["fp8"], config, "cpu", ops=ops), config)
    torch.testing.assert_close(ours, prefill_logits(checkpoints["dequantized"]), atol=1e-4, rtol=1e-4)


def test_qwen2_moe_fp8_checkpoint_matches_dequantized_reference(tmp_path: Path) -> None:
    """A Qwen2-MoE FP8 checkpoint: the routed experts are e4m3 with block scales, the shared expert is a dense FP8 MLP
    (gate_up / down with weight_scale_inv), its sigmoid gate and the router stay float32, and the logits are the
    dequantized model's (1e-5: the same float32 weights, as above)."""
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256)
    experts = dict(moe_intermediate_size=128, shared_expert_intermediate_size=256)
    src = write_qwen2_moe_family(tmp_path, "qwen2_moe", **shape, **experts)
    fp8 = write_official_fp8(src, tmp_path / "fp8")
    model = load_model(fp8, ModelConfig.from_pretrained(fp8), "cpu")
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert block.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert block.shared_expert.down_proj.weight_scale_inv is not None
    assert block.shared_expert_gate.weight.dtype == block.gate.weight.dtype == torch.float32
    reference = prefill_logits(write_dequantized_checkpoint(fp8, tmp_path / "deq"))
    torch.testing.assert_close(prefill_logits(fp8), reference, atol=1e-5, rtol=1e-5)


# ---- quantized at load ------------------------------------------------------------------------------------------


def test_quantize_at_load_quantizes_each_expert_in_row_groups(checkpoints: dict[str, Path]) -> None:
    """quantization="fp8" on a float32 MoE checkpoint writes each expert's gate, up and down as
    quantize_fp8_row_groups makes them from the stored tensors (e4m3 bytes and scales), into its slot."""
    config = ModelConfig.from_pretrained(checkpoints["src"], quantization="fp8")
    experts = load_model(checkpoints["src"], config, "cpu").model.layers[0].mlp.experts
    stored = load_file(str(checkpoints["src"] / "model.safetensors"))
    for e in (0, 5):
        p = f"model.layers.0.mlp.experts.{e}."
        gate_up = torch.cat([stored[p + "gate_proj.weight"], stored[p + "up_proj.weight"]])
        for ours, scale, weight in (
            (experts.gate_up_proj[e], experts.gate_up_proj_scale_inv[e], gate_up),
            (experts.down_proj[e], experts.down_proj_scale_inv[e], stored[p + "down_proj.weight"]),
        ):
            q, s = quantize_fp8_row_groups(weight)
            assert torch.equal(ours.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)


def test_quantize_at_load_equals_its_dequantized_model_and_stays_close(checkpoints: dict[str, Path]) -> None:
    """quantization="fp8" gives the logits (1e-5, as above) and greedy tokens of the float32 model of its own
    dequantized weights; against the unquantized model, in bf16, its logits' RMS error is within 1.25x of the
    official 128 x 128 block layout's (row groups are coarser; measured 1.10x) and under 0.3 of the logits' spread
    (measured 0.20: e4m3 rounds each weight by ~3.6 % RMS, and this random model's GEMMs and its routing, which the
    error can flip, compound it)."""
    torch.testing.assert_close(
        prefill_logits(checkpoints["src"], "fp8"), prefill_logits(checkpoints["row_groups"]), atol=1e-5, rtol=1e-5
    )
    assert greedy(checkpoints["src"], quantization="fp8") == greedy(checkpoints["row_groups"])
    full = prefill_logits(checkpoints["src"], dtype="bfloat16")
    on_load = prefill_logits(checkpoints["src"], "fp8", "bfloat16")
    blocks = prefill_logits(checkpoints["dequantized"], dtype="bfloat16")
    rms = (on_load - full).pow(2).mean().sqrt()
    assert rms < 1.25 * (blocks - full).pow(2).mean().sqrt()
    assert rms < 0.3 * full.std()


def test_mixtral_quantized_at_load(tmp_path: Path) -> None:
    """Mixtral's experts (w1 / w3 / w2) quantize at load too and give the model of their row-group-dequantized
    weights."""
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=128)
    src = write_mistral_family(tmp_path, "mixtral", **shape)
    config = ModelConfig.from_pretrained(src, quantization="fp8")
    assert load_model(src, config, "cpu").model.layers[1].mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    reference = write_row_group_reference(src, tmp_path / "row_groups")
    torch.testing.assert_close(prefill_logits(src, "fp8"), prefill_logits(reference), atol=1e-5, rtol=1e-5)


def test_dummy_weights_fill_fp8_experts(checkpoints: dict[str, Path]) -> None:
    """load_format="dummy" with quantization="fp8" fills every expert with an e4m3 matrix and its 128-row-group
    scales (equal along each row block), and the forward is finite."""
    config = ModelConfig.from_pretrained(checkpoints["src"], quantization="fp8")
    model = load_model(checkpoints["src"], config, "cpu", load_format="dummy")
    experts = model.model.layers[0].mlp.experts
    for scale in (experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv):
        assert (scale > 0).all() and torch.equal(scale, scale[:, :, :1].expand_as(scale))
    assert torch.isfinite(experts.gate_up_proj.float()).all()
    assert torch.isfinite(model_logits(model, config)).all()


# ---- tensor parallelism -----------------------------------------------------------------------------------------


def scored(path: Path, **options: Any) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """(greedy token ids, float64 log-probabilities of those tokens) of PROMPTS through LLM."""
    llm = LLM(path, **{**OPTIONS, **options})
    try:
        outs = llm.generate(PROMPTS, attrs.evolve(GREEDY, logprobs=0), use_tqdm=False)
    finally:
        llm.close()
    logprobs = [entry.logprob for o in outs for entry in o.logprobs or ()]
    return [o.token_ids for o in outs], torch.tensor(logprobs, dtype=torch.float64)


def test_tp2_fp8_moe_equals_tp1(checkpoints: dict[str, Path]) -> None:
    """At tensor_parallel_size=2 (gloo) each rank loads its 128-block slice of every expert and of its scales (or
    quantizes its slice, down's row-group scales joined over the ranks so that they are the whole rows'), and the
    greedy tokens and their log-probabilities are one process's: the same float32 weights, partial sums added in
    another order (1e-4; an expert quantized with its rank's own scales moves them by ~1e-2)."""
    for path, options in ((checkpoints["fp8"], {}), (checkpoints["src"], {"quantization": "fp8"})):
        tokens, logprobs = scored(path, **options)
        tp_tokens, tp_logprobs = scored(path, tensor_parallel_size=2, **options)
        assert tp_tokens == tokens
        torch.testing.assert_close(tp_logprobs, logprobs, atol=1e-4, rtol=0)


# ---- refused ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_expert_shard_off_the_scale_blocks_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path, quantization: str | None
) -> None:
    """Experts 128 wide split over 2 ranks (64 rows each: the up rows would start mid-block) are a ValueError naming
    moe_intermediate_size, from an FP8 checkpoint or quantized at load, before any tensor is read."""
    path = checkpoints["fp8"] if quantization is None else checkpoints["src"]
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 128}))
    narrow = ModelConfig.from_pretrained(tmp_path, quantization=quantization)
    build_on_meta(narrow)  # one rank: 128 rows, whole blocks
    with pytest.raises(ValueError, match=r"moe_intermediate_size 128, 64 per rank.*tensor_parallel_size"):
        build_on_meta(narrow, tp=TensorParallel(rank=1, world_size=2))


def test_unconverted_expert_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A modules_to_not_convert that lists an expert's projection (not a norm, router or lm_head) is a
    CheckpointError naming the field."""
    config = json.loads((checkpoints["fp8"] / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.experts.3.down_proj")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"modules_to_not_convert .*experts\.3\.down_proj"):
        ModelConfig.from_pretrained(tmp_path)


# ---- on a GPU ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_fp8_moe_on_cuda_graphs_equal_eager(checkpoints: dict[str, Path]) -> None:
    """On CUDA (bf16, Triton ops: the fused-MoE kernel on e4m3 experts) the FP8 MoE checkpoint's greedy tokens are
    the same with decode CUDA graphs as eagerly (the FP8 expert kernels capture and replay), and so are those of the
    float32 checkpoint quantized at load. Numerics against the reference: tests/test_moe_kernel.py's GPU tests."""
    options = dict(device="cuda", dtype="bfloat16", model_ops="triton", attention_backend="auto", block_size=16)
    for path, quantization in ((checkpoints["fp8"], None), (checkpoints["src"], "fp8")):
        runs = [greedy(path, quantization=quantization, enforce_eager=eager, **options) for eager in (False, True)]
        assert runs[0] == runs[1]

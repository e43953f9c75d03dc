"""Phi-3 checkpoints (Phi3ForCausalLM): the fused qkv_proj / gate_up_proj tensors split into our q/k/v and gate/up
rows (each rank its slice of q, of k and of v), logits and greedy tokens equal transformers' Phi3ForCausalLM in fp32
(GQA with an untied head; a tied head with a sliding window shorter than the prompts; longrope within
original_max_position_embeddings), tensor parallelism on gloo equals one process, longrope's frequencies and
attention factor equal transformers', and the config refusals name their fields."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_llm_equality import check_prefix_hits
from test_model import TOL, check_chunked_prefill, hf_logits, prompt, run_schedule
from test_tp import check_tp2_greedy
from tiny_models import PHI3_FAMILIES, hf_model, write_phi3_family

from fnvllm.llm import LLM
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.config import CheckpointError
from fnvllm.model.layers import rope_inv_freq
from fnvllm.model.loader import CheckpointMismatchError
from fnvllm.model.rope import LongRopeScaling
from fnvllm.model.sharding import TensorParallel


@pytest.fixture(scope="module", params=list(PHI3_FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, checkpoint folder, transformers' model of it) for each tiny Phi-3."""
    path = write_phi3_family(tmp_path_factory.mktemp("phi3"), request.param)
    return request.param, path, hf_model(path)


def test_config_reads_phi3(family: tuple[str, Path, Any]) -> None:
    """Phi-3 reads as Llama (no biases, no q/k norms, its eps, tie and window kept); longrope keeps the top-level
    original_max_position_embeddings, which is also the longest sequence served (less than max_position_embeddings)."""
    name, path, _ = family
    config = ModelConfig.from_pretrained(path)
    assert not config.qk_norm and not config.attention_bias and not config.o_proj_bias and config.moe is None
    assert config.rms_norm_eps == 1e-5 and config.head_dim == 16
    assert config.tie_word_embeddings == (name == "phi3_window")
    assert config.sliding_window == PHI3_FAMILIES[name].get("sliding_window")
    assert config.sliding_layers == (tuple(range(3)) if name == "phi3_window" else ())
    if name == "phi3_longrope":
        assert isinstance(config.rope_scaling, LongRopeScaling)
        assert config.rope_scaling.original_max_position_embeddings == 128 and config.max_seq_len == 128
    else:
        assert config.rope_scaling is None and config.max_seq_len == 2048


def test_defaults_and_biases_follow_transformers() -> None:
    """Without rms_norm_eps a Phi-3 takes Phi3Config's default; an attention_bias in config.json builds no bias, as
    transformers' Phi3Attention hard-codes none."""
    import transformers

    assert ModelConfig.from_dict(_phi3_config()).rms_norm_eps == transformers.Phi3Config().rms_norm_eps
    config = ModelConfig.from_dict(_phi3_config(attention_bias=True))
    shape = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32, vocab_size=32)
    hf_config = transformers.Phi3Config(**shape, attention_bias=True, pad_token_id=0, eos_token_id=1)
    hf = transformers.Phi3ForCausalLM(hf_config)
    assert not config.attention_bias and not config.o_proj_bias and hf.model.layers[0].self_attn.qkv_proj.bias is None


def test_logits_match_transformers(family: tuple[str, Path, Any]) -> None:
    """Prefill in three chunks, then single-token decodes, through the paged cache, give transformers' logits."""
    _, path, hf = family
    check_chunked_prefill(load_model(path, ModelConfig.from_pretrained(path), "cpu"), hf, block_size=4, seed=1)


def test_greedy_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """Greedy tokens through LLM equal transformers' generate for 10 mixed prompts (up to 70 tokens: past
    phi3_window's 24-token window, within phi3_longrope's 128), with prefix-cache hits."""
    check_prefix_hits(*family)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_with_cuda_graphs_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """On a GPU (Triton ops and attention, decode steps replayed from CUDA graphs) fp32 greedy tokens equal
    transformers' under prefix caching."""
    check_prefix_hits(*family, device="cuda")


@pytest.mark.parametrize("family", ["phi3_window"], indirect=True)
def test_window_drops_keys_as_transformers_does(family: tuple[str, Path, Any]) -> None:
    """Every position of a 40-token prompt, past the 24-token window too, gives transformers' logits; full attention
    would not (so the window is applied, on every layer)."""
    _, path, hf = family
    tokens = prompt(5, length=40)
    schedule = [[(0, 9)], [(0, 15)], [(0, 1)], [(0, 15)]]
    (logits,) = run_schedule(load_model(path, ModelConfig.from_pretrained(path), "cpu"), [tokens], schedule, 4)
    expected = hf_logits(hf, tokens)
    torch.testing.assert_close(logits, expected, **TOL)
    config = ModelConfig.from_dict({**json.loads((path / "config.json").read_text()), "sliding_window": None})
    (full,) = run_schedule(load_model(path, config, "cpu"), [tokens], schedule, 4)
    assert not torch.allclose(full[24:], expected[24:], **TOL)


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
@pytest.mark.parametrize("rank", [0, 1])
def test_fused_tensors_split_per_rank(family: tuple[str, Path, Any], rank: int) -> None:
    """At world size 2 a rank's qkv rows are its q heads' rows, then its KV head's k rows and v rows, each read
    from its own part of the stacked qkv_proj; its gate/up rows are its halves of the gate part and of the up part."""
    path = family[1]
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu", tp=TensorParallel(rank=rank, world_size=2))
    q_size, kv_size, inter = 64, 32, 96  # 4 heads x 16, 2 KV heads x 16
    q = slice(32 * rank, 32 * rank + 32)  # 2 q heads per rank
    kv = slice(16 * rank, 16 * rank + 16)  # 1 KV head per rank
    half = slice(48 * rank, 48 * rank + 48)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for i, layer in enumerate(model.model.layers):
            qkv = f.get_tensor(f"model.layers.{i}.self_attn.qkv_proj.weight")
            wq, wk, wv = qkv.split([q_size, kv_size, kv_size])
            assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([wq[q], wk[kv], wv[kv]]))
            gate, up = f.get_tensor(f"model.layers.{i}.mlp.gate_up_proj.weight").split([inter, inter])
            assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[half], up[half]]))


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
def test_tp2_greedy_equals_tp1(family: tuple[str, Path, Any]) -> None:
    """At tensor_parallel_size=2 (gloo) greedy tokens equal one process's, with prefix-cache hits and preemptions
    (each rank reads its q heads and its KV head out of every fused qkv_proj)."""
    check_tp2_greedy(family[1]).close()


def _copy_with(source: Path, dest: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """``source``'s config.json beside ``tensors`` as model.safetensors, in ``dest``."""
    dest.mkdir()
    shutil.copy(source / "config.json", dest)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
def test_missing_unfused_and_misshapen_tensors_are_named(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    """A Phi-3 checkpoint is read by its fused names: one missing qkv_proj is named, separate q/k/v tensors are
    unexpected (and the fused one missing), a fused tensor of the wrong height is named with both shapes."""
    path = family[1]
    config = ModelConfig.from_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    missing = _copy_with(path, tmp_path / "missing", {k: v for k, v in tensors.items() if k != qkv})
    with pytest.raises(CheckpointMismatchError, match=rf"missing tensors \['{qkv}'\]; unexpected tensors none"):
        load_model(missing, config, "cpu")
    split = {k: v for k, v in tensors.items() if k != qkv}
    prefix = "model.layers.1.self_attn."
    split.update(zip([f"{prefix}{p}_proj.weight" for p in "qkv"], tensors[qkv].split([64, 32, 32]), strict=True))
    with pytest.raises(CheckpointMismatchError, match=r"missing tensors \[.*qkv_proj.*unexpected.*k_proj.*q_proj"):
        load_model(_copy_with(path, tmp_path / "split", split), config, "cpu")
    short = {**tensors, qkv: tensors[qkv][:-16]}
    with pytest.raises(CheckpointMismatchError, match=r"qkv_proj.weight' has shape \(112, 64\).*\(128, 64\)"):
        load_model(_copy_with(path, tmp_path / "short", short), config, "cpu")


def test_fp8_quantizes_phi3_fused_linears(tmp_path: Path) -> None:
    """quantization="fp8" turns a Phi-3's qkv and gate/up (read from its fused tensors) into e4m3 with logits close
    to fp32's (128-row-aligned shapes); an FP8 checkpoint of it is refused by name."""
    shape = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    path = write_phi3_family(tmp_path, "phi3", **shape)
    tokens = prompt(3, length=12)
    logits = {}
    for quantization in (None, "fp8"):
        model = load_model(path, ModelConfig.from_pretrained(path, quantization=quantization), "cpu")
        (logits[quantization],) = run_schedule(model, [tokens], [[(0, 12)]], block_size=4)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    full = logits[None]
    # as test_mistral_models' FP8 check: e4m3 rounding moves the logits by a fraction of their spread, a mis-split
    # fused tensor (another model) by more than their spread
    assert (logits["fp8"] - full).pow(2).mean().sqrt() < 0.25 * full.std()
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    hf = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"FP8 checkpoints \(quantization_config\) of Phi3ForCausalLM"):
        ModelConfig.from_dict({**hf, "quantization_config": fp8})


# ---- longrope -------------------------------------------------------------------------------------------------


def _phi3_config(**fields: Any) -> dict[str, Any]:
    """A Phi-3-mini-128k-shaped config.json (head_dim 96: 48 rotary pairs), with ``fields`` over it."""
    hf = dict(
        architectures=["Phi3ForCausalLM"],
        hidden_size=3072,
        num_attention_heads=32,
        num_hidden_layers=2,
        intermediate_size=8192,
        vocab_size=32064,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(48)],
            "long_factor": [1.0 + 0.9 * i for i in range(48)],
        },
        sliding_window=262144,
    )
    return {**hf, **fields}


def _hf_rope(hf: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """transformers' Phi3RotaryEmbedding's (inv_freq, attention_scaling) for config.json ``hf``: the short set."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    fields = {k: v for k, v in hf.items() if k != "architectures"}
    rotary = Phi3RotaryEmbedding(transformers.Phi3Config(**json.loads(json.dumps(fields))))
    return rotary.inv_freq, rotary.attention_scaling


@pytest.mark.parametrize(
    "fields",
    [
        {},  # Phi-3-mini-128k: factor 32, attention factor sqrt(1 + ln 32 / ln 4096)
        {"rope_scaling": {**_phi3_config()["rope_scaling"], "type": "su"}},  # older Phi-3 configs' name
        {"rope_scaling": {**_phi3_config()["rope_scaling"], "type": "yarn"}},  # read as longrope by Phi3Config
        {"original_max_position_embeddings": 8192},  # the top-level field wins over the dict's
        {"rope_scaling": {**_phi3_config()["rope_scaling"], "original_max_position_embeddings": 1024}},
        {"rope_scaling": {**_phi3_config()["rope_scaling"], "attention_factor": 1.5}},
        {"rope_scaling": {**_phi3_config()["rope_scaling"], "factor": 4.0}},
        {"max_position_embeddings": 4096},  # factor 1: no attention factor
    ],
)
def test_longrope_frequencies_equal_transformers(fields: dict[str, Any]) -> None:
    """Our longrope inverse frequencies (short factors) equal transformers' Phi3RotaryEmbedding's bit for bit, and
    its cos/sin factor ours; the served length is the original_max_position_embeddings it uses."""
    hf = _phi3_config(**fields)
    config = ModelConfig.from_dict(hf)
    scaling = config.rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    inv_freq, attention_factor = _hf_rope(hf)
    assert torch.equal(rope_inv_freq(config.head_dim, config.rope_theta, scaling), inv_freq)
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert config.max_seq_len == hf["original_max_position_embeddings"]
    if not fields:
        assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize("family", ["phi3_longrope"], indirect=True)
def test_longrope_is_served_up_to_original_max_position_embeddings(
    family: tuple[str, Path, Any], tmp_path: Path
) -> None:
    """The engine's (and the executor's) default max model length for a longrope checkpoint is its
    original_max_position_embeddings (128, not max_position_embeddings 512), as far as its rope table goes; a longer
    max_model_len is refused naming both lengths and why."""
    _, path, _ = family
    llm = LLM(path, dtype="float32", block_size=4, num_blocks=64)
    try:
        # the executor's too: it sizes its buffers and a GPU's profiling step (positions below it) by that length
        assert llm.engine.config.max_model_len == 128 and llm.executor.max_model_len == 128
    finally:
        llm.close()
    with pytest.raises(CheckpointError, match=r"max_model_len \(129\) must be <= original_max_position_embeddings"):
        LLM(path, dtype="float32", block_size=4, num_blocks=64, max_model_len=129)
    assert ModelConfig.from_pretrained(path, max_model_len=128).max_seq_len == 128


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"short_factor": None}, r"rope_scaling \(rope_type 'longrope'\): short_factor must be a list of numbers"),
        ({"long_factor": [1.0] * 47}, r"long_factor has 47 entries; it needs one per rotary pair, head_dim / 2 = 48"),
        ({"short_factor": [1.0] * 47 + [0.0]}, r"each entry of short_factor must be a positive number, got 0.0"),
        ({"short_factor": [1.0] * 47 + ["2"]}, r"short_factor must be a list of numbers"),
        ({"attention_factor": -1.0}, r"attention_factor must be a number >= 0, got -1.0"),
    ],
)
def test_bad_longrope_fields_are_named(rope: dict[str, Any], message: str) -> None:
    """A malformed longrope field is a ValueError naming it (and the rope dict)."""
    hf = _phi3_config()
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**hf, "rope_scaling": {**hf["rope_scaling"], **rope}})


def test_missing_longrope_factors_are_named() -> None:
    """A longrope dict without its short_factor (or long_factor) is a ValueError naming the dict and the field."""
    for name in ("short_factor", "long_factor"):
        hf = _phi3_config()
        rope = {k: v for k, v in hf["rope_scaling"].items() if k != name}
        with pytest.raises(ValueError, match=rf"rope_scaling \(rope_type 'longrope'\) is missing field '{name}'"):
            ModelConfig.from_dict({**hf, "rope_scaling": rope})


def test_partial_rotary_factor_is_refused_by_name() -> None:
    """Phi-4-mini's partial_rotary_factor 0.75 (rope on 3/4 of each head) is refused naming the field, at the top
    level and inside the rope dict."""
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.75 is not supported; supported: 1.0"):
        ModelConfig.from_dict(_phi3_config(partial_rotary_factor=0.75))
    rope = {**_phi3_config()["rope_scaling"], "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=r"rope_scaling.partial_rotary_factor 0.75 is not supported"):
        ModelConfig.from_dict(_phi3_config(rope_scaling=rope))

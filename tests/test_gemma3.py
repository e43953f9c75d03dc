"""Gemma 3 checkpoints (Gemma3ForCausalLM, and the text decoder of Gemma3ForConditionalGeneration): logits and greedy
tokens equal transformers' in fp32 (local and global layers with a sliding window shorter than the prompts, two rope
bases, a linear rope scaling, query_pre_attn_scalar apart from head_dim, head_dim 256, biases), chunked prefill and
prefix-cache hits; the multimodal checkpoint's decoder read under either prefix layout with exactly its vision tensors
skipped; the norm, GeGLU and embedding scale bit-equal to transformers' in bfloat16; both config formats and
gemma-3-4b-it's sparse text_config read as transformers reads them; refusals by name; tensor parallelism on gloo
equals one process; the Triton ops and attention kernels (head_dim 256) under TRITON_INTERPRET=1."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # before any fnvllm.kernels import: the Triton test below runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from safetensors.torch import load_file, save_file
from test_llm_equality import check_prefix_hits
from test_model import TOL, check_chunked_prefill, hf_logits, prompt, run_schedule
from test_sliding_window import WithBackend
from test_tp import check_tp2_greedy
from tiny_models import GEMMA3_FAMILIES, GEMMA3_ROPE, hf_model, write_gemma3_family

from fnvllm.model import ModelConfig, load_model
from fnvllm.model.config import CheckpointError
from fnvllm.model.gemma import embed_scale, gelu_tanh_and_mul_ref, gemma_rmsnorm_ref
from fnvllm.model.loader import CheckpointMismatchError
from fnvllm.model.rope import LinearRopeScaling
from fnvllm.published import GEMMA3_4B


@pytest.fixture(scope="module", params=list(GEMMA3_FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(name, checkpoint folder, transformers' model of it) for each tiny Gemma 3."""
    path = write_gemma3_family(tmp_path_factory.mktemp("gemma3"), request.param)
    return request.param, path, hf_model(path)


def test_config_reads_gemma3(family: tuple[str, Path, Any]) -> None:
    """The config gives transformers' layer types (local layers in sliding_layers with the window), both rope tables,
    the attention scale, q/k norms, biases and tie; the multimodal one reads its text_config."""
    name, path, hf = family
    text = hf.config.get_text_config()
    config = ModelConfig.from_pretrained(path)
    assert config.gemma is not None and config.qk_norm
    local = tuple(i for i, kind in enumerate(text.layer_types) if kind == "sliding_attention")
    assert config.gemma.local_layers == local and config.sliding_layers == local
    assert config.sliding_window == text.sliding_window
    decoder = hf.model.language_model if name == "gemma3_mm" else hf.model
    assert config.gemma.attention_scale == decoder.layers[0].self_attn.scaling
    assert config.head_dim == text.head_dim and config.attention_bias == config.o_proj_bias == text.attention_bias
    assert config.rope_theta == text.rope_parameters["full_attention"]["rope_theta"]
    assert config.gemma.rope_local_theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    factor = text.rope_parameters["full_attention"].get("factor")
    assert config.rope_scaling == (None if factor is None else LinearRopeScaling(factor))
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.max_seq_len == text.max_position_embeddings  # the linear factor does not stretch it


def test_logits_match_transformers(family: tuple[str, Path, Any]) -> None:
    """Prefill in three chunks, then single-token decodes, through the paged cache, give transformers' logits, past
    the 12- / 16-token window too."""
    _, path, hf = family
    check_chunked_prefill(load_model(path, ModelConfig.from_pretrained(path), "cpu"), hf, block_size=4, seed=1)


def test_greedy_equals_transformers(family: tuple[str, Path, Any]) -> None:
    """Greedy tokens through LLM equal transformers' generate for 10 mixed prompts (1-70 tokens, 16 new each), with
    prefix-cache hits longer than the window."""
    check_prefix_hits(*family)


@pytest.mark.parametrize("family", ["gemma3_mm"], indirect=True)
def test_multimodal_layouts_and_vision_tensors(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    """transformers 4.52's layout (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*) loads
    the same decoder as the published one; a stray tensor, or a vision tensor of the other layout, is unexpected."""
    _, path, hf = family
    tensors = load_file(str(path / "model.safetensors"))
    assert any(n.startswith("vision_tower.") for n in tensors)  # transformers 5 saves the published layout

    def relaid(name: str) -> str:
        if name.startswith("language_model.model."):
            return "model.language_model." + name.removeprefix("language_model.model.")
        return "model." + name  # vision_tower.*, multi_modal_projector.*

    other = _copy_with(path, tmp_path / "other", {relaid(n): t for n, t in tensors.items()})
    tokens = prompt(3, length=20)
    logits = []
    for folder in (path, other):
        model = load_model(folder, ModelConfig.from_pretrained(folder), "cpu")
        logits.append(run_schedule(model, [tokens], [[(0, 20)]], block_size=4)[0])
    assert torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[0], hf_logits(hf, tokens), **TOL)
    for name in ("language_model.extra.weight", "model.vision_tower.stray.weight"):
        bad = _copy_with(path, tmp_path / name, {**tensors, name: torch.zeros(2)})
        with pytest.raises(CheckpointMismatchError, match=rf"unexpected tensors \['{name}'\]"):
            load_model(bad, ModelConfig.from_pretrained(bad), "cpu")


def _copy_with(source: Path, dest: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """``source``'s config.json beside ``tensors`` as model.safetensors, in ``dest``."""
    dest.mkdir(parents=True)
    shutil.copy(source / "config.json", dest / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dest / "model.safetensors"))
    return dest


def test_norm_geglu_and_embedding_scale_are_bit_equal_in_bfloat16() -> None:
    """In bfloat16 the (1 + w) RMSNorm, GeGLU and sqrt(hidden) embedding scale round exactly as transformers' Gemma 3
    modules do (sqrt(3072) = 55.4256 becomes 55.5, as transformers notes)."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3072, generator=gen) * 3).bfloat16()
    norm = Gemma3RMSNorm(3072, eps=1e-6).bfloat16()
    torch.nn.init.normal_(norm.weight, std=0.5, generator=gen)
    with torch.no_grad():
        assert torch.equal(gemma_rmsnorm_ref(x, norm.weight, 1e-6), norm(x))
        gate, up = x[:, :1536], x[:, 1536:]
        assert torch.equal(gelu_tanh_and_mul_ref(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)
        embed = Gemma3TextScaledWordEmbedding(16, 3072, 0, embed_scale=3072**0.5).bfloat16()
        ids = torch.arange(16)
        assert embed_scale(3072, torch.bfloat16) == 55.5
        assert torch.equal(embed.weight[ids] * embed_scale(3072, torch.bfloat16), embed(ids))


def test_published_sparse_text_config_reads_as_transformers_reads_it() -> None:
    """gemma-3-4b-it's sparse text_config takes Gemma3TextConfig's defaults: 8 / 4 heads of 256, vocab 262208,
    every sixth layer global, local theta 10000, global 1e6 with the linear factor 8, context 131072."""
    import transformers

    hf = transformers.Gemma3Config(**{k: v for k, v in GEMMA3_4B.items() if k != "architectures"}).text_config
    config = ModelConfig.from_dict(GEMMA3_4B)
    assert config.dtype == "bfloat16" and config.tie_word_embeddings
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    fields += ("intermediate_size", "vocab_size", "max_position_embeddings", "sliding_window", "rms_norm_eps")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(hf, f) for f in fields}
    local = tuple(i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention")
    assert config.gemma is not None and config.gemma.local_layers == local == config.sliding_layers
    assert len(local) == 34 - 5  # layers 5, 11, 17, 23, 29 are global
    assert config.gemma.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert config.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert config.gemma.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.rope_scaling == LinearRopeScaling(hf.rope_parameters["full_attention"]["factor"])
    assert config.max_seq_len == 131_072


def test_transformers_4_config_format_reads_like_transformers_5() -> None:
    """The older fields (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) read to the same
    ModelConfig as the rope_parameters / layer_types that transformers 5 turns them into."""
    import transformers

    old = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=5,
               intermediate_size=96, vocab_size=256, sliding_window=12, sliding_window_pattern=3, rope_theta=5000.0,
               rope_local_base_freq=50.0, rope_scaling={"rope_type": "linear", "factor": 2.0})  # fmt: skip
    new = transformers.Gemma3TextConfig(**old).to_dict()
    assert "layer_types" in new and "rope_parameters" in new
    ours = ModelConfig.from_dict({**old, "architectures": ["Gemma3ForCausalLM"]})
    assert ours == ModelConfig.from_dict({**new, "architectures": ["Gemma3ForCausalLM"]})
    assert ours.sliding_layers == (0, 1, 3, 4) and ours.rope_scaling == LinearRopeScaling(2.0)


@pytest.mark.parametrize(("top", "text"), [(True, False), (False, True)])
def test_multimodal_tie_follows_the_top_level_config(top: bool, text: bool) -> None:
    """A Gemma3ForConditionalGeneration's head is tied to the embedding as transformers ties it: by the top-level
    tie_word_embeddings, whatever text_config's says."""
    import transformers

    options = {k: v for k, v in GEMMA3_FAMILIES["gemma3"].items() if k != "rope_parameters"}
    text_config = transformers.Gemma3TextConfig(
        vocab_size=256, intermediate_size=96, tie_word_embeddings=text, **options
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    hf_config = transformers.Gemma3Config(text_config=text_config, vision_config=vision, tie_word_embeddings=top)
    hf = transformers.Gemma3ForConditionalGeneration(hf_config)
    tied = hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    ours = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["Gemma3ForConditionalGeneration"]})
    assert ours.tie_word_embeddings == tied == top


def _gemma3_config(**fields: Any) -> dict[str, Any]:
    """A tiny Gemma3ForCausalLM config.json with ``fields`` over it."""
    base = dict(GEMMA3_FAMILIES["gemma3"], vocab_size=256, intermediate_size=96, rope_parameters=GEMMA3_ROPE)
    return {**base, "architectures": ["Gemma3ForCausalLM"], **fields}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping 30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping 50.0 is not supported"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True is not supported"),
        ({"hidden_activation": "gelu"}, r"hidden_activation 'gelu' is not supported"),
        ({"layer_types": ["full_attention"]}, r"layer_types must be a list of 4 entries"),
        ({"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar must be a positive number, got 0"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, r"rope_parameters must map each of"),
        (
            {"rope_parameters": {**GEMMA3_ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            r"rope_parameters.sliding_attention rope_type 'linear' is not supported",
        ),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, r"FP8 weights"),
    ],
)
def test_unsupported_fields_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    """Softcapping, bidirectional attention, another activation, malformed layer types or rope dicts and FP8 weights
    are ValueErrors naming the field (from_pretrained turns them into CheckpointErrors naming config.json)."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_gemma3_config(**fields))


def test_refusals_name_config_json_and_fp8_at_load(tmp_path: Path) -> None:
    """Through from_pretrained the refusal is a CheckpointError naming config.json; quantization="fp8" is refused."""
    (tmp_path / "config.json").write_text(json.dumps(_gemma3_config(final_logit_softcapping=30.0)))
    with pytest.raises(CheckpointError, match=r"config.json: final_logit_softcapping"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"FP8 weights .* are not supported for Gemma 3"):
        ModelConfig.from_dict(_gemma3_config(), quantization="fp8")
    mm = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": None}
    with pytest.raises(ValueError, match=r"text_config must be an object"):
        ModelConfig.from_dict(mm)


@pytest.mark.parametrize("family", ["gemma3", "gemma3_mm"], indirect=True)
def test_tp2_greedy_equals_tp1(family: tuple[str, Path, Any]) -> None:
    """At tensor_parallel_size=2 (gloo) greedy tokens equal one process's, with prefix-cache hits and preemptions
    (4 query heads split, the single KV head replicated; the multimodal checkpoint's decoder read on each rank)."""
    check_tp2_greedy(family[1]).close()


@pytest.mark.parametrize("family", ["gemma3_hd256"], indirect=True)
def test_triton_ops_and_kernels_with_head_dim_256(family: tuple[str, Path, Any]) -> None:
    """With the Triton ops (Gemma keeps their linear: the skinny GEMM on a GPU, F.linear here; its norms run in
    torch) and the Triton store, prefill and decode attention kernels at head_dim 256 (interpreted on the CPU),
    chunked prefill past the 16-token window and decodes give transformers' logits."""
    from triton_guard import require_triton

    require_triton()
    from fnvllm.kernels.backends import get_backend
    from fnvllm.model.ops import triton_ops

    _, path, hf = family
    model = load_model(path, ModelConfig.from_pretrained(path), "cpu", ops=triton_ops())
    assert model.model.layers[0].self_attn.qkv_proj.matmul is triton_ops().linear
    tokens = prompt(4, length=22)
    schedule = [[(0, 9)], [(0, 11)], [(0, 1)], [(0, 1)]]  # a window of 16 inside the second chunk, then decodes
    (logits,) = run_schedule(WithBackend(model, get_backend("triton")), [tokens], schedule, block_size=4)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_equals_transformers_with_cuda_graphs(family: tuple[str, Path, Any]) -> None:
    """On a GPU (Triton ops and kernels, decode steps replayed from CUDA graphs) greedy tokens equal transformers'."""
    check_prefix_hits(*family, device="cuda")

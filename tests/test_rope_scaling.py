"""Rope scaling types yarn, linear and dynamic on tiny random Qwen2 / Qwen3 / Llama checkpoints: the rope table, the
logits past original_max_position_embeddings and the greedy tokens equal transformers', from either config format
(transformers 4's rope_scaling + rope_theta, 5's rope_parameters); bad fields are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_llm_equality import check_prefix_hits
from test_model import TOL, hf_logits, prompt, run_schedule
from tiny_models import hf_greedy, hf_model

from fnvllm.llm import LLM
from fnvllm.model import ModelConfig, load_model
from fnvllm.model.config import SUPPORTED_ROPE_TYPES, CheckpointError
from fnvllm.model.ops import ops_for
from fnvllm.model.rope import DynamicNtkRopeScaling, LinearRopeScaling, YarnRopeScaling
from fnvllm.state import InvalidConfigError, SamplingParams
from fnvllm.testing.checkpoints import write_tiny_checkpoint
from fnvllm.testing.tokenizer import build_test_tokenizer

ORIGINAL = 64  # original_max_position_embeddings: every prompt below is longer
PROMPT_LEN = 100
QWEN2 = dict(family="qwen2", hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64
QWEN3 = dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=32)
LLAMA = dict(family="llama", num_heads=4, num_kv_heads=1, rope_theta=500000.0)  # head_dim 16

# id -> (write_tiny_checkpoint arguments, the rope dict, the config format written, our scaling class). Formats:
# "rope_parameters" (transformers 5), "rope_scaling" (4: rope_theta beside it), "rope_scaling/type" (4, with the
# type under the old "type" key, as old linear checkpoints have it). Qwen's documented long-context setting (yarn,
# factor 4, transformers 4's format); yarn with a factor that is no power of two, narrow betas, no truncation and
# DeepSeek's mscale pair; yarn with an explicit attention_factor; linear; dynamic NTK, served up to
# max_position_embeddings (128 here).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str, type]] = {
    "qwen2-yarn-qwen-docs-v4": (
        QWEN2,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        "rope_scaling",
        YarnRopeScaling,
    ),
    "qwen3-yarn-betas-untruncated-mscale-v5": (
        QWEN3,
        {
            "rope_type": "yarn",
            "factor": 3.3,
            "original_max_position_embeddings": ORIGINAL,
            "beta_fast": 8,
            "beta_slow": 2,
            "truncate": False,
            "mscale": 0.8,
            "mscale_all_dim": 0.5,
        },
        "rope_parameters",
        YarnRopeScaling,
    ),
    "llama-yarn-attention-factor-v5": (
        LLAMA,
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.3},
        "rope_parameters",
        YarnRopeScaling,
    ),
    "llama-linear-type-key-v4": (LLAMA, {"rope_type": "linear", "factor": 2.5}, "rope_scaling/type", LinearRopeScaling),
    "qwen2-linear-v5": (QWEN2, {"rope_type": "linear", "factor": 4.0}, "rope_parameters", LinearRopeScaling),
    "qwen3-dynamic-v4": (
        dict(QWEN3, max_position_embeddings=128),
        {"rope_type": "dynamic", "factor": 2.0},
        "rope_scaling",
        DynamicNtkRopeScaling,
    ),
}


def write_checkpoint(root: Path, case: str) -> Path:
    """The case's tiny fp32 checkpoint (max_position_embeddings 256 unless the case says) with its rope dict in
    the case's format, plus the test tokenizer."""
    options, rope, rope_format, _ = CASES[case]
    options = {"max_position_embeddings": 256, **options}
    path = write_tiny_checkpoint(root / case, vocab_size=256, intermediate_size=96, rope_scaling=rope, **options)
    if rope_format.startswith("rope_scaling"):
        config = json.loads((path / "config.json").read_text())
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        if rope_format == "rope_scaling/type":
            params["type"] = params.pop("rope_type")
        config["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(config))
    build_test_tokenizer(path, vocab_size=256)
    return path


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(case id, checkpoint folder, transformers' fp32 model of it)."""
    path = write_checkpoint(tmp_path_factory.mktemp("rope"), request.param)
    return request.param, path, hf_model(path)


def test_config_reads_the_scaling_transformers_reads(case: tuple[str, Path, Any]) -> None:
    """The config file holds the case's format, transformers reads the same rope type from it (so the comparisons
    below are not against plain rope), and ours reads it as the case's scaling class."""
    name, path, hf = case
    _, rope, rope_format, scaling_class = CASES[name]
    written = json.loads((path / "config.json").read_text())
    key, _, type_key = rope_format.partition("/")
    other = ({"rope_scaling", "rope_parameters"} - {key}).pop()
    assert written[key][type_key or "rope_type"] == rope["rope_type"] and not written.get(other)
    assert hf.config.rope_parameters["rope_type"] == rope["rope_type"]
    assert type(ModelConfig.from_pretrained(path).rope_scaling) is scaling_class


@torch.inference_mode()
def test_rope_table_equals_transformers(case: tuple[str, Path, Any]) -> None:
    """Our cos/sin table, for every position up to max_position_embeddings, equals transformers' rotary embedding
    (its cos and sin, attention factor included) for the same positions in one call."""
    _, path, hf = case
    ours = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    table = ours.model.rotary_emb.cos_sin_cache  # (max_positions, head_dim): [cos | sin]
    positions = torch.arange(table.shape[0])[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)  # each (1, P, head_dim)
    half = table.shape[1] // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-5, rtol=0)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-5, rtol=0)


def test_logits_past_the_original_length_match_transformers(case: tuple[str, Path, Any]) -> None:
    """A 100-token prompt prefilled in chunks of 40, 30 and 20 tokens, then 10 single-token decodes, through the
    paged cache, gives transformers' logits at every position, most of them past original_max_position_embeddings."""
    _, path, hf = case
    ours = load_model(path, ModelConfig.from_pretrained(path), "cpu")
    tokens = prompt(3, length=PROMPT_LEN)
    (logits,) = run_schedule(ours, [tokens], [[(0, 40)], [(0, 30)], [(0, 20)]] + [[(0, 1)]] * 10, block_size=16)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


def test_greedy_tokens_match_transformers(case: tuple[str, Path, Any]) -> None:
    """Greedy generation of two prompts longer than original_max_position_embeddings, batched, gives
    transformers' generate tokens."""
    _, path, hf = case
    prompts = [prompt(seed, length=n).tolist() for seed, n in ((5, 70), (6, 97))]
    llm = LLM(path, dtype="float32", block_size=16, num_blocks=64)
    eos = sorted(llm.engine.config.eos_token_ids)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(hf, p, 16, eos)


@pytest.mark.parametrize("case", ["qwen3-yarn-betas-untruncated-mscale-v5"], indirect=True)
def test_triton_ops_take_the_scaled_table(case: tuple[str, Path, Any]) -> None:
    """With the Triton ops (interpreted on the CPU: the fused embedding + table gather, Qwen3's fused q/k norm and
    rotary) a YaRN model gives transformers' logits past the original length, attention factor included."""
    _, path, hf = case
    ours = load_model(path, ModelConfig.from_pretrained(path), "cpu", ops=ops_for("triton"))
    tokens = prompt(4, length=ORIGINAL + 6)
    (logits,) = run_schedule(ours, [tokens], [[(0, ORIGINAL + 2)]] + [[(0, 1)]] * 4, block_size=16)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton ops on the device need a GPU")
@pytest.mark.parametrize("case", ["qwen2-yarn-qwen-docs-v4"], indirect=True)
def test_gpu_greedy_matches_transformers(case: tuple[str, Path, Any]) -> None:
    """On a GPU (CUDA graphs, the Triton ops) a YaRN checkpoint's greedy tokens for mixed prompts, the longer ones
    past original_max_position_embeddings, with prefix-cache hits, equal transformers'."""
    name, path, hf = case
    check_prefix_hits(name, path, hf, device="cuda")


@pytest.mark.parametrize("case", ["qwen3-dynamic-v4"], indirect=True)
def test_dynamic_is_refused_past_max_position_embeddings(case: tuple[str, Path, Any]) -> None:
    """A dynamic-NTK checkpoint cannot be served past max_position_embeddings (where transformers would start
    rescaling per sequence length), so the plain table above stays exact."""
    _, path, _ = case
    with pytest.raises(InvalidConfigError, match=r"longest sequence \(128: its max_position_embeddings"):
        LLM(path, dtype="float32", block_size=16, num_blocks=64, max_model_len=129)


@pytest.mark.parametrize(
    ("case", "reach"),
    [("qwen2-yarn-qwen-docs-v4", ORIGINAL * 4), ("qwen2-linear-v5", ORIGINAL * 4)],
    indirect=["case"],
)
def test_stretching_scalings_serve_past_max_position_embeddings(
    case: tuple[str, Path, Any], reach: int, tmp_path: Path
) -> None:
    """A yarn (or linear) checkpoint whose config.json keeps max_position_embeddings at the original length, as
    Qwen's long-context recipe does, serves up to original x factor: the engine's default max_model_len is that
    reach, one token more is refused by name, and greedy tokens of sequences longer than max_position_embeddings
    equal transformers' (whose tables do not depend on the length)."""
    name, source, hf = case
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = ORIGINAL
    path = tmp_path / name
    path.mkdir()
    for file in source.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(path, dtype="float32", block_size=16, num_blocks=64)
    assert llm.engine.config.max_model_len == reach
    prompts = [prompt(seed, length=n).tolist() for seed, n in ((7, ORIGINAL + 30), (8, ORIGINAL + 3))]
    eos = sorted(llm.engine.config.eos_token_ids)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(hf, p, 24, eos)
    with pytest.raises(InvalidConfigError, match=rf"longest sequence \({reach}: "):
        LLM(path, dtype="float32", block_size=16, num_blocks=64, max_model_len=reach + 1)


# ---- config parsing: both formats, defaults, errors ------------------------------------------------------------


def _config(rope: dict[str, Any] | None, rope_format: str = "rope_parameters", **extra: Any) -> dict[str, Any]:
    """A Llama config.json (max_position_embeddings 4096) whose rope dict is ``rope`` in ``rope_format``."""
    base = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 4096, **extra,
    }  # fmt: skip
    if rope_format == "rope_parameters":
        return {**base, "rope_parameters": None if rope is None else {"rope_theta": 1e6, **rope}}
    return {**base, "rope_theta": 1e6, "rope_scaling": rope}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_both_formats_give_one_config(rope: dict[str, Any]) -> None:
    """transformers 4's rope_scaling + rope_theta and 5's rope_parameters give the same ModelConfig (and theta)."""
    old = ModelConfig.from_dict(_config(rope, "rope_scaling"))
    assert old == ModelConfig.from_dict(_config(rope, "rope_parameters"))
    assert old.rope_theta == 1e6 and old.rope_scaling is not None


def test_yarn_defaults_are_transformers() -> None:
    """A yarn dict with factor alone reads transformers' defaults: original length = max_position_embeddings,
    betas 32 and 1 (also when 0 or null), truncation on, attention factor 0.1 ln(factor) + 1; a null factor is
    max_position_embeddings / original; mscale with mscale_all_dim gives their ratio; a factor below 1 no
    correction."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def attention_factor(rope: dict[str, Any]) -> float:
        return ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig.from_dict(_config(rope, "rope_scaling")), "cpu")[1]

    bare = {"rope_type": "yarn", "factor": 4.0}
    original = LlamaConfig.from_dict(_config(bare, "rope_scaling")).rope_parameters["original_max_position_embeddings"]
    scaling = ModelConfig.from_dict(_config({**bare, "beta_slow": 0, "beta_fast": None})).rope_scaling
    assert scaling == YarnRopeScaling(4.0, original, attention_factor(bare), 32.0, 1.0, truncate=True)
    for rope in (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707},
        {"rope_type": "yarn", "factor": 0.5},
    ):
        got = ModelConfig.from_dict(_config(rope)).rope_scaling
        assert isinstance(got, YarnRopeScaling) and got.attention_factor == pytest.approx(attention_factor(rope))
    assert ModelConfig.from_dict(_config({"rope_type": "yarn", "factor": None})).rope_scaling.factor == 1.0


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "yarn", "factor": 0}, r"rope_parameters \(rope_type 'yarn'\): factor must be a positive"),
        ({"rope_type": "linear", "factor": -2.0}, r"rope_type 'linear'\): factor must be a positive number, got -2"),
        ({"rope_type": "dynamic", "factor": "2"}, r"rope_type 'dynamic'\): factor must be a positive number"),
        ({"rope_type": "linear"}, r"rope_parameters \(rope_type 'linear'\) is missing field 'factor'"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, r"is missing field 'factor'"),
        ({"type": "dynamic"}, r"rope_type 'dynamic'\) is missing field 'factor'"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}, "attention_factor must be a positive number"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}, "beta_fast must be a number >= 0"),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": -1}, "mscale must be a number >= 0, got -1"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "truncate must be true or false"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
            "original_max_position_embeddings must be a positive int, got 0",
        ),
        ({"rope_type": "longrope", "factor": 4.0}, r"rope_type 'longrope'\) is missing field 'short_factor'"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_bad_rope_fields_are_named(rope: dict[str, Any], message: str) -> None:
    """A missing or invalid field of a supported rope type, or an unsupported type, is a ValueError naming the
    dict, the rope type and the field."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(rope))


def test_unknown_type_lists_the_supported_ones_from_a_folder(tmp_path: Path) -> None:
    """From a checkpoint folder, an unsupported rope type in transformers 4's format is a CheckpointError naming
    config.json, rope_scaling, the type and every supported type."""
    (tmp_path / "config.json").write_text(json.dumps(_config({"type": "su", "factor": 2.0}, "rope_scaling")))
    with pytest.raises(CheckpointError, match="rope_scaling rope_type 'su' is not supported") as info:
        ModelConfig.from_pretrained(tmp_path)
    assert "config.json" in str(info.value) and all(t in str(info.value) for t in SUPPORTED_ROPE_TYPES)
    assert set(SUPPORTED_ROPE_TYPES) == {"default", "llama3", "linear", "yarn", "dynamic", "longrope"}

"""Tiny random checkpoints (written by transformers) shared by the model-level API tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fnvllm.testing.checkpoints import write_tiny_checkpoint
from fnvllm.testing.tokenizer import build_test_tokenizer

# Odd shapes on purpose: head_dim 64 and 32, 1 and 2 KV heads, tied and untied, 2-4 layers, llama3 rope scaling.
# The MoE ones: 8 experts, top-2, renormalised with a dense second layer, or not renormalised and all sparse.
_MOE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2, family="qwen3_moe")
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, num_layers=2, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64, num_layers=3),
    "llama": dict(
        hidden_size=64,
        num_heads=4,
        num_kv_heads=1,
        num_layers=4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3_moe": dict(
        _MOE,
        moe=dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]
        ),
    ),
    "qwen3_moe_unnormed": dict(
        _MOE, moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)
    ),
}
MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_unnormed")


def write_family(root: Path, family: str) -> Path:
    """A tiny fp32 checkpoint of ``family`` (a key of FAMILIES) plus the test tokenizer, in ``root / family``."""
    options = dict(FAMILIES[family])
    kind = options.pop("family", family)
    path = write_tiny_checkpoint(root / family, kind, vocab_size=256, intermediate_size=96, **options)
    build_test_tokenizer(path, vocab_size=256)
    return path


# Mistral and Mixtral (written here: fnvllm.testing.checkpoints knows the Qwen / Llama families only). "mistral" has
# an explicit head_dim of 32 over hidden 64 / 4 heads (as Mistral-Nemo's 128 over 5120 / 32) and no window;
# "mistral_window" has a sliding window of 4096 over 2048 positions (it changes nothing); "mixtral" has 4 experts,
# top-2, in both layers. Options of transformers' MistralConfig / MixtralConfig.
_MISTRAL = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5)
MISTRAL_FAMILIES: dict[str, dict[str, Any]] = {
    "mistral": dict(_MISTRAL, num_key_value_heads=1, head_dim=32, num_hidden_layers=3, sliding_window=None),
    "mistral_window": dict(_MISTRAL, num_key_value_heads=2, num_hidden_layers=2, sliding_window=4096),
    "mixtral": dict(_MISTRAL, num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
}


def write_mistral_family(root: Path, family: str, **overrides: Any) -> Path:
    """A tiny random fp32 Mistral or Mixtral checkpoint (``family``: a key of MISTRAL_FAMILIES; ``overrides``:
    more config fields) written by transformers, plus the test tokenizer, in ``root / family``. Weights, norms and
    the router are drawn as write_tiny_checkpoint draws them (std 0.1, norm weights U(0.5, 1.5)); EOS is 255."""
    import transformers

    defaults = dict(vocab_size=256, intermediate_size=96, initializer_range=0.1, bos_token_id=0, eos_token_id=255)
    options = {**defaults, **MISTRAL_FAMILIES[family], **overrides}
    is_moe = "num_local_experts" in options
    config_class = transformers.MixtralConfig if is_moe else transformers.MistralConfig
    model_class = transformers.MixtralForCausalLM if is_moe else transformers.MistralForCausalLM
    return _write_random_hf(model_class, config_class(**options), root / family)


def _write_random_hf(model_class: Any, config: Any, path: Path) -> Path:
    """A transformers model of ``config`` with seeded random weights (norms and biases too), its generation config
    (BOS 0, EOS 255) and the test tokenizer, saved in ``path``."""
    import transformers

    from fnvllm.testing.checkpoints import _randomize_norms_and_biases

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
        _randomize_norms_and_biases(model)
    model.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=255).save_pretrained(path)
    build_test_tokenizer(path, vocab_size=256)
    return path


# Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), written here too. "qwen2_moe" is Qwen1.5-MoE's layout shrunk: every
# layer sparse, multi-head attention (4 KV heads), top-k not renormalised, a shared expert wider than a routed one;
# "qwen2_moe_mixed" has decoder_sparse_step 2 and mlp_only_layers [1] over 4 layers (only layer 3 sparse: layer 1
# would be but for the list), GQA (2 KV heads) and renormalised top-k. Options of transformers' Qwen2MoeConfig.
_QWEN2_MOE = dict(
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=2048,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
QWEN2_MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(_QWEN2_MOE, num_key_value_heads=4, num_hidden_layers=2, norm_topk_prob=False),
    "qwen2_moe_mixed": dict(
        _QWEN2_MOE,
        num_key_value_heads=2,
        num_hidden_layers=4,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[1],
    ),
}


def write_qwen2_moe_family(root: Path, family: str, **overrides: Any) -> Path:
    """A tiny random fp32 Qwen2-MoE checkpoint (``family``: a key of QWEN2_MOE_FAMILIES; ``overrides``: more config
    fields) written by transformers, plus the test tokenizer, in ``root / family``. Weights, norms, biases, the router
    and the shared expert's gate are drawn as write_tiny_checkpoint draws them (std 0.1, norm weights U(0.5, 1.5),
    biases N(0, 0.1)); EOS is 255."""
    import transformers

    defaults = dict(vocab_size=256, intermediate_size=96, initializer_range=0.1, bos_token_id=0, eos_token_id=255)
    config = transformers.Qwen2MoeConfig(**{**defaults, **QWEN2_MOE_FAMILIES[family], **overrides})
    return _write_random_hf(transformers.Qwen2MoeForCausalLM, config, root / family)


# Phi-3 (Phi3ForCausalLM: fused qkv_proj and gate_up_proj tensors), written here too. "phi3" has GQA (4 heads, 2 KV
# heads) and an untied head; "phi3_window" a tied head, one KV head and a sliding window of 24 tokens, shorter than
# the longer test prompts; "phi3_longrope" longrope over original_max_position_embeddings 128 (max 512: attention
# factor sqrt(1 + ln 4 / ln 128)) with short factors far from 1 (and other long factors, which the prompts, within
# 128 tokens, never reach). Options of transformers' Phi3Config.
_PHI3 = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5)
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.3, 1.7, 2.2, 2.9, 3.8, 5.0, 6.5],  # head_dim 16: 8 pairs
    "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 11.0, 15.0, 20.0],
}
PHI3_FAMILIES: dict[str, dict[str, Any]] = {
    "phi3": dict(_PHI3, num_key_value_heads=2, num_hidden_layers=2),
    "phi3_window": dict(_PHI3, num_key_value_heads=1, num_hidden_layers=3, tie_word_embeddings=True, sliding_window=24),
    "phi3_longrope": dict(
        _PHI3,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters=PHI3_LONGROPE,
    ),
}


def write_phi3_family(root: Path, family: str, **overrides: Any) -> Path:
    """A tiny random fp32 Phi-3 checkpoint (``family``: a key of PHI3_FAMILIES; ``overrides``: more config fields)
    written by transformers, plus the test tokenizer, in ``root / family``. Weights and norms are drawn as
    write_tiny_checkpoint draws them (std 0.1, norm weights U(0.5, 1.5)); EOS is 255."""
    import transformers

    defaults = dict(vocab_size=256, intermediate_size=96, initializer_range=0.1, bos_token_id=0, eos_token_id=255)
    options = {**defaults, **PHI3_FAMILIES[family], **overrides}
    if "rope_parameters" in options:  # Phi3Config fills in the dict it is given
        options["rope_parameters"] = dict(options["rope_parameters"])
    config = transformers.Phi3Config(pad_token_id=2, **options)
    return _write_random_hf(transformers.Phi3ForCausalLM, config, root / family)


# Gemma 3 (Gemma3ForCausalLM; Gemma3ForConditionalGeneration's text decoder), written here too. "gemma3" mixes local
# and global layers (layer_types), a sliding window of 12 tokens (shorter than the longer prompts), GQA (4 heads, 1 KV
# head) with head_dim 32 over hidden 64 / 4 heads, query_pre_attn_scalar 48 (not head_dim), a tied head, and two
# rope tables: local theta 100, global theta 10000 with linear scaling (factor 4). "gemma3_hd256" has head_dim 256
# (gemma-3-1b's), q/k/v/o biases, an untied head and plain global rope; "gemma3_mm" is "gemma3"'s decoder inside a
# Gemma3ForConditionalGeneration with a one-layer SigLIP vision tower. Options of transformers' Gemma3TextConfig.
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}
_GEMMA3 = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    sliding_window=12,
    query_pre_attn_scalar=48,
    max_position_embeddings=2048,
    rope_parameters=GEMMA3_ROPE,
)
GEMMA3_FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": _GEMMA3,
    "gemma3_hd256": dict(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        query_pre_attn_scalar=256,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    ),
    "gemma3_mm": _GEMMA3,
}


def write_gemma3_family(root: Path, family: str, **overrides: Any) -> Path:
    """A tiny random fp32 Gemma 3 checkpoint (``family``: a key of GEMMA3_FAMILIES; ``overrides``: more text config
    fields) written by transformers, plus the test tokenizer, in ``root / family``: a Gemma3ForCausalLM, or for
    "gemma3_mm" a Gemma3ForConditionalGeneration (tiny SigLIP tower, 4 tokens per image). Weights and norms are
    drawn as write_tiny_checkpoint draws them (std 0.1, norm weights U(0.5, 1.5): scales 1.5 to 2.5 in Gemma's
    (1 + w) form); EOS is 255."""
    import copy

    import transformers

    defaults = dict(vocab_size=256, intermediate_size=96, initializer_range=0.1, bos_token_id=0, eos_token_id=255)
    options = copy.deepcopy({**defaults, **GEMMA3_FAMILIES[family], **overrides})  # the config fills in its dicts
    text = transformers.Gemma3TextConfig(pad_token_id=2, **options)
    if family != "gemma3_mm":
        return _write_random_hf(transformers.Gemma3ForCausalLM, text, root / family)
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.initializer_range = 0.1
    return _write_random_hf(transformers.Gemma3ForConditionalGeneration, config, root / family)


def hf_model(path: Path) -> Any:
    """The same checkpoint loaded by transformers, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of one prompt (stopping after an EOS id, which it includes)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_ids,
            pad_token_id=2,
        )
    tokens = out[0, len(prompt) :].tolist()
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


# ---- a tiny chat model for the server tests (structured outputs, tools, client libraries) ----------------------

# `fnvllm serve` flags for it: float32 on the CPU, the torch backend, a small cache, served as "tiny".
TINY_SERVER_FLAGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "8", "--num-blocks", "512"]
TINY_SERVER_FLAGS += ["--max-model-len", "1536", "--attention-backend", "torch", "--served-model-name", "tiny"]
# A Hermes-style template (as Qwen's): tools listed in a system turn, calls as <tool_call> JSON, tool results.
TOOL_TEMPLATE = (
    "{%- if tools %}<s>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}</s>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<s>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}</s>\n"
    "{%- elif message.role == 'tool' %}<s>tool\n<tool_response>{{ message.content }}</tool_response></s>\n"
    "{%- else %}<s>{{ message.role }}\n{{ message.content }}</s>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<s>assistant\n{% endif %}"
)


# A tool both server test files call: its arguments are bounded (a pattern and an enum), so a random model's
# grammar-forced call finishes quickly.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,6}$"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def write_tool_chat_model(root: Path) -> Path:
    """A tiny Qwen3 checkpoint with TOOL_TEMPLATE as its chat template and the tokenizer's ``</s>`` (id 1) as EOS
    (so a grammar's end is a token the model can emit)."""
    path = write_family(root, "qwen3")
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)  # transformers reads it before tokenizer_config
    for name in ("config.json", "generation_config.json"):
        model_file = path / name
        model_file.write_text(json.dumps({**json.loads(model_file.read_text()), "eos_token_id": 1}))
    return path

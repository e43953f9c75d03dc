"""Published config.json numbers of the model shapes fnvllm benchmarks, writes and simulates: pure data, no torch,
so the simulator (which imports no torch), the checkpoint writers (``fnvllm.testing.checkpoints``) and the model's
config readers (``fnvllm.model.gemma_config``) share one copy.

- ``QWEN3_COMMON`` + ``QWEN3_SHAPES`` / ``QWEN3_MOE_SHAPES``: Qwen3-0.6B / 8B and Qwen3-30B-A3B.
- ``OTHER_SHAPES``: whole config.json files of Qwen1.5-MoE-A2.7B (Qwen2-MoE) and Mixtral-8x7B.
- ``GEMMA3_TEXT_DEFAULTS``: transformers' Gemma3TextConfig defaults, which published Gemma 3 configs lean on;
  ``GEMMA3_4B``: gemma-3-4b-it's config.json, which names five text_config fields and takes the rest from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The real Qwen3 config.json files (transformers 4.51 format), minus the per-shape numbers below.
QWEN3_COMMON: Mapping[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_SHAPES: Mapping[str, Mapping[str, Any]] = {
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}
# The published Qwen3-30B-A3B config.json's numbers (transformers' Qwen3MoeConfig() defaults differ).
QWEN3_MOE_SHAPES: Mapping[str, Mapping[str, Any]] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    },
}
# Whole published config.json files of the other families' benchmark shapes (transformers 4.39-4.51 format), with
# their generation_config.json. Qwen1.5-MoE-A2.7B: Qwen2-MoE, 60 routed experts (top-4, unnormalised) and a shared
# expert; 14.3B parameters, 2.7B active. Mixtral-8x7B: 8 experts (top-2); 46.7B parameters, 12.9B active.
OTHER_SHAPES: Mapping[str, Mapping[str, Any]] = {
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 32000,
    },
}
# transformers' Gemma3TextConfig defaults, for the fields a published config.json leaves out
GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# gemma-3-4b-it's config.json as published (its text_config names five fields; the rest are GEMMA3_TEXT_DEFAULTS:
# 8 query / 4 KV heads of 256, vocab 262,208, every sixth layer global, context 131,072)
GEMMA3_4B: Mapping[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
}

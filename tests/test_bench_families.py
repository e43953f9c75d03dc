"""The bench's bytes and FLOPs for the newer families: FP8 mixtures of experts (weight-only FP8 experts at one byte
a weight, multiplied in bf16), sliding-window layers (a decode reads at most the window's K/V, a query sees at most
the window's keys), Mixtral, Qwen2-MoE's shared expert, Gemma 3 and Phi-3. Expected values come from the engine's
own parameters (the model built on the meta device) or from the published configs by hand, never from the bench."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from fnvllm.bench import (
    floor_seconds,
    flops_per_token,
    keys_seen,
    roofline_seconds,
    weight_bytes,
)
from fnvllm.model.config import ModelConfig
from fnvllm.model.loader import build_on_meta
from fnvllm.published import GEMMA3_4B
from fnvllm.testing.checkpoints import _QWEN3_COMMON, OTHER_SHAPES, QWEN3_MOE_SHAPES

UNLIMITED = 1e12  # a ceiling so high (TB/s or TFLOP/s) that its side of the roofline vanishes
QWEN3_30B = {**_QWEN3_COMMON, **QWEN3_MOE_SHAPES["qwen3-30b-a3b"], "torch_dtype": "bfloat16"}
# a Phi-3-mini-4k-sized Phi-3 (transformers' Phi3Config numbers) with its 2047-token window on every layer
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "qwen3-30b-a3b": QWEN3_30B,
    **{name: {**config, "torch_dtype": "bfloat16"} for name, config in OTHER_SHAPES.items()},
    "gemma-3-4b": GEMMA3_4B,
    "phi-3-mini": PHI3_MINI,
}
MOE = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")


def _engine_bytes(config: ModelConfig) -> tuple[int, int]:
    """(bytes of the parameters a decode step reads, bytes of one expert of one layer) of the engine's own model
    built on the meta device: every parameter (FP8 weights and their scales as the engine holds them) less the
    embedding table unless the LM head is tied to it (the meta model lists a tied tensor once)."""
    params = dict(build_on_meta(config).named_parameters())
    nbytes = {name: p.numel() * p.element_size() for name, p in params.items()}
    total = sum(nbytes.values())
    if not config.tie_word_embeddings:
        total -= nbytes["model.embed_tokens.weight"]
    experts = sum(n for name, n in nbytes.items() if ".experts." in name)
    moe = config.moe
    sparse = 0 if moe is None else sum(moe.is_sparse(i) for i in range(config.num_hidden_layers))
    return total, experts // (sparse * moe.num_experts) if moe is not None else 0


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("shape", list(CONFIGS))
def test_weight_bytes_are_the_engines_parameters(shape: str, quantization: str | None) -> None:
    """A decode step that touches every expert reads exactly the engine's parameters (FP8 experts, scales, routers,
    shared experts, biases, Gemma's four norms and q/k norms, a tied head), embedding table aside."""
    if quantization is not None and shape == "gemma-3-4b":
        pytest.skip("FP8 weights are refused for Gemma 3")
    config = ModelConfig.from_dict(CONFIGS[shape], quantization=quantization)
    assert weight_bytes(config) == _engine_bytes(config)[0]


@pytest.mark.parametrize("shape", MOE)
def test_fp8_experts_touched_are_read_at_one_byte(shape: str) -> None:
    """At 16 sequences a sparse layer reads only the experts they are expected to touch (E (1 - (1 - k/E)^16)),
    each at its FP8 bytes: the engine's parameters less the untouched experts."""
    config = ModelConfig.from_dict(CONFIGS[shape], quantization="fp8")
    total, expert = _engine_bytes(config)
    assert config.moe is not None
    e, k = config.moe.num_experts, config.moe.num_experts_per_tok
    untouched = e * (1 - k / e) ** 16 * config.num_hidden_layers  # every layer of the three is sparse
    assert weight_bytes(config, num_seqs=16) == pytest.approx(total - untouched * expert, rel=1e-9)


def test_qwen3_30b_a3b_fp8_step_by_hand() -> None:
    """The published Qwen3-30B-A3B with quantization="fp8": ~30.55 GB a decode step at 256 sequences (all 128
    experts touched) and ~20.2 GB at 16 (82.4 touched), not the 57.7 / 37.1 GB the bench counted when it took
    dense-MLP shapes off the bf16 total."""
    h, layers, e, inter, vocab = 2048, 48, 128, 768, 151936
    scales = 4 * (6 * 16 + 6 * 16 + 16 * 6)  # float32 128 x 128 blocks of gate (768, 2048), up, down (2048, 768)
    expert = 3 * h * inter + scales  # one byte a weight
    attention = (4096 + 512 + 512) * h + h * 4096 + 4 * (32 * 16 + 4 * 16 + 4 * 16 + 16 * 32)  # q, k, v, o
    vectors = 2 * (2 * h + 2 * 128)  # input / post-attention norms and the q / k norms, bf16
    router, head = 2 * e * h, 2 * (vocab * h + h)  # bf16: router; LM head and final norm
    config = ModelConfig.from_dict(QWEN3_30B, quantization="fp8")
    for seqs, touched in ((256, e * (1 - (1 - 8 / e) ** 256)), (16, e * (1 - (1 - 8 / e) ** 16))):
        expected = layers * (touched * expert + attention + vectors + router) + head
        assert weight_bytes(config, num_seqs=seqs) == pytest.approx(expected, rel=1e-9)
    assert 30.5e9 < weight_bytes(config, num_seqs=256) < 30.6e9
    assert 20.1e9 < weight_bytes(config, num_seqs=16) < 20.3e9


def test_keys_seen_by_hand() -> None:
    """min(context, window) summed over the contexts, counted out."""
    assert keys_seen(3, 6, 4) == 3 + 4 + 4 + 4
    assert keys_seen(5, 8, 4) == 4 * 4
    assert keys_seen(1, 5, None) == 1 + 2 + 3 + 4 + 5
    assert keys_seen(1, 5, 5) == 15 and keys_seen(7, 6, 4) == 0


def test_windowed_layers_read_at_most_their_window() -> None:
    """gemma-3-4b: a sequence of a 2,000-token prompt and 3 outputs reads 1,024 tokens of K/V per output in each of
    the 29 local layers and its whole context (2,000, 2,001, 2,002) in the 5 global ones; Phi-3-mini's 2,047-token
    window on every layer caps a 3,000-token context."""
    gemma = ModelConfig.from_dict(GEMMA3_4B)
    per_layer_token = 2 * 4 * 256 * 2  # K and V, 4 KV heads of 256, bf16
    kv = per_layer_token * (29 * 3 * 1024 + 5 * (2000 + 2001 + 2002))
    expected = (3 * weight_bytes(gemma) + kv) / 1e12
    assert floor_seconds(gemma, [2000], [3], 1.0) == pytest.approx(expected, rel=1e-12)
    phi3 = ModelConfig.from_dict(PHI3_MINI)
    kv = 2 * 32 * 96 * 2 * 32 * (2 * 2047)  # 32 KV heads of 96, 32 layers, two outputs at contexts 3,000 and 3,001
    assert floor_seconds(phi3, [3000], [2], 1.0) == pytest.approx((2 * weight_bytes(phi3) + kv) / 1e12, rel=1e-12)


def test_windowed_attention_flops_by_hand() -> None:
    """At unlimited bandwidth gemma-3-4b's roofline is its FLOPs: a 3,000-token prompt's queries see
    1 + 2 + ... + 1,024 and then 1,024 keys each in the 29 local layers, all earlier keys in the 5 global ones;
    its one output token (context 3,000) sees 1,024 / 3,000 keys; 4 FLOPs a head dimension a key, 8 heads of 256."""
    config = ModelConfig.from_dict(GEMMA3_4B)
    local = 1024 * 1025 // 2 + 1024 * (3000 - 1024)
    prefill_keys = 29 * local + 5 * 3000 * 3001 // 2
    decode_keys = 29 * 1024 + 5 * 3000
    flops = 3001 * flops_per_token(config) + 4 * 8 * 256 * (prefill_keys + decode_keys)
    assert roofline_seconds(config, [3000], [1], UNLIMITED, 100.0) == pytest.approx(flops / 100e12, rel=1e-12)


def test_fp8_moe_experts_multiply_at_the_bf16_peak() -> None:
    """Qwen3-30B-A3B with FP8 weights at unlimited bandwidth, one 1-token prompt and one output: the dense
    attention linears run on FP8 GEMMs at twice the peak; the router, the 8 experts (weight-only FP8, dequantized
    into bf16), the LM head and attention at the peak."""
    config = ModelConfig.from_dict(QWEN3_30B, quantization="fp8")
    h, layers, peak = 2048, 48, 100e12
    dense = 2 * layers * ((4096 + 512 + 512) * h + h * 4096)  # q, k, v, o: FLOPs per token
    bf16 = 2 * layers * (128 * h + 8 * 3 * h * 768) + 2 * 151936 * h  # router, 8 experts; LM head
    attention = 4 * 4096 * layers * (1 + 1)  # the prompt token sees itself; the output token context 1
    expected = 2 * (dense / (2 * peak) + bf16 / peak) + attention / peak  # two tokens through the weights
    assert roofline_seconds(config, [1], [1], UNLIMITED, 100.0) == pytest.approx(expected, rel=1e-12)


def test_qwen2_moe_shared_expert_flops_by_hand() -> None:
    """Qwen1.5-MoE-A2.7B's token FLOPs: attention's 4 x 2,048^2 (16 heads of 128, no GQA), the router's 60 x 2,048,
    4 experts of 3 x 2,048 x 1,408, the shared expert's 3 x 2,048 x 5,632 and its 2,048 -> 1 gate, 24 layers, and
    the LM head; 2 FLOPs a weight."""
    config = ModelConfig.from_dict(CONFIGS["qwen1.5-moe-a2.7b"])
    h = 2048
    layer = 4 * h * h + 60 * h + 4 * 3 * h * 1408 + 3 * h * 5632 + h
    assert flops_per_token(config) == 2 * (24 * layer + 151936 * h)


def test_qwen2_moe_fp8_shared_expert_takes_the_fp8_gemms() -> None:
    """Qwen1.5-MoE-A2.7B with FP8 weights at unlimited bandwidth, one 1-token prompt and one output: its shared
    expert is a dense FP8 MLP (twice the peak, with attention's projections); its gate, the router, the 4 experts
    and the LM head run at the peak."""
    config = ModelConfig.from_dict(CONFIGS["qwen1.5-moe-a2.7b"], quantization="fp8")
    h, layers, peak = 2048, 24, 100e12
    dense = 2 * layers * (4 * h * h + 3 * h * 5632)  # q, k, v, o and the shared expert: FLOPs per token
    bf16 = 2 * layers * (60 * h + h + 4 * 3 * h * 1408) + 2 * 151936 * h  # router, shared gate, 4 experts; LM head
    attention = 4 * h * layers * (1 + 1)  # 16 heads of 128; contexts of 1 token each
    expected = 2 * (dense / (2 * peak) + bf16 / peak) + attention / peak
    assert roofline_seconds(config, [1], [1], UNLIMITED, 100.0) == pytest.approx(expected, rel=1e-12)

"""How the simulator reads each family's config.json: mixtures of experts, sliding-window layers, Gemma 3's fields.

The rules are the engine's (``fnvllm.model.config``, ``fnvllm.model.gemma_config``), restated here because the
simulator imports no torch; tests/test_sim_families.py checks them against the engine's ModelConfig family by
family.

- Experts: ``num_experts`` (Qwen3-MoE, Qwen2-MoE; transformers 5 may write ``num_local_experts``) of
  ``moe_intermediate_size``, or Mixtral's ``num_local_experts`` of ``intermediate_size``; ``num_experts_per_tok``
  each token; layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP; Qwen2-MoE's
  ``shared_expert_intermediate_size`` adds a dense shared expert (and its hidden -> 1 gate) to every sparse layer.
- Sliding windows: Mistral / Mixtral / Phi-3's ``sliding_window`` on every layer; Gemma 3's on its local layers
  (``layer_types``' "sliding_attention", else all but every ``sliding_window_pattern``-th); elsewhere only with
  ``use_sliding_window``, on the layers ``layer_types`` names, else those from ``max_window_layers`` on (Qwen2's
  rule). A window no shorter than max_position_embeddings hides nothing: full attention.
- Gemma 3: the decoder's fields at the top level (Gemma3ForCausalLM) or under ``text_config``
  (Gemma3ForConditionalGeneration), absent ones from transformers' Gemma3TextConfig defaults; tied by default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fnvllm.published import GEMMA3_4B, GEMMA3_TEXT_DEFAULTS, OTHER_SHAPES, QWEN3_COMMON, QWEN3_MOE_SHAPES
from fnvllm.sim.checks import SimInputError, check_count, check_mapping

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
_EVERY_LAYER_WINDOW = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
_MAX_WINDOW_LAYERS_DEFAULT = 28  # transformers' Qwen2Config default


def architecture(config: Mapping[str, Any]) -> str:
    """The config's first ``architectures`` entry ("" without one: the simulator's own configs name none)."""
    names = config.get("architectures")
    return str(names[0]) if isinstance(names, list) and names else ""


def decoder_fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's fields: a Gemma 3's over transformers' defaults (its text_config's for the multimodal one,
    with the top level's dtype and tie, default tied), any other config as it is."""
    arch = architecture(config)
    if arch not in GEMMA3_ARCHITECTURES:
        return config
    text = config.get("text_config") if arch == _GEMMA3_MULTIMODAL else config
    fields = {**GEMMA3_TEXT_DEFAULTS, **check_mapping(text, "config.json text_config")}
    top = config if arch == _GEMMA3_MULTIMODAL else fields
    fields["tie_word_embeddings"] = top.get("tie_word_embeddings", True)
    for key in ("torch_dtype", "dtype"):
        fields[key] = config.get(key) or fields.get(key)
    return fields


def read_experts(fields: Mapping[str, Any], layers: int) -> tuple[int, int, int, int, int]:
    """(experts, experts per token, expert width, shared-expert width, dense layers) of a config (all 0 for a
    dense model; see the module docstring); SimInputError naming a missing or out-of-range key."""
    key = "num_experts" if fields.get("num_experts") is not None else "num_local_experts"
    if fields.get(key) is None:
        return 0, 0, 0, 0, 0
    experts = check_count(fields[key], f"config.json {key}", 1, 1 << 16)
    per_tok = check_count(fields.get("num_experts_per_tok"), "config.json num_experts_per_tok", 1, experts)
    width_key = "moe_intermediate_size" if fields.get("moe_intermediate_size") is not None else "intermediate_size"
    width = check_count(fields.get(width_key), f"config.json {width_key}", 1, 1 << 20)
    shared = fields.get("shared_expert_intermediate_size")
    shared = 0 if shared is None else check_count(shared, "config.json shared_expert_intermediate_size", 1, 1 << 20)
    return experts, per_tok, width, shared, len(_dense_layers(fields, layers))


def _dense_layers(fields: Mapping[str, Any], layers: int) -> list[int]:
    """The layers that keep a dense MLP: those in mlp_only_layers or with (i + 1) % decoder_sparse_step != 0."""
    only = fields.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise SimInputError(f"config.json mlp_only_layers must be a list of layer indices, got {only!r}")
    step = check_count(fields.get("decoder_sparse_step", 1), "config.json decoder_sparse_step", 1, 1 << 20)
    return [i for i in range(layers) if i in only or (i + 1) % step]


def read_window(fields: Mapping[str, Any], arch: str, layers: int, max_len: int) -> tuple[int | None, int]:
    """(sliding window, how many layers attend within it) of a config, (None, 0) without one (see the module
    docstring)."""
    window = fields.get("sliding_window")
    every = arch in _EVERY_LAYER_WINDOW
    if window is None or not (every or arch in GEMMA3_ARCHITECTURES or fields.get("use_sliding_window")):
        return None, 0
    window = check_count(window, "config.json sliding_window", 1, 1 << 40)
    if window >= max_len:
        return None, 0  # it never hides a key
    if every:
        return window, layers
    windowed = _windowed_layers(fields, arch, layers)
    return (window, len(windowed)) if windowed else (None, 0)


def _windowed_layers(fields: Mapping[str, Any], arch: str, layers: int) -> Sequence[int]:
    """The layers ``layer_types`` names "sliding_attention", else Gemma 3's pattern or Qwen2's max_window_layers."""
    types = fields.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise SimInputError(f"config.json layer_types has {len(types)} entries for {layers} layers")
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if arch in GEMMA3_ARCHITECTURES:
        pattern = check_count(fields.get("sliding_window_pattern"), "config.json sliding_window_pattern", 1, 1 << 20)
        return [i for i in range(layers) if (i + 1) % pattern]
    first = fields.get("max_window_layers", _MAX_WINDOW_LAYERS_DEFAULT)
    return list(range(check_count(first, "config.json max_window_layers", 0, 1 << 20), layers))


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Experts a sparse layer is expected to read for ``num_tokens`` tokens routed uniformly at random, top_k each:
    E (1 - (1 - k / E)^n), as ``fnvllm.model.moe.expected_experts_touched`` (Qwen3-30B-A3B: 1 token 8, 16
    tokens 82.4, 256 all 128)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


# Published config.json numbers: the mixtures of experts the bench runs (fnvllm.published's QWEN3_MOE_SHAPES /
# OTHER_SHAPES, which fnvllm.testing.checkpoints writes), gemma-3-1b-it's, gemma-3-4b-it's (fnvllm.published's
# GEMMA3_4B, over transformers' defaults), and microsoft/phi-4's (a Phi3ForCausalLM without a window);
# ``fnvllm.sim.model.NAMED_SHAPES`` holds them beside the dense Qwen3 shapes.
PUBLISHED_SHAPES: Mapping[str, Mapping[str, Any]] = {
    "qwen3-30b-a3b": {**QWEN3_COMMON, **QWEN3_MOE_SHAPES["qwen3-30b-a3b"]},
    "qwen1.5-moe-a2.7b": OTHER_SHAPES["qwen1.5-moe-a2.7b"],
    "mixtral-8x7b": OTHER_SHAPES["mixtral-8x7b"],
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"],
        "torch_dtype": "bfloat16",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    },
    "gemma-3-4b": GEMMA3_4B,
    "phi-4": {
        "architectures": ["Phi3ForCausalLM"],
        "torch_dtype": "bfloat16",
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "vocab_size": 100352,
        "max_position_embeddings": 16384,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}

"""Gemma 3's config.json, read into a ModelConfig (``gemma3_model_config``) with its own facts in a GemmaConfig.

Two architectures carry the same text decoder:

    Gemma3ForCausalLM                 gemma-3-1b-it: the decoder's fields at the top level of config.json
    Gemma3ForConditionalGeneration    gemma-3-4b/12b/27b-it: the decoder's fields under "text_config" (the SigLIP
                                      vision tower's under "vision_config", which fnvllm ignores: text only)

Published configs leave many fields out (gemma-3-4b-it's text_config names only hidden_size, intermediate_size,
num_hidden_layers, rope_scaling and sliding_window), so absent fields take transformers' Gemma3TextConfig defaults
(``TEXT_DEFAULTS``). Two rope formats are read, each giving the global layers' rope (theta and scaling) and the local
layers' (theta only: Gemma 3 never scales it; another rope_type there is refused by name):

    transformers < 5:  "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                       "rope_scaling": {"rope_type": "linear", "factor": 8.0}            (the global layers' scaling)
    transformers >= 5: "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": ...},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

Local (sliding) layers: ``layer_types`` (transformers >= 4.53 writes it), else every layer but each
``sliding_window_pattern``-th (default 6: five local layers, then a global one). Refused by name, since the model
code does not compute them: final_logit_softcapping / attn_logit_softcapping (null in every Gemma 3 checkpoint; the
attention kernels do not cap), use_bidirectional_attention, a hidden_activation other than gelu_pytorch_tanh, and FP8
weights (neither an FP8 checkpoint nor quantization="fp8": not tested for Gemma yet).

The context: max_position_embeddings as stated (131072 on the 4B+ models), not stretched by the linear factor as
other models' linear scaling is (``ModelConfig.max_seq_len``): Gemma's config already states the scaled length (vLLM
reads it so too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
import torch

from fnvllm.model.config import (
    ModelConfig,
    _bool_field,
    _checkpoint_dtype,
    _int_field,
    _optional_int_field,
    _real_field,
    normalize_dtype,
    parse_quantization,
    parse_rope,
)
from fnvllm.published import GEMMA3_TEXT_DEFAULTS

T = TypeVar("T")  # a loader target (sharding.CheckpointTarget)
GEMMA3_ARCHITECTURES: tuple[str, ...] = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("gelu_pytorch_tanh",)  # gelu, tanh approximation (transformers' name)
_LAYER_TYPES = ("full_attention", "sliding_attention")
TEXT_DEFAULTS = GEMMA3_TEXT_DEFAULTS  # transformers' Gemma3TextConfig defaults (fnvllm.published)


@attrs.frozen
class GemmaConfig:
    """What a Gemma 3 decoder adds to ModelConfig's facts (``ModelConfig.gemma``; None for every other model).

    query_pre_attn_scalar: the attention scale is query_pre_attn_scalar ** -0.5 (256 on every Gemma 3, where
        head_dim is 256 too on the 1B; 168 on the 27B, whose head_dim is 128).
    rope_local_theta: the rope base of the local (sliding_attention) layers, never scaled (10000); the global layers
        use ModelConfig.rope_theta and rope_scaling.
    local_layers: the indices of the sliding_attention layers (their rope is the local one; their window is
        ModelConfig.sliding_window, which ModelConfig.sliding_layers names when there is one).
    """

    query_pre_attn_scalar: float
    rope_local_theta: float
    local_layers: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        """Reject a non-positive scalar or theta, naming the field."""
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def attention_scale(self) -> float:
        """The factor of q . k in the attention softmax: query_pre_attn_scalar ** -0.5."""
        return float(self.query_pre_attn_scalar**-0.5)  # as transformers computes it


def gemma3_model_config(
    hf: Mapping[str, Any], architecture: str, dtype: str | torch.dtype | None, quantization: str | None
) -> ModelConfig:
    """The ModelConfig of a Gemma 3 config.json (see the module docstring); ValueError naming the field for anything
    missing, mistyped or unsupported."""
    text = _text_fields(hf, architecture)
    _reject_unsupported(text, hf, quantization)
    num_layers = _int_field(text, "num_hidden_layers")
    max_positions = _int_field(text, "max_position_embeddings")
    (rope_theta, rope_scaling), local_theta = _global_rope(text, max_positions), _local_theta(text)
    local_layers = _local_layers(text, num_layers)
    window = _optional_int_field(text, "sliding_window")
    bias = _bool_field(text, "attention_bias", False)
    tie_source = hf if architecture == GEMMA3_MULTIMODAL else text  # transformers ties by the top-level config's
    return ModelConfig(
        architecture=architecture,
        hidden_size=_int_field(text, "hidden_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=_int_field(text, "num_attention_heads"),
        num_key_value_heads=_int_field(text, "num_key_value_heads"),
        head_dim=_int_field(text, "head_dim"),
        intermediate_size=_int_field(text, "intermediate_size"),
        vocab_size=_int_field(text, "vocab_size"),
        rms_norm_eps=_real_field(text, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=_bool_field(tie_source, "tie_word_embeddings", True),
        dtype=normalize_dtype(dtype if dtype is not None else _gemma_dtype(hf, text)),
        attention_bias=bias,
        o_proj_bias=bias,  # transformers' Gemma3Attention gives o_proj the same bias flag
        qk_norm=True,
        sliding_window=window,
        sliding_layers=() if window is None else local_layers,
        gemma=GemmaConfig(_real_field(text, "query_pre_attn_scalar", None), local_theta, local_layers),
    )


def _text_fields(hf: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The decoder's fields (top level, or text_config for the multimodal architecture) over TEXT_DEFAULTS for the
    absent ones (an explicit null stays null: the field's reader decides what it means)."""
    source = hf.get("text_config") if architecture == GEMMA3_MULTIMODAL else hf
    if not isinstance(source, Mapping):
        raise ValueError(f"text_config must be an object (the decoder's fields), got {source!r}")
    return {**TEXT_DEFAULTS, **source}


def _reject_unsupported(text: Mapping[str, Any], hf: Mapping[str, Any], quantization: str | None) -> None:
    """Raise, naming the field, for options the Gemma model code does not compute."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if text.get(name) is not None:
            raise ValueError(f"{name} {text[name]!r} is not supported (only null: the attention kernels do not cap)")
    if _bool_field(text, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported (fnvllm's attention is causal)")
    if text.get("hidden_activation") not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"hidden_activation {text.get('hidden_activation')!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}"
        )
    if parse_quantization(hf, quantization) is not None:
        raise ValueError("FP8 weights (quantization_config, or quantization='fp8') are not supported for Gemma 3 yet")


def _global_rope(text: Mapping[str, Any], max_positions: int) -> tuple[float, Any]:
    """(rope_theta, rope_scaling) of the global (full_attention) layers, from either format."""
    params = text.get("rope_parameters")
    if params is None:
        return parse_rope({"rope_theta": text["rope_theta"], "rope_scaling": text.get("rope_scaling")}, max_positions)
    try:
        return parse_rope({"rope_parameters": _rope_entry(params, "full_attention")}, max_positions)
    except ValueError as e:
        raise ValueError(f"rope_parameters.full_attention: {e}") from None


def _local_theta(text: Mapping[str, Any]) -> float:
    """The local (sliding_attention) layers' rope base, from either format; a scaled local rope is refused."""
    params = text.get("rope_parameters")
    if params is None:
        return _real_field(text, "rope_local_base_freq", None)
    entry = _rope_entry(params, "sliding_attention")
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_parameters.sliding_attention rope_type {kind!r} is not supported; supported: 'default'")
    return _real_field(entry, "rope_theta", TEXT_DEFAULTS["rope_local_base_freq"])


def _rope_entry(params: Any, layer_type: str) -> Mapping[str, Any]:
    """rope_parameters[layer_type], the dict of one layer type (transformers 5 nests them so for Gemma 3)."""
    entry = params.get(layer_type) if isinstance(params, Mapping) else None
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"rope_parameters must map each of {_LAYER_TYPES} to its rope dict, got {params!r} (no {layer_type!r})"
        )
    return entry


def _local_layers(text: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The sliding_attention layers: layer_types' when given (one of _LAYER_TYPES per layer), else every layer i
    with (i + 1) % sliding_window_pattern != 0 (transformers' rule; pattern a positive int, default 6)."""
    types = text.get("layer_types")
    if types is None:
        pattern = _int_field(text, "sliding_window_pattern")
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must be a list of {num_layers} entries of {_LAYER_TYPES}, got {types!r}")
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _gemma_dtype(hf: Mapping[str, Any], text: Mapping[str, Any]) -> str:
    """The checkpoint's dtype: config.json's top-level one, else text_config's, else float32."""
    return hf.get("dtype") or hf.get("torch_dtype") or _checkpoint_dtype(text)


# Gemma3ForConditionalGeneration's checkpoint layouts: (decoder prefix, head name, the vision tensors' prefixes).
# The published one (gemma-3-4b-it: language_model.model.layers.0.mlp.down_proj.weight, vision_tower.*,
# multi_modal_projector.*; transformers 5 saves it so too) first, then transformers 4.52-4.x's.
_MULTIMODAL_LAYOUTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("language_model.model.", "language_model.lm_head.weight", ("vision_tower.", "multi_modal_projector.")),
    ("model.language_model.", "lm_head.weight", ("model.vision_tower.", "model.multi_modal_projector.")),
)


def language_model_names(
    targets: Mapping[str, T], names_by_file: Mapping[Any, list[str]], tied: bool
) -> tuple[dict[str, T], set[str]]:
    """(targets, ignored names) of a Gemma3ForConditionalGeneration checkpoint for the loader: ``targets`` (keyed
    ``model.<name>`` / ``lm_head.weight``, as a Gemma3ForCausalLM stores them) renamed into the layout whose decoder
    prefix the stored names use (the published one when neither is found, so the mismatch error lists its names),
    and the stored names to skip: exactly that layout's vision tower and projector tensors, and its head when
    ``tied``. Any other stored name stays an unexpected tensor."""
    stored = [name for names in names_by_file.values() for name in names]
    layouts = [layout for layout in _MULTIMODAL_LAYOUTS if any(n.startswith(layout[0]) for n in stored)]
    prefix, head, vision = (layouts or _MULTIMODAL_LAYOUTS)[0]
    renamed = {
        (head if name == "lm_head.weight" else prefix + name.removeprefix("model.")): target
        for name, target in targets.items()
    }
    ignored = {n for n in stored if n.startswith(vision)} | ({head} if tied else set())
    return renamed, ignored

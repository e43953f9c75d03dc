"""ModelConfig: the facts about a decoder checkpoint that the model code needs, read from its config.json.

Two rope formats exist in the wild and both are read:

    transformers < 5:  "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}
    transformers >= 5: "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, ...}

rope_type "default", "llama3", "linear", "yarn", "dynamic" and "longrope" load (``parse_rope``; the frequencies each
gives are in ``fnvllm.model.rope``); the rest are refused by name. A longrope checkpoint is served up to its
original_max_position_embeddings only (``LongRopeScaling`` says why): a longer ``max_model_len`` is refused by name.
A yarn or linear one is served as far as it stretches the context (``ModelConfig.max_seq_len``).

End-of-sequence ids are not here: the LLM layer reads them from generation_config.json.

FP8 weights (``Fp8Config``): a checkpoint whose config.json carries the official block-quantized
``quantization_config`` ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}) is loaded in FP8 whatever the engine's ``quantization`` option says; any other
``quant_method`` (awq, gptq, ...) is refused. ``quantization="fp8"`` on a 16/32-bit checkpoint quantizes it at load.

Mistral and Mixtral are read as Llama (no q/k norms, no biases; ``head_dim`` may differ from hidden / heads, as in
Mistral-Nemo) and, for Mixtral, a ``MoeConfig`` (``MoeConfig.from_mixtral``). Their ``sliding_window`` applies to
every layer (Mistral-7B-v0.1: 4096): the query at position i sees key j iff 0 <= i - j < sliding_window.

Sliding windows elsewhere: Qwen2's config.json carries a ``sliding_window`` that applies only with
``use_sliding_window`` true, and then to the layers ``layer_types`` names "sliding_attention" (transformers 5 writes
that list), else to the layers from ``max_window_layers`` on (transformers' rule for Qwen2; default 28).
``ModelConfig.layer_window`` gives each layer's window. use_sliding_window on another architecture is refused by name
(Qwen2-MoE and Qwen3 pick their sliding layers by other rules).

Phi-3 (``Phi3ForCausalLM``: Phi-3-mini / medium, Phi-3.5-mini, Phi-4) is read as Llama: no biases anywhere (its
attention hard-codes none), ``rms_norm_eps`` default 1e-5, ``sliding_window`` on every layer as Mistral's
(Phi-3-mini-4k: 2047), ``resid_pdrop`` / ``embd_pdrop`` / ``attention_dropout`` ignored (training only). Its rope
follows transformers' Phi3Config: rope_type "su" or "yarn" (older Phi-3 configs) means "longrope", whose
``original_max_position_embeddings`` is config.json's top-level field (default 4096). Its fused checkpoint tensors
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``) are split by the loader; FP8 checkpoints of it are refused (16-bit
ones load with quantization="fp8"). ``partial_rotary_factor`` (Phi-4-mini's 0.75) is refused, as for every model.

Gemma 3 (``Gemma3ForCausalLM``; the text decoder of ``Gemma3ForConditionalGeneration``) is read by
``fnvllm.model.gemma_config`` (its text_config, two rope tables, layer types), with its own facts in
``ModelConfig.gemma``.

Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) is read as Qwen2 (q/k/v biases, ``qkv_bias`` in transformers 5's
config.json, absent and true in the published ones) with a ``MoeConfig`` (``MoeConfig.from_qwen2_moe``): Qwen3-MoE's
fields plus ``shared_expert_intermediate_size``, the width of the dense shared expert every sparse layer adds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from fnvllm.model.rope import (
    DynamicNtkRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    RopeScaling,
    YarnRopeScaling,
    longrope_attention_factor,
    served_positions,
    yarn_attention_factor,
)

if TYPE_CHECKING:  # gemma_config imports this module's field readers
    from fnvllm.model.gemma_config import GemmaConfig


class CheckpointError(ValueError):
    """A checkpoint folder's file is missing, unreadable or malformed; the message names the file and what is
    wrong with it."""


def read_json(file: Path, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in ``file``; CheckpointError naming the file when it cannot be read, is not valid JSON
    (with the line and column), or is not an object."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read ({e})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected {what}, got a JSON {type(value).__name__}")
    return value


SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "Qwen3MoeForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")  # gemma_config.GEMMA3_ARCHITECTURES
_QWEN3_LIKE = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_QWEN2_LIKE = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # q/k/v biases, never an o_proj bias
_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
_SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")  # on all layers
_PHI3 = "Phi3ForCausalLM"
_PHI3_RMS_NORM_EPS = 1e-5  # transformers' Phi3Config defaults
_PHI3_ORIGINAL_MAX_POSITIONS = 4096
_PHI3_LONGROPE_ALIASES = ("su", "yarn")  # rope types older Phi-3 configs wrote for longrope
_USE_SLIDING_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM",)  # sliding_window on some layers, with use_sliding_window
_LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types entries
_MAX_WINDOW_LAYERS_DEFAULT = 28  # transformers' Qwen2Config default
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
SUPPORTED_QUANT_METHODS: tuple[str, ...] = ("fp8",)
FP8_BLOCK = 128  # rows and columns of one FP8 weight scale block


@attrs.frozen
class Fp8Config:
    """FP8 weights: every linear of the decoder layers (q/k/v/o, gate/up/down, a MoE model's experts and shared
    expert) in float8_e4m3fn with one float32 scale per 128 x 128 block; embeddings, norms, MoE routers and the LM
    head keep the model dtype.

    is_checkpoint_fp8: the checkpoint stores them so (``<m>.weight`` e4m3 + ``<m>.weight_scale_inv``); False: it
        stores 16/32-bit weights and the loader quantizes each linear as it reads it (same block layout).
    """

    is_checkpoint_fp8: bool


def parse_quantization(hf: Mapping[str, Any], quantization: str | None) -> Fp8Config | None:
    """The FP8 settings of a config.json under the engine's ``quantization`` option (None or "fp8"); ValueError
    naming the field for a quantization_config this engine cannot load."""
    qc = _mapping_field(hf, "quantization_config")
    if not qc:
        return None if quantization is None else Fp8Config(is_checkpoint_fp8=False)
    method = qc.get("quant_method")
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED_QUANT_METHODS} "
            "(block-quantized FP8 checkpoints, or quantization='fp8' on a 16/32-bit checkpoint)"
        )
    expected = {"fmt": ("e4m3", None), "activation_scheme": ("dynamic", None)}
    for name, allowed in expected.items():
        if qc.get(name) not in allowed:
            raise ValueError(f"quantization_config.{name} {qc.get(name)!r} is not supported; supported: {allowed[0]!r}")
    if qc.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(
            f"quantization_config.weight_block_size {qc.get('weight_block_size')!r} is not supported; "
            f"supported: [{FP8_BLOCK}, {FP8_BLOCK}] (per-tensor and per-channel FP8 checkpoints are not)"
        )
    _check_unconverted(qc)
    return Fp8Config(is_checkpoint_fp8=True)


# Modules an FP8 checkpoint may list as left unquantized: those fnvllm never quantizes. Qwen3-30B-A3B-FP8 lists
# lm_head and every layer's input_layernorm, post_attention_layernorm and mlp.gate (the MoE router).
_NEVER_FP8 = ("lm_head", "embed_tokens", "gate", "shared_expert_gate")


def _is_never_fp8(name: object) -> bool:
    """Whether module ``name`` is one fnvllm keeps in the model dtype anyway: lm_head, embed_tokens, a norm, a MoE
    router (``mlp.gate``, Mixtral's ``block_sparse_moe.gate``) or Qwen2-MoE's ``shared_expert_gate``."""
    leaf = name.split(".")[-1] if isinstance(name, str) else ""
    return leaf in _NEVER_FP8 or leaf.endswith("norm")


def _check_unconverted(qc: Mapping[str, Any]) -> None:
    """Refuse a checkpoint that leaves some decoder-layer linears unquantized (listing lm_head, the norms or the
    MoE routers is fine: we never quantize them)."""
    for field in ("modules_to_not_convert", "ignored_layers"):
        names = qc.get(field) or []
        if not isinstance(names, list):
            raise ValueError(f"quantization_config.{field} must be a list of module names, got {names!r}")
        kept = [n for n in names if not _is_never_fp8(n)]
        if kept:
            raise ValueError(
                f"quantization_config.{field} {kept[:8]!r} is not supported: every decoder-layer linear must be FP8 "
                "(only lm_head, embed_tokens, norms and MoE routers (mlp.gate, shared_expert_gate) may be listed)"
            )


_DTYPE_ALIASES: Mapping[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
}


@attrs.frozen
class MoeConfig:
    """The mixture-of-experts facts of a Qwen3-MoE, Mixtral or Qwen2-MoE checkpoint.

    num_experts: routed experts per sparse layer. num_experts_per_tok: experts each token is sent to (top-k).
    moe_intermediate_size: each expert's intermediate width (the dense layers use ModelConfig.intermediate_size).
    norm_topk_prob: renormalise the top-k softmax probabilities to sum to 1.
    mlp_only_layers / decoder_sparse_step: Hugging Face's rule for which layers keep a dense MLP (``is_sparse``).
    shared_expert_intermediate_size: Qwen2-MoE's shared expert, a dense SwiGLU MLP of this width that every token of
        a sparse layer goes through, scaled by sigmoid(shared_expert_gate(x)) and added to the routed experts'
        output; None: no shared expert (Qwen3-MoE, Mixtral).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    shared_expert_intermediate_size: int | None = None

    def __attrs_post_init__(self) -> None:
        """Reject expert counts and layer rules the model code cannot build, naming the field."""
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            _check_positive(name, getattr(self, name))
        if self.shared_expert_intermediate_size is not None:
            _check_positive("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts ({self.num_experts})"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) routes to experts (else it has a dense MLP), as HF decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, hf: Mapping[str, Any]) -> MoeConfig:
        """Read the MoE fields of an HF config.json (``num_experts``, or ``num_local_experts`` as transformers 5
        writes it)."""
        key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
        layers = hf.get("mlp_only_layers") or []
        if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise ValueError(f"mlp_only_layers must be a list of layer indices, got {layers!r}")
        return cls(
            num_experts=_int_field(hf, key),
            num_experts_per_tok=_int_field(hf, "num_experts_per_tok"),
            moe_intermediate_size=_int_field(hf, "moe_intermediate_size"),
            norm_topk_prob=_bool_field(hf, "norm_topk_prob", False),
            mlp_only_layers=tuple(layers),
            decoder_sparse_step=_int_field(hf, "decoder_sparse_step", 1),
        )

    @classmethod
    def from_mixtral(cls, hf: Mapping[str, Any]) -> MoeConfig:
        """Read a Mixtral config.json: ``num_local_experts`` experts of ``intermediate_size`` in every layer, top-k
        weights always renormalised (HF's MixtralTopKRouter divides them by their sum; it has no norm_topk_prob)."""
        return cls(
            num_experts=_int_field(hf, "num_local_experts"),
            num_experts_per_tok=_int_field(hf, "num_experts_per_tok"),
            moe_intermediate_size=_int_field(hf, "intermediate_size"),
            norm_topk_prob=True,
        )

    @classmethod
    def from_qwen2_moe(cls, hf: Mapping[str, Any]) -> MoeConfig:
        """Read a Qwen2-MoE config.json: Qwen3-MoE's fields (``from_dict``; Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B
        keep ``norm_topk_prob`` false: the top-k weights are not renormalised) and the required
        ``shared_expert_intermediate_size``."""
        shared = _int_field(hf, "shared_expert_intermediate_size")
        return attrs.evolve(cls.from_dict(hf), shared_expert_intermediate_size=shared)


@attrs.frozen
class ModelConfig:
    """Static facts about a Qwen3 / Qwen3-MoE / Qwen2 / Qwen2-MoE / Llama / Mistral / Mixtral / Phi-3 decoder checkpoint
    (never written after construction).

    architecture: one of SUPPORTED_ARCHITECTURES.
    head_dim: per-head width (config's head_dim, else hidden_size // num_attention_heads).
    rope_scaling: None for plain rope, else the checkpoint's scaling kind and its parameters (``fnvllm.model.rope``).
    dtype: torch dtype name the weights are used in ("float32", "bfloat16" or "float16").
    attention_bias: whether q/k/v projections carry a bias (Qwen2: always; Qwen2-MoE: its qkv_bias, default true).
    o_proj_bias: whether the output projection carries a bias (Llama/Qwen3 with attention_bias; never Qwen2(-MoE)).
    qk_norm: per-head RMSNorm of q and k before rope (Qwen3).
    moe: the experts of a mixture-of-experts model (Qwen3-MoE, Mixtral, Qwen2-MoE); None for a dense one.
    quantization: FP8 weights (``Fp8Config``), from the checkpoint or quantized at load; None = ``dtype`` weights.
    sliding_window: the attention window in tokens of the layers in sliding_layers (None: no window anywhere):
        Mistral / Mixtral's, or Qwen2's with use_sliding_window (see the module docstring).
    sliding_layers: the indices of the layers that attend within sliding_window (every layer for Mistral /
        Mixtral); empty without a window. Each layer's window: ``layer_window``.
    gemma: Gemma 3's own facts (``gemma_config.GemmaConfig``: attention scale, local rope, local layers); given for
        the Gemma 3 architectures and only for them.
    """

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    moe: MoeConfig | None = None
    quantization: Fp8Config | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    gemma: GemmaConfig | None = None

    def __attrs_post_init__(self) -> None:
        """Reject shapes the model code cannot build, naming the field."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            _check_positive(name, getattr(self, name))
        for name in ("head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; supported: {SUPPORTED_DTYPES}")
        if (self.architecture in _MOE_ARCHITECTURES) != (self.moe is not None):
            raise ValueError(f"moe must be given for {_MOE_ARCHITECTURES} and only for them (got {self.architecture})")
        has_shared = self.moe is not None and self.moe.shared_expert_intermediate_size is not None
        if has_shared != (self.architecture == "Qwen2MoeForCausalLM"):
            raise ValueError(f"a shared expert is Qwen2MoeForCausalLM's and only its (got {self.architecture})")
        if self.sliding_window is not None:
            _check_positive("sliding_window", self.sliding_window)
        self._check_sliding_layers()
        self._check_longrope()
        if (self.architecture in _GEMMA3) != (self.gemma is not None):
            raise ValueError(f"gemma must be given for {_GEMMA3} and only for them (got {self.architecture})")
        if self.architecture == _PHI3 and self.quantization is not None and self.quantization.is_checkpoint_fp8:
            raise ValueError(
                "FP8 checkpoints (quantization_config) of Phi3ForCausalLM are not supported (their fused qkv_proj / "
                "gate_up_proj scales are not split); quantization='fp8' on its 16-bit checkpoint is"
            )

    def _check_longrope(self) -> None:
        """Reject longrope factor lists that do not give one factor per rotary pair (head_dim / 2), naming them."""
        scaling = self.rope_scaling
        if not isinstance(scaling, LongRopeScaling):
            return
        for name in ("short_factor", "long_factor"):
            if len(getattr(scaling, name)) != self.head_dim // 2:
                raise ValueError(
                    f"longrope's {name} has {len(getattr(scaling, name))} entries; it needs one per rotary pair, "
                    f"head_dim / 2 = {self.head_dim // 2}"
                )

    def _check_sliding_layers(self) -> None:
        """Reject sliding_layers that are not distinct increasing layer indices, or given without a window."""
        layers = self.sliding_layers
        if layers and self.sliding_window is None:
            raise ValueError(f"sliding_layers {layers} need a sliding_window")
        in_range = all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in layers)
        if not in_range or list(layers) != sorted(set(layers)):
            raise ValueError(
                f"sliding_layers must be increasing layer indices in [0, {self.num_hidden_layers}), got {layers}"
            )

    def layer_window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding window in tokens (its query at position i sees key j iff
        0 <= i - j < window), or None for full attention: layers outside sliding_layers, and a window no shorter
        than max_seq_len (the engine's max model length is no longer, so it never hides a key)."""
        window = self.sliding_window
        if window is None or window >= self.max_seq_len or layer not in self.sliding_layers:
            return None
        return window

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + output) the model serves: max_position_embeddings, or further where its
        rope scaling stretches the context (yarn: original_max_position_embeddings x factor; linear:
        max_position_embeddings x factor; ``fnvllm.model.rope.served_positions``). The rope table's length, and
        the engine's default and cap for max_model_len. Gemma 3: max_position_embeddings, which already states
        the context its linear factor reaches (gemma-3-4b-it: 131072 with factor 8)."""
        if self.gemma is not None:
            return self.max_position_embeddings
        return served_positions(self.rope_scaling, self.max_position_embeddings)

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layer attends within a sliding window (the attention backend must support it)."""
        return any(self.layer_window(i) is not None for i in self.sliding_layers)

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes tokens to experts (False for every layer of a dense model)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `dtype`."""
        return getattr(torch, self.dtype)

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads together."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype | None = None,
        quantization: str | None = None,
        max_model_len: int | None = None,
    ) -> ModelConfig:
        """Read `path`/config.json; `dtype` overrides the checkpoint's dtype; quantization="fp8" quantizes a
        16/32-bit checkpoint's linears at load (an FP8 checkpoint is FP8 either way); `max_model_len`: the engine's
        max model length, checked only for longrope checkpoints (at most their original_max_position_embeddings:
        ``LongRopeScaling``; sliding windows of any length are attended within, ``layer_window``). A missing
        file is FileNotFoundError; a malformed one (bad JSON, a missing or mistyped field, an unsupported model) is
        CheckpointError naming the file and the field."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint folder {str(path)!r}")
        hf = read_json(config_file)
        try:
            return cls.from_dict(hf, dtype=dtype, quantization=quantization, max_model_len=max_model_len)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{config_file}: {e}") from None

    @classmethod
    def from_dict(
        cls,
        hf: Mapping[str, Any],
        dtype: str | torch.dtype | None = None,
        quantization: str | None = None,
        max_model_len: int | None = None,
    ) -> ModelConfig:
        """Build from a parsed HF config.json; `dtype` overrides the checkpoint's dtype; `quantization` and
        `max_model_len` as in ``from_pretrained``. Raises ValueError naming the field for anything missing,
        mistyped (a str where a number belongs, a bool where an int belongs) or unsupported."""
        architecture = _architecture(hf)
        if architecture in _GEMMA3:  # its own fields and defaults (gemma_config imports this module)
            from fnvllm.model.gemma_config import gemma3_model_config

            return gemma3_model_config(hf, architecture, dtype, quantization)
        _reject_unsupported_features(hf)
        hidden_size = _int_field(hf, "hidden_size")
        num_heads = _int_field(hf, "num_attention_heads")
        max_positions = _int_field(hf, "max_position_embeddings")
        rope_theta, rope_scaling = parse_rope(_phi3_rope_fields(hf) if architecture == _PHI3 else hf, max_positions)
        _check_served_len(rope_scaling, max_model_len)
        attention_bias = _attention_bias(hf, architecture)
        num_layers = _int_field(hf, "num_hidden_layers")
        sliding_window, sliding_layers = _sliding_window(hf, architecture, num_layers)
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=_int_field(hf, "num_key_value_heads", num_heads),
            head_dim=_int_field(hf, "head_dim", hidden_size // num_heads),
            intermediate_size=_int_field(hf, "intermediate_size"),
            vocab_size=_int_field(hf, "vocab_size"),
            rms_norm_eps=_real_field(hf, "rms_norm_eps", _PHI3_RMS_NORM_EPS if architecture == _PHI3 else 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=_bool_field(hf, "tie_word_embeddings", False),
            dtype=normalize_dtype(dtype if dtype is not None else _checkpoint_dtype(hf)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and architecture not in _QWEN2_LIKE,
            qk_norm=architecture in _QWEN3_LIKE,
            moe=_moe_config(hf, architecture),
            quantization=parse_quantization(hf, quantization),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
        )


def _phi3_rope_fields(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Phi-3 config.json's rope dict as transformers' Phi3Config reads it: rope_type "su" or "yarn" is "longrope",
    whose original_max_position_embeddings is the top-level field (default 4096) over the dict's own."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(key)
    if not isinstance(params, Mapping):
        return hf  # no scaling, or a malformed one that parse_rope names
    kind = params.get("rope_type", params.get("type"))
    if kind not in ("longrope", *_PHI3_LONGROPE_ALIASES):
        return hf
    original = _int_field(hf, "original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITIONS)
    return {**hf, key: {**params, "rope_type": "longrope", "original_max_position_embeddings": original}}


def _check_served_len(scaling: RopeScaling | None, max_model_len: int | None) -> None:
    """Refuse a max_model_len longer than a longrope checkpoint's original_max_position_embeddings, saying why."""
    if not isinstance(scaling, LongRopeScaling) or max_model_len is None:
        return
    original = scaling.original_max_position_embeddings
    if max_model_len > original:
        raise ValueError(
            f"max_model_len ({max_model_len}) must be <= original_max_position_embeddings ({original}) for a "
            "longrope checkpoint: fnvllm serves it with short_factor only, exactly as transformers does up to that "
            "length; past it transformers rotates the whole sequence with long_factor, which a paged KV cache "
            "(keys already rotated) cannot follow"
        )


def _sliding_window(hf: Mapping[str, Any], architecture: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, sliding_layers) of a config.json (see the module docstring): Mistral / Mixtral / Phi-3's window
    on every layer; Qwen2's with use_sliding_window on its sliding layers (``_qwen2_sliding_layers``); none otherwise,
    and use_sliding_window true on another architecture is a ValueError naming it."""
    if architecture in _SLIDING_WINDOW_ARCHITECTURES:
        window = _optional_int_field(hf, "sliding_window")
        return window, () if window is None else tuple(range(num_layers))
    if not _bool_field(hf, "use_sliding_window", False):
        return None, ()  # a sliding_window alone means nothing (transformers drops it)
    if architecture not in _USE_SLIDING_WINDOW_ARCHITECTURES:
        raise ValueError(
            f"use_sliding_window=True is not supported for {architecture}; supported: "
            f"{_USE_SLIDING_WINDOW_ARCHITECTURES} (and Mistral / Mixtral's sliding_window)"
        )
    window = _optional_int_field(hf, "sliding_window")
    return window, () if window is None else _qwen2_sliding_layers(hf, num_layers)


def _qwen2_sliding_layers(hf: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers config.json's ``layer_types`` names "sliding_attention" when it has the list (one of _LAYER_TYPES
    per layer), else layers max_window_layers .. num_layers - 1 (max_window_layers an int >= 0, default 28)."""
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", _MAX_WINDOW_LAYERS_DEFAULT)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"max_window_layers must be an int >= 0, got {first!r}")
        return tuple(range(first, num_layers))
    if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must be a list of {num_layers} entries of {_LAYER_TYPES}, got {types!r}")
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _attention_bias(hf: Mapping[str, Any], architecture: str) -> bool:
    """Whether q/k/v carry biases: always for Qwen2 (HF's Qwen2Attention hard-codes them), never for Phi-3 (its
    Phi3Attention hard-codes none), ``qkv_bias`` (default true, as HF's Qwen2MoeConfig) for Qwen2-MoE,
    ``attention_bias`` (default false) for the others."""
    if architecture == "Qwen2ForCausalLM":
        return True
    if architecture == _PHI3:
        return False
    if architecture == "Qwen2MoeForCausalLM":
        return _bool_field(hf, "qkv_bias", True)
    return _bool_field(hf, "attention_bias", False)


def _moe_config(hf: Mapping[str, Any], architecture: str) -> MoeConfig | None:
    """The MoE settings of a Qwen3-MoE, Mixtral or Qwen2-MoE config.json (each names its fields its own way); None
    for a dense model."""
    if architecture == "Qwen3MoeForCausalLM":
        return MoeConfig.from_dict(hf)
    if architecture == "MixtralForCausalLM":
        return MoeConfig.from_mixtral(hf)
    if architecture == "Qwen2MoeForCausalLM":
        return MoeConfig.from_qwen2_moe(hf)
    return None


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """Canonical dtype name: torch.bfloat16 / "bf16" / "torch.bfloat16" -> "bfloat16"."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: {SUPPORTED_DTYPES}")
    return name


def parse_rope(hf: Mapping[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either rope format (see the module docstring); None for plain rope. A
    rope_type outside SUPPORTED_ROPE_TYPES, or a missing or invalid field of a supported one, is a ValueError
    naming the dict and the field, e.g. "rope_scaling (rope_type 'yarn'): factor must be a positive number"."""
    source = "rope_parameters"
    params = _flat_rope_parameters(_mapping_field(hf, source))
    if not params:
        source = "rope_scaling"
        params = dict(_mapping_field(hf, source))
    rope_theta = _real_field(params, "rope_theta", _real_field(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor") not in (None, 1.0):
        raise ValueError(
            f"{source}.partial_rotary_factor {params['partial_rotary_factor']!r} is not supported; supported: 1.0"
        )
    if rope_type == "default":
        return rope_theta, None
    parser = _ROPE_PARSERS.get(rope_type) if isinstance(rope_type, str) else None
    if parser is None:
        raise ValueError(f"{source} rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    try:
        return rope_theta, parser(params, max_position_embeddings)
    except KeyError as e:
        raise ValueError(f"{source} (rope_type {rope_type!r}) is missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ValueError(f"{source} (rope_type {rope_type!r}): {e}") from None


def _llama3_scaling(params: Mapping[str, Any], max_position_embeddings: int) -> Llama3RopeScaling:
    """Llama 3.1's fields: factor, low_freq_factor, high_freq_factor (required), original_max_position_embeddings
    (default max_position_embeddings, as transformers fills it)."""
    return Llama3RopeScaling(
        factor=_real_field(params, "factor", None),
        low_freq_factor=_real_field(params, "low_freq_factor", None),
        high_freq_factor=_real_field(params, "high_freq_factor", None),
        original_max_position_embeddings=_int_field(
            params, "original_max_position_embeddings", max_position_embeddings
        ),
    )


def _linear_scaling(params: Mapping[str, Any], max_position_embeddings: int) -> LinearRopeScaling:
    """Linear scaling's one required field, factor."""
    return LinearRopeScaling(factor=_real_field(params, "factor", None))


def _dynamic_scaling(params: Mapping[str, Any], max_position_embeddings: int) -> DynamicNtkRopeScaling:
    """Dynamic NTK's one required field, factor (plain rope up to max_position_embeddings: see fnvllm.model.rope)."""
    return DynamicNtkRopeScaling(factor=_real_field(params, "factor", None))


def _yarn_scaling(params: Mapping[str, Any], max_position_embeddings: int) -> YarnRopeScaling:
    """YaRN's fields with transformers' defaults: original_max_position_embeddings (max_position_embeddings); factor
    (required; null: max_position_embeddings / original, as for DeepSeek-V3); attention_factor (from factor,
    mscale and mscale_all_dim); beta_fast 32 and beta_slow 1 (also when 0 or null); truncate true."""
    original = _int_field(params, "original_max_position_embeddings", max_position_embeddings)
    if "factor" in params and params["factor"] is None:
        factor = max_position_embeddings / original
    else:
        factor = _real_field(params, "factor", None)  # KeyError when absent: a required field
    attention_factor = _optional_real_field(params, "attention_factor")
    if attention_factor is None:
        mscales = (_optional_real_field(params, "mscale"), _optional_real_field(params, "mscale_all_dim"))
        attention_factor = yarn_attention_factor(factor, *mscales)
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
        beta_fast=_optional_real_field(params, "beta_fast") or 32.0,
        beta_slow=_optional_real_field(params, "beta_slow") or 1.0,
        truncate=_bool_field(params, "truncate", True),
    )


def _longrope_scaling(params: Mapping[str, Any], max_position_embeddings: int) -> LongRopeScaling:
    """LongRoPE's fields with transformers' defaults: short_factor and long_factor (required lists of positive
    numbers), original_max_position_embeddings (max_position_embeddings; Phi-3's comes from its top-level field,
    ``_phi3_rope_fields``), attention_factor (from factor, itself max_position_embeddings / original when absent)."""
    original = _int_field(params, "original_max_position_embeddings", max_position_embeddings)
    factor = _optional_real_field(params, "factor")
    attention_factor = _optional_real_field(params, "attention_factor")
    if attention_factor is None:
        stretch = max_position_embeddings / original if factor is None else factor
        attention_factor = longrope_attention_factor(stretch, original)
    return LongRopeScaling(
        short_factor=_factor_list(params, "short_factor"),
        long_factor=_factor_list(params, "long_factor"),
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
    )


def _factor_list(params: Mapping[str, Any], name: str) -> tuple[float, ...]:
    """params[name] (required) as a tuple of floats; a non-list or a non-number entry is a ValueError naming it
    (LongRopeScaling checks that they are positive)."""
    value = params[name]
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value):
        raise ValueError(f"{name} must be a list of numbers, got {value!r:.80}")
    return tuple(float(x) for x in value)


# rope_type -> its parser (params, max_position_embeddings) -> scaling; "default" is plain rope (no scaling).
_ROPE_PARSERS: Mapping[str, Callable[[Mapping[str, Any], int], RopeScaling]] = {
    "llama3": _llama3_scaling,
    "linear": _linear_scaling,
    "yarn": _yarn_scaling,
    "dynamic": _dynamic_scaling,
    "longrope": _longrope_scaling,
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", *_ROPE_PARSERS)


def _flat_rope_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """One rope dict; a per-layer-type nesting is accepted when all layers share one entry."""
    if not params:
        return {}
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    if not nested:
        return dict(params)
    if len(nested) == len(params) and all(v == nested[0] for v in nested):
        return dict(nested[0])
    raise ValueError(f"rope_parameters differing per layer type are not supported: {dict(params)}")


def _architecture(hf: Mapping[str, Any]) -> str:
    """The single architecture name in config.json, validated."""
    architectures = hf.get("architectures") or []
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or architectures[0] not in SUPPORTED_ARCHITECTURES
    ):
        raise ValueError(f"architectures {architectures!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    return architectures[0]


def _reject_unsupported_features(hf: Mapping[str, Any]) -> None:
    """Raise for config options the model code does not implement (rather than silently ignoring them)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; supported: ('silu',)")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported; supported: 1.0")


def _checkpoint_dtype(hf: Mapping[str, Any]) -> str:
    """The checkpoint's dtype (`dtype` in transformers 5, `torch_dtype` before); float32 if none."""
    return hf.get("dtype") or hf.get("torch_dtype") or "float32"


_MISSING: Any = object()


def _required(hf: Mapping[str, Any], name: str) -> Any:
    """hf[name], or a ValueError naming the missing field."""
    if name not in hf:
        raise ValueError(f"config.json is missing required field {name!r}")
    return hf[name]


def _int_field(hf: Mapping[str, Any], name: str, default: Any = _MISSING) -> int:
    """hf[name] (or ``default`` when absent or null) as a positive int; a bool, float or str is an error."""
    value = hf.get(name) if default is not _MISSING else _required(hf, name)
    if value is None and default is not _MISSING:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _optional_int_field(hf: Mapping[str, Any], name: str) -> int | None:
    """hf[name] as a positive int, or None when absent or null; a bool, float or str is an error."""
    return None if hf.get(name) is None else _int_field(hf, name)


def _real_field(hf: Mapping[str, Any], name: str, default: float | None) -> float:
    """hf[name] (or ``default`` when absent or null; a None default = required) as a finite positive float."""
    value = hf[name] if default is None else hf.get(name)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _optional_real_field(hf: Mapping[str, Any], name: str) -> float | None:
    """hf[name] as a finite float >= 0, or None when absent or null; a bool, str or negative number is an error."""
    value = hf.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def _bool_field(hf: Mapping[str, Any], name: str, default: bool) -> bool:
    """hf[name] (or ``default`` when absent or null) as a bool; "false" or 0 is an error, not a truthy value."""
    value = hf.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _mapping_field(hf: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """hf[name] as a mapping ({} when absent or null)."""
    value = hf.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object, got {value!r}")
    return value


def _check_positive(name: str, value: int) -> None:
    """Raise unless `value` is a positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

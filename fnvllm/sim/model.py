"""ModelShape: the dimensions of a decoder that the cost model needs, from a named shape or a config.json.

Only shapes matter to the simulator (weights are never loaded), so this module reads config.json itself instead
of ``fnvllm.model.config`` (which imports torch); each family's experts, sliding windows and Gemma 3's fields are
read as the engine reads them (``fnvllm.sim.families``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from fnvllm.published import QWEN3_COMMON, QWEN3_SHAPES
from fnvllm.sim.checks import SimInputError, check_bool_field, check_count, check_mapping, check_text
from fnvllm.sim.families import PUBLISHED_SHAPES, architecture, decoder_fields, read_experts, read_window

# Upper ends of the dimensions: far above any released decoder, low enough that products stay meaningful.
MAX_DIM = 1 << 20
MAX_LAYERS = 10_000
MAX_HEADS = 1 << 16
MAX_VOCAB = 1 << 24
_DTYPE_BYTES: Mapping[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
KV_CACHE_DTYPES = ("auto", "fp8")  # as EngineConfig.kv_cache_dtype
QUANTIZATIONS = ("fp8",)  # as EngineConfig.quantization (None: the model's dtype)
FP8_SCALE_BLOCK = 128  # an FP8 linear carries one float32 scale per 128 x 128 block of its weight


@attrs.frozen
class ModelShape:
    """A Qwen3 / Qwen2 / Llama / Mistral / Phi-3 / Gemma 3 decoder, or a Qwen3-MoE / Qwen2-MoE / Mixtral mixture of
    experts, as numbers.

    name: label for tables. hidden / layers / intermediate / vocab: the usual sizes.
    q_heads / kv_heads / head_dim: attention heads (grouped-query when kv_heads < q_heads).
    tied: the LM head shares the embedding matrix (its weights are read once either way).
    dtype_bytes: bytes per weight and KV element of the model's dtype (2 for bf16). max_len:
    max_position_embeddings.
    kv_cache_dtype: the engine's KV cache storage, "auto" (the model's dtype) or "fp8" (one byte an element; the
    per-layer, per-head scales are negligible). quantization: None, or "fp8": the decoder layers' linears hold one
    byte a weight plus a float32 scale per 128 x 128 block (an official FP8 checkpoint, or ``quantization="fp8"``
    on a 16-bit one); embeddings, norms and the LM head keep the model's dtype, as in the engine.
    experts / experts_per_tok / expert_intermediate: a mixture of experts' routed experts per sparse layer, the
    top-k each token goes to and each expert's intermediate width (0, 0, 0: a dense model). shared_intermediate:
    Qwen2-MoE's shared expert's width (0: none). dense_layers: layers of a mixture of experts that keep a dense MLP
    of ``intermediate`` (mlp_only_layers, decoder_sparse_step). FP8 weights make the experts one byte a weight
    too, but they multiply in the model's dtype (weight-only: dequantized in registers).
    window / window_layers: the sliding window in tokens and how many layers attend within it (None, 0: full
    attention everywhere); such a layer's query sees at most ``window`` keys. Gemma 3's GeGLU and extra norms
    cost what SwiGLU and Llama's norms do here (the same three matrices; norms are negligible).

    Worked example (Qwen3-0.6B): a token's K and V over the 28 layers take 2 x 28 x 1,024 x 2 = 114,688 bytes in
    bf16, 57,344 with ``kv_cache_dtype="fp8"``; the layers' linears hold 28 x 15,728,640 weights, 880.8 MB in bf16
    and 440.5 MB in FP8 (440.4 MB of weights, 0.1 MB of block scales).
    """

    name: str
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    dtype_bytes: int = 2
    max_len: int = 40960
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    window: int | None = None
    window_layers: int = 0

    def __attrs_post_init__(self) -> None:
        check_text(self.name, "model name", non_empty=False)
        for field, high in (
            ("hidden", MAX_DIM),
            ("layers", MAX_LAYERS),
            ("q_heads", MAX_HEADS),
            ("kv_heads", MAX_HEADS),
            ("head_dim", MAX_DIM),
            ("intermediate", MAX_DIM),
            ("vocab", MAX_VOCAB),
        ):
            check_count(getattr(self, field), f"model {field}", 1, high)
        check_bool_field(self.tied, "model tied")
        if self.dtype_bytes not in (1, 2, 4):
            raise SimInputError(f"model dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes!r}")
        check_count(self.max_len, "model max_len (max_position_embeddings)", 1, 1 << 40)
        check_precision(self.kv_cache_dtype, self.quantization)
        if self.q_heads % self.kv_heads:
            raise SimInputError(f"model q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        self._check_experts()
        self._check_window()

    def _check_experts(self) -> None:
        """SimInputError naming the field unless the expert fields are all 0 (dense) or describe a mixture."""
        if not self.experts:
            names = ("experts_per_tok", "expert_intermediate", "shared_intermediate", "dense_layers")
            for name in names:
                if getattr(self, name) != 0:
                    raise SimInputError(
                        f"model {name} must be 0 for a dense model (experts 0), got {getattr(self, name)!r}"
                    )
            return
        check_count(self.experts, "model experts", 1, MAX_HEADS)
        check_count(self.experts_per_tok, "model experts_per_tok", 1, self.experts)
        check_count(self.expert_intermediate, "model expert_intermediate", 1, MAX_DIM)
        check_count(self.shared_intermediate, "model shared_intermediate", 0, MAX_DIM)
        check_count(self.dense_layers, "model dense_layers", 0, self.layers)

    def _check_window(self) -> None:
        """SimInputError naming the field unless window is None with no window_layers, or a count of tokens with
        1..layers windowed layers."""
        if self.window is None:
            check_count(self.window_layers, "model window_layers (no window)", 0, 0)
            return
        check_count(self.window, "model window", 1, 1 << 40)
        check_count(self.window_layers, "model window_layers", 1, self.layers)

    @property
    def sparse_layers(self) -> int:
        """Layers that route to experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output."""
        return self.kv_heads * self.head_dim

    @property
    def kv_element_bytes(self) -> int:
        """Bytes of one K or V element in the cache: 1 with an FP8 cache, else the model's dtype's."""
        return 1 if self.kv_cache_dtype == "fp8" else self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.layers * self.kv_size * self.kv_element_bytes

    @property
    def linear_bytes_per_weight(self) -> float:
        """Bytes a decoder-layer linear holds per weight: the model's dtype's, or with FP8 weights one byte plus its
        share of a float32 scale per 128 x 128 block (4 / 16,384)."""
        return 1 + 4 / FP8_SCALE_BLOCK**2 if self.quantization == "fp8" else float(self.dtype_bytes)

    @property
    def layer_params(self) -> int:
        """Matmul weights of one dense decoder layer (qkv, o, gate_up, down; norms are negligible)."""
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def attention_params(self) -> int:
        """Matmul weights of one layer's attention (qkv, o)."""
        return self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden

    @property
    def sparse_mlp_params(self) -> int:
        """Linear weights of one sparse layer's MLP in memory: every expert and the shared expert (the router and
        the shared expert's gate, kept in the model's dtype, are ``router_params``); 0 for a dense model."""
        return 3 * self.hidden * (self.experts * self.expert_intermediate + self.shared_intermediate)

    @property
    def router_params(self) -> int:
        """Weights of one sparse layer's router and shared-expert gate (hidden -> experts, hidden -> 1)."""
        return self.hidden * (self.experts + (1 if self.shared_intermediate else 0)) if self.experts else 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in memory (embedding, layers, experts, and an untied LM head)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        dense_mlps = (self.layers - self.sparse_layers) * 3 * self.hidden * self.intermediate
        linears = self.layers * self.attention_params + dense_mlps + self.sparse_layers * self.sparse_mlp_params
        other = embeddings + self.sparse_layers * self.router_params
        return round(linears * self.linear_bytes_per_weight) + other * self.dtype_bytes

    def to_config(self) -> dict[str, Any]:
        """The config.json fields this shape was read from (``from_config`` reads them back): FP8 weights as an
        official FP8 checkpoint's ``quantization_config``, an FP8 cache as the (fnvllm) key ``kv_cache_dtype``,
        experts as Qwen3-MoE's fields, a window as use_sliding_window with layer_types."""
        precision: dict[str, Any] = {}
        if self.quantization == "fp8":
            precision["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        if self.kv_cache_dtype != "auto":
            precision["kv_cache_dtype"] = self.kv_cache_dtype
        return {**self._dense_config(), **precision, **self._experts_config(), **self._window_config()}

    def _experts_config(self) -> dict[str, Any]:
        """The expert fields as a Qwen3-MoE / Qwen2-MoE config.json writes them (the dense layers first)."""
        if not self.experts:
            return {}
        fields = {
            "num_experts": self.experts,
            "num_experts_per_tok": self.experts_per_tok,
            "moe_intermediate_size": self.expert_intermediate,
            "mlp_only_layers": list(range(self.dense_layers)),
        }
        return fields | (
            {"shared_expert_intermediate_size": self.shared_intermediate} if self.shared_intermediate else {}
        )

    def _window_config(self) -> dict[str, Any]:
        """The window as use_sliding_window and layer_types (the last window_layers layers windowed)."""
        if self.window is None:
            return {}
        types = ["full_attention"] * (self.layers - self.window_layers) + ["sliding_attention"] * self.window_layers
        return {"use_sliding_window": True, "sliding_window": self.window, "layer_types": types}

    def _dense_config(self) -> dict[str, Any]:
        """The config.json fields of a dense decoder."""
        dtypes = {2: "bfloat16", 4: "float32"}
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.q_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "torch_dtype": dtypes.get(self.dtype_bytes, "bfloat16"),
            "max_position_embeddings": self.max_len,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "model") -> ModelShape:
        """From a Hugging Face config.json dict (Qwen3 / Qwen2 / Llama / Mistral / Phi-3 keys, Gemma 3's top-level
        or text_config fields over transformers' defaults, Qwen3-MoE / Qwen2-MoE / Mixtral experts and each
        family's sliding windows: ``fnvllm.sim.families``; an official FP8 checkpoint's ``quantization_config``
        gives FP8 weights, and a ``kv_cache_dtype`` key, as ``to_config`` writes it, the cache's storage);
        SimInputError naming a missing or out-of-range key (0 heads, a string where a size belongs, a
        quantization method the cost model does not price)."""
        fields = decoder_fields(check_mapping(config, "config.json"))
        dims = _dimensions(fields)
        experts, per_tok, width, shared, dense = read_experts(fields, dims["layers"])
        window, window_layers = read_window(fields, architecture(config), dims["layers"], dims["max_len"])
        return cls(
            name=name,
            **dims,
            kv_cache_dtype=str(config.get("kv_cache_dtype", "auto")),
            quantization=_quantization_of(config),
            experts=experts,
            experts_per_tok=per_tok,
            expert_intermediate=width,
            shared_intermediate=shared,
            dense_layers=dense,
            window=window,
            window_layers=window_layers,
        )

    def with_precision(self, kv_cache_dtype: str = "auto", quantization: str | None = None) -> ModelShape:
        """This shape as an engine with these options runs it: ``kv_cache_dtype`` "fp8" stores the cache in FP8
        ("auto" keeps this shape's), ``quantization`` "fp8" quantizes the linears (None keeps this shape's: an
        FP8 checkpoint loads in FP8 whatever the option says, as in the engine)."""
        return attrs.evolve(
            self,
            kv_cache_dtype=self.kv_cache_dtype if kv_cache_dtype == "auto" else kv_cache_dtype,
            quantization=self.quantization if quantization is None else quantization,
        )


def _dimensions(config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelShape's dense fields from a decoder's config.json fields; SimInputError naming a missing or
    out-of-range key."""
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if key not in config:
            raise SimInputError(f"config.json lacks {key!r}, which the cost model needs")
    hidden = check_count(config["hidden_size"], "config.json hidden_size", 1, MAX_DIM)
    q_heads = check_count(config["num_attention_heads"], "config.json num_attention_heads", 1, MAX_HEADS)
    kv_heads, head_dim, max_len = (
        config.get(k) for k in ("num_key_value_heads", "head_dim", "max_position_embeddings")
    )
    return {
        "hidden": hidden,
        "layers": check_count(config["num_hidden_layers"], "config.json num_hidden_layers", 1, MAX_LAYERS),
        "q_heads": q_heads,
        "kv_heads": q_heads
        if kv_heads is None
        else check_count(kv_heads, "config.json num_key_value_heads", 1, q_heads),
        "head_dim": hidden // q_heads
        if head_dim is None
        else check_count(head_dim, "config.json head_dim", 1, MAX_DIM),
        "intermediate": check_count(config["intermediate_size"], "config.json intermediate_size", 1, MAX_DIM),
        "vocab": check_count(config["vocab_size"], "config.json vocab_size", 1, MAX_VOCAB),
        "tied": bool(config.get("tie_word_embeddings", False)),
        "dtype_bytes": _DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2),
        "max_len": 40960
        if max_len is None
        else check_count(max_len, "config.json max_position_embeddings", 1, 1 << 40),
    }


def check_precision(kv_cache_dtype: object, quantization: object) -> None:
    """SimInputError naming ``kv_cache_dtype`` or ``quantization`` when it is not one the engine takes."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SimInputError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise SimInputError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {quantization!r}")


# an official FP8 checkpoint's quantization_config (Qwen3-8B-FP8's), as ``to_config`` writes FP8 weights
FP8_QUANTIZATION_CONFIG: Mapping[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_SCALE_BLOCK, FP8_SCALE_BLOCK],
}


def _quantization_of(config: Mapping[str, Any]) -> str | None:
    """ "fp8" for a config.json with an FP8 ``quantization_config``, None without one; SimInputError for another
    method (the cost model prices 16/32-bit and FP8 weights only)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = check_mapping(qc, "config.json quantization_config").get("quant_method")
    if method not in QUANTIZATIONS:
        raise SimInputError(
            f"config.json quantization_config.quant_method {method!r} is not priced; the simulator prices "
            f"{list(QUANTIZATIONS)} or unquantized weights"
        )
    return str(method)


NAMED_SHAPES: Mapping[str, Mapping[str, Any]] = {
    **{name: {**QWEN3_COMMON, **shape} for name, shape in QWEN3_SHAPES.items()},
    **PUBLISHED_SHAPES,
}


def load_shape(name_or_path: str | Path) -> ModelShape:
    """A named shape (``NAMED_SHAPES``), a checkpoint folder (its config.json) or a config.json file.

    Raises ValueError naming the known shapes when ``name_or_path`` is neither.
    """
    key = str(name_or_path).lower()
    if key in NAMED_SHAPES:
        return ModelShape.from_config(NAMED_SHAPES[key], name=key)
    path = Path(name_or_path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"model shape {str(name_or_path)!r} is neither one of {sorted(NAMED_SHAPES)} nor a config.json"
        )
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SimInputError(f"{file} is not a config.json: {e}") from None
    try:
        return ModelShape.from_config(config, name=path.name)
    except SimInputError as e:
        raise type(e)(f"{file}: {e}") from None

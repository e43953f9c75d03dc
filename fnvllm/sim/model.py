"""ModelShape: the dimensions of a decoder that the cost model needs, from a named shape or a config.json.

Only shapes matter to the simulator (weights are never loaded), so this module reads config.json itself instead
of ``fnvllm.model.config`` (which imports torch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

_DTYPE_BYTES: Mapping[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}


@attrs.frozen
class ModelShape:
    """A Qwen3 / Qwen2 / Llama-style decoder, as numbers.

    name: label for tables. hidden / layers / intermediate / vocab: the usual sizes.
    q_heads / kv_heads / head_dim: attention heads (grouped-query when kv_heads < q_heads).
    tied: the LM head shares the embedding matrix (its weights are read once either way).
    dtype_bytes: bytes per weight and KV element (2 for bf16). max_len: max_position_embeddings.
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

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output."""
        return self.kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.layers * self.kv_size * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (qkv, o, gate_up, down; norms are negligible)."""
        h = self.hidden
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in memory (embedding, layers, and an untied LM head)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.layers * self.layer_params + embeddings) * self.dtype_bytes

    def to_config(self) -> dict[str, Any]:
        """The config.json fields this shape was read from (``from_config`` reads them back)."""
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
        """From a Hugging Face config.json dict (Qwen3 / Qwen2 / Llama keys)."""
        try:
            hidden, q_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                name=name,
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                q_heads=q_heads,
                kv_heads=int(config.get("num_key_value_heads") or q_heads),
                head_dim=int(config.get("head_dim") or hidden // q_heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                dtype_bytes=_DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2),
                max_len=int(config.get("max_position_embeddings", 40960)),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}, which the cost model needs") from None


_QWEN3_COMMON: Mapping[str, Any] = {"vocab_size": 151936, "head_dim": 128, "max_position_embeddings": 40960}
NAMED_SHAPES: Mapping[str, Mapping[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "intermediate_size": 3072,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
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
    return ModelShape.from_config(json.loads(file.read_text()), name=path.name)

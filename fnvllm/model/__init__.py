"""Model definitions (Qwen3, Qwen3-MoE, Qwen2, Qwen2-MoE, Llama, Mistral, Mixtral), their building blocks, and
the safetensors loader."""

from fnvllm.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, MoeConfig
from fnvllm.model.loader import CheckpointMismatchError, load_model
from fnvllm.model.models import DecoderForCausalLM, KVCache, build_model
from fnvllm.model.rope import (
    DynamicNtkRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    RopeScaling,
    YarnRopeScaling,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointMismatchError",
    "DecoderForCausalLM",
    "DynamicNtkRopeScaling",
    "KVCache",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "ModelConfig",
    "MoeConfig",
    "RopeScaling",
    "YarnRopeScaling",
    "build_model",
    "load_model",
]

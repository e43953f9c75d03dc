"""EngineConfig: the user-facing engine options (frozen, validated), and how they become a CoreConfig.

Model facts come from the checkpoint's config.json (``fnvllm.model.config.ModelConfig``); this file holds what
the user chooses. Nothing here is written after construction: derived values (the KV block count chosen from
free memory, the model's max length) are computed into a new CoreConfig, never patched into this one.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from fnvllm.state import CoreConfig, InvalidConfigError

DeviceName = Literal["auto", "cpu", "cuda"]


def _positive(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise InvalidConfigError(f"{attribute.name} must be None or an int >= 1, got {value!r}")


def _count(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _seconds(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidConfigError(f"{attribute.name} must be a number of seconds > 0, got {value!r}")


def _one_of(*allowed: object) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            raise InvalidConfigError(f"{attribute.name} must be one of {allowed}, got {value!r}")

    return check


def _backend_name(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    from fnvllm.kernels.backends import backend_names  # lists module names without importing them

    allowed = ("auto", *backend_names())
    if value not in allowed:
        raise InvalidConfigError(f"{attribute.name} must be one of {allowed}, got {value!r}")


def _fraction(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 < value <= 1:
        raise InvalidConfigError(f"{attribute.name} must be in (0, 1], got {value!r}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine options (``LLM(path, **options)`` takes these names).

    dtype: weights/activations dtype; None = the checkpoint's (``torch_dtype`` in config.json).
    device: "auto" picks CUDA when available, else the CPU.
    block_size: tokens per KV block.
    num_blocks: KV blocks; None = sized from memory (``gpu_memory_utilization`` on GPU, ``cpu_kv_cache_gib``
        on CPU).
    gpu_memory_utilization: fraction of GPU memory the engine may use (weights + KV cache + activations).
    cpu_kv_cache_gib: KV cache size on the CPU when ``num_blocks`` is None.
    max_num_batched_tokens: token budget of one step.
    max_num_seqs: cap on running sequences.
    max_model_len: cap on prompt + output tokens; None = the model's max_position_embeddings.
    enable_prefix_caching: reuse KV of shared prompt prefixes.
    attention_backend: "auto" (the fastest backend available on the device) or a module name of
        ``fnvllm.kernels.backends`` ("torch", "triton", "flash"); a named backend that cannot run here is an
        error when the LLM is built, naming what to install.
    enforce_eager: never capture CUDA graphs (decode steps run eagerly).
    model_ops: implementation of the small fused ops (norms, rotary, SiLU-and-mul): "torch", "compile"
        (torch.compile), "triton"; "auto" = triton on CUDA when importable, else torch.
    seed: seed of the sampler's shared generator (unseeded requests).
    tensor_parallel_size: processes (one per GPU) the model is split over; > 1 starts worker processes
        (``fnvllm.executor.tp``) or joins the ``torchrun`` group this process was launched in.
    distributed_timeout_s: longest wait on another tensor-parallel rank (start-up, one step's collectives)
        before rank 0 reports it as failed.
    """

    dtype: str | None = None
    device: DeviceName = attrs.field(default="auto", validator=_one_of("auto", "cpu", "cuda"))
    block_size: int = attrs.field(default=16, validator=_positive)
    num_blocks: int | None = attrs.field(default=None, validator=_positive)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    cpu_kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    enable_prefix_caching: bool = True
    attention_backend: str = attrs.field(default="auto", validator=_backend_name)
    seed: int = 0
    enforce_eager: bool = False
    model_ops: str = attrs.field(default="auto", validator=_one_of("auto", "torch", "compile", "triton"))
    tensor_parallel_size: int = attrs.field(default=1, validator=_count)
    distributed_timeout_s: float = attrs.field(default=300.0, validator=_seconds)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """Build from keyword options; an unknown name is an error listing the known ones (never dropped)."""
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)

    def core_config(
        self, num_blocks: int, model_max_len: int, eos_token_ids: frozenset[int], vocab_size: int
    ) -> CoreConfig:
        """The pure core's settings for a model with these facts and a pool of ``num_blocks``."""
        max_len = self.max_model_len or model_max_len
        if max_len > model_max_len:
            raise InvalidConfigError(
                f"max_model_len must be <= the model's max_position_embeddings ({model_max_len}), got {max_len}"
            )
        return CoreConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_len,
            enable_prefix_caching=self.enable_prefix_caching,
            eos_token_ids=eos_token_ids,
            vocab_size=vocab_size,
        )
